"""The attention route on the REAL kernels and GPU (``mi300``: an MI300-class GPU with
Primus-Turbo; ci/mi300x.sh). The tests are tests/support/mi300_attention.py's, which the real-code
tier collects too (tests/real_turbo/test_attention_bodies.py)."""

import pytest
from support.mi300_attention import (  # noqa: F401  (collected here, on the MI300-class GPU)
    test_bf16_route_equals_fp32_attention_on_the_same_masks,
    test_fp8_route_equals_the_emulation,
    test_routes_compile_fullgraph_equal_to_eager,
)

pytestmark = pytest.mark.mi300
