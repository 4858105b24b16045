"""The MI300 test of the compiled path (tests/support/mi300_primus_turbo.py, on the GPU through tests/unit/test_mi300_primus_turbo.py), run here on
Primus-Turbo's own code with ``aot_eager``: costly under the interpreter, so on one
architecture per build, alternating (conftest.py ``one_arch``)."""

from real_turbo.conftest import one_arch
from support.mi300_primus_turbo import test_compiled_path_on_the_real_kernels, turbo  # noqa: F401

pytestmark = one_arch
