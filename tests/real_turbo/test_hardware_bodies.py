"""The MI300 tests' bodies (tests/support/mi300_primus_turbo.py, on the GPU through tests/unit/test_mi300_primus_turbo.py), run here on Primus-Turbo's own
code at every build, on one architecture per build, alternating (conftest.py ``one_arch``: about
a minute of interpreter time per run, so each architecture is covered by two builds): the same
functions, collected again, with this tier's ``hardware`` fixture (conftest.py: CPU tensors, the
architecture's profile). A crash or a wrong routing assertion in one of them shows on every CI
run, not first on an MI300X. The compiled one: test_hardware_bodies_compiled.py.

What cannot run here, and why: docs/ci.md ("Hardware tests")."""

from real_turbo.conftest import one_arch
from support.mi300_primus_turbo import (  # noqa: F401  (collected here with this tier's fixtures)
    test_any_number_of_tokens,
    test_contiguous_b_t_runs_without_transposition,
    test_dense_contraction_edges,
    test_fp32_activations,
    test_fsdp_gathered_fp8_weights_give_exactly_the_normal_path,
    test_grouped_small_k_edge,
    test_tail_rows_of_the_public_op,
    turbo,
)

pytestmark = one_arch
