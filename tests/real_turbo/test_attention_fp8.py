"""FP8 attention against Primus-Turbo's own Triton kernel (flash_attn_fp8_func, blockwise 64):
the emulation (titan_primus/backends/emulated/attention.py) reproduces it, and titan-primus's
opaque op around Primus-Turbo (backends/primus_turbo/attention_fp8.py) is it, bit for bit."""

import pytest
import torch
from support.closeness import assert_bitwise, assert_sqnr_at_least
from support.helpers import attention_grads

from real_turbo.conftest import ARCH, TURBO
from titan_primus.backends.emulated.attention import fp8_attention as emulated_fp8_attention
from titan_primus.backends.primus_turbo.attention_fp8 import fp8_attention as turbo_fp8_attention
from titan_primus.self_check import FP8_ATTENTION_BOUNDS

FP8_DTYPE = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}[ARCH]
# (B, L, Hq, Hkv, D, Dv): GQA 2:1 at D 32 and 64 (Llama-like), MHA at D 128 and at DeepSeek-V3's
# MLA head dims, 192 for q/k and 128 for v (GQA with unequal head dims is refused: docs/attention.md).
SHAPES = [
    (2, L, Hq, Hkv, D, Dv)
    for L in (128, 192)
    for Hq, Hkv, D, Dv in ((2, 1, 32, 32), (4, 2, 64, 64), (4, 4, 128, 128), (4, 4, 192, 128))
]

# The emulation sums exactly and rounds once where the kernel sums in its own order. The bounds
# (FP8_ATTENTION_BOUNDS, with the figures) were measured over these 32 cases at the 4 builds x 2
# archs; conversion's self-check holds a routed kernel to them.


def _inputs(B, L, Hq, Hkv, D, Dv, heavy_tailed, seed=0):
    """q, k, v, dout in bf16: N(0, 1), or heavy-tailed (Student's t with 3 degrees of freedom,
    outliers a per-tensor FP8 scale must span)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = torch.randn(*shape, generator=g)
        if heavy_tailed:
            x = x / (torch.randn(*shape, 3, generator=g).pow(2).mean(-1).sqrt() + 1e-3)
        return x.to(torch.bfloat16)

    return draw(B, L, Hq, D), draw(B, L, Hkv, D), draw(B, L, Hkv, Dv), draw(B, L, Hq, Dv)


def _turbo_public(causal):
    return lambda q, k, v: TURBO.ops.flash_attn_fp8_func(q, k, v, softmax_scale=None, causal=causal)


@pytest.mark.parametrize("heavy_tailed", [False, True], ids=["normal", "heavy_tailed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_emulation_tracks_primus_turbo_kernel_within_measured_bounds(shape, causal, heavy_tailed):
    q, k, v, dout = _inputs(*shape, heavy_tailed)
    turbo = attention_grads(_turbo_public(causal), q, k, v, dout)
    emulated = attention_grads(
        lambda *t: emulated_fp8_attention(*t, causal=causal, softmax_scale=None, fp8_dtype=FP8_DTYPE), q, k, v, dout
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), turbo, emulated):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.isfinite(a).all() and torch.isfinite(b).all(), name
        min_db, max_fraction = FP8_ATTENTION_BOUNDS[name]
        differing = int((a.view(torch.int16) != b.view(torch.int16)).sum())
        db = float("inf") if differing == 0 else assert_sqnr_at_least(a.float(), b.float(), min_db, name)
        print(f"{name}: {db:.1f} dB, {differing} of {a.numel()} elements differ")
        assert differing <= max_fraction * a.numel(), f"{name}: {differing} of {a.numel()} elements differ"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 128, 4, 2, 64, 64), (2, 128, 4, 4, 192, 128)], ids=str)
def test_opaque_op_is_flash_attn_fp8_func(shape, causal):
    q, k, v, dout = _inputs(*shape, heavy_tailed=False)
    theirs = attention_grads(_turbo_public(causal), q, k, v, dout)
    ours = attention_grads(lambda *t: turbo_fp8_attention(*t, causal=causal, softmax_scale=None), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), theirs, ours):
        assert_bitwise(a, b, name)
    # bhsd memory (TorchTitan 0.2's views), which flash_attn_fp8_func itself would mis-permute.
    bhsd_memory = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    strided = attention_grads(lambda *t: turbo_fp8_attention(*t, causal=causal, softmax_scale=None), *bhsd_memory, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), theirs, strided):
        assert_bitwise(a, b, f"bhsd memory {name}")


def test_opaque_op_compiles_fullgraph_equal_to_eager():
    q, k, v, dout = _inputs(1, 128, 2, 1, 32, 32, heavy_tailed=False)

    def fn(q, k, v):
        return turbo_fp8_attention(q, k, v, causal=True, softmax_scale=None)

    eager = attention_grads(fn, q, k, v, dout)
    torch._dynamo.reset()
    compiled = attention_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert_bitwise(a, b, name)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opaque_op_is_a_well_formed_custom_op(causal):
    """torch.library.opcheck's fake and autograd-registration checks (the others cannot sum FP8
    outputs on a CPU: tests/unit/test_custom_ops.py), and no output aliasing an input. Primus-Turbo's
    kernel hands back an output that requires grad (attention_triton_impl.py), which the fake did
    not: the op detaches it."""
    from support.custom_ops import WITHOUT_FP8_ARITHMETIC, no_output_aliases_an_input

    from titan_primus.backends.primus_turbo.attention_fp8 import FORWARD_OP

    q, k, v, _ = _inputs(1, 128, 2, 1, 32, 32, heavy_tailed=False)
    args = tuple(t.requires_grad_() for t in (q, k, v)) + (causal, 0.125)
    no_output_aliases_an_input(FORWARD_OP, args)
    torch.library.opcheck(FORWARD_OP, args, test_utils=WITHOUT_FP8_ARITHMETIC)


def test_every_primus_turbo_op_is_checked_on_its_own_code():
    """Primus-Turbo's ops of titan-primus: the attention forward above, the weight's backward
    operands (test_compile_and_memory.py); the mxfp8 ones need FlyDSL and HIP kernels (no CPU)."""
    from support.custom_ops import defined_ops

    checked = {"titan_primus::primus_turbo_fp8_attention_forward", "titan_primus::primus_turbo_weight_for_backward"}
    mxfp8 = {
        f"titan_primus::primus_turbo_mx_{name}"
        for name in ("linear", "linear_backward", "grouped_mm", "grouped_mm_backward")
    }
    assert {name for name in defined_ops() if "primus_turbo" in name} == checked | mxfp8
