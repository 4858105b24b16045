"""The attention route's MI300 tests (tests/support/mi300_attention.py, on the GPU through tests/unit/test_mi300_attention.py), run here on Primus-Turbo's
own code at every build and architecture, with this tier's ``hardware`` fixture (CPU tensors, the
architecture's profile, ``aot_eager``): bf16 Primus-Turbo attention on AITER's kernels as
aiter_stand_in.py computes them, FP8 attention on Primus-Turbo's Triton kernel under the
interpreter. A crash or a wrong routing assertion shows on every CI run, not first on an MI300X."""

from support.mi300_attention import (  # noqa: F401  (collected here with this tier's fixtures)
    test_bf16_route_equals_fp32_attention_on_the_same_masks,
    test_fp8_route_equals_the_emulation,
    test_routes_compile_fullgraph_equal_to_eager,
)
