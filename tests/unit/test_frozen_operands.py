"""A gradient that is not needed costs nothing: with the weight frozen (LoRA base weights,
frozen layers) or the input not requiring grad, backward runs one FP8 GEMM instead of two, fewer
FP8 casts, and forward keeps nothing for the gradient that is not needed. Per backend, op and
recipe, counted per executed kernel (tests/support/gemm_count.py), eager (under torch.compile the
partitioner drops an unused GEMM by itself: seen on Primus-Turbo's path, whose compiled count was 2
before the eager fix). Primus-Turbo's own code: tests/real_turbo/test_compile_and_memory.py."""

import pytest
import torch
from support.doubles import torchao_grouped_kernels
from support.gemm_count import count_gemms_and_casts
from support.helpers import make_offsets

import titan_primus as tp
from titan_primus.diagnostics.memory.saved import recording_saved_tensors

M, K, N = 96, 128, 256  # distinct, so a saved tensor's shape says what it is; whole 32/128 blocks
OFFS = [32, 0, 48, 16]  # rows per expert (one empty), 16-aligned as the converter pads them; 16 trail
# Written here, not asked of the code under test: every case below must run.
CASES = [
    pytest.param(*case, id="-".join(case))
    for case in [("emulated", "cpu", op, r) for op in ("linear", "grouped_mm") for r in tp.RECIPE_NAMES]
    + [("emulated", "gfx942", op, r) for op in ("linear", "grouped_mm") for r in ("tensorwise", "rowwise", "blockwise")]
    + [("torchao", "cpu", "linear", r) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")]
]
# TorchAO's own autograd Functions, which titan-primus calls as they are: each runs both GEMMs and
# every cast whatever needs_input_grad says, and keeps both operands (TorchAO 0.18).
TORCHAO_OWN = {
    "grouped_mm": "_Float8GroupedMM (prototype/moe_training/fp8_grouped_mm.py:155 saves, 202-330 backward)",
    "mxfp8": "mx_mm (prototype/moe_training/mxfp8_linear.py:108 saves, 145- backward)",
}


def _step(backend, device, op, recipe, frozen):
    """(GEMMs, FP8 casts, tensors saved for backward, x, weight) of one forward + backward."""
    decision = tp.select_backend(op, recipe, device, backend, k=K, n=N)
    g = torch.Generator().manual_seed(0)
    if op == "linear":
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05
        offs = None
    else:
        x, w = torch.randn(M + 16, K, generator=g), torch.randn(len(OFFS), N, K, generator=g) * 0.05
        offs = make_offsets(OFFS)
    x, w = x.bfloat16().requires_grad_(frozen != "input"), w.bfloat16().requires_grad_(frozen != "weight")

    def forward():
        if op == "linear":
            return decision.backend.linear(x, w, None, decision.recipe)
        return decision.backend.grouped_mm(x, w.transpose(-2, -1), offs, decision.recipe)

    # Every GEMM: rowwise_with_gw_hp's wgrad and TorchAO's emulated MX GEMMs are plain aten.mm.
    ops = decision.backend.fp8_gemm_ops() | {torch.ops.aten.mm.default}
    with recording_saved_tensors() as saved:
        out, forward_gemms, forward_casts = count_gemms_and_casts(forward, ops)
    grad = torch.randn(out.shape, generator=g).to(out.dtype)
    _, gemms, casts = count_gemms_and_casts(lambda: out.backward(grad), ops)
    assert (x.grad is None) == (frozen == "input") and (w.grad is None) == (frozen == "weight")
    return forward_gemms + gemms, forward_casts + casts, saved, x, w


def _check(backend, device, op, recipe, frozen):
    gemms, casts, saved, x, w = _step(backend, device, op, recipe, frozen)
    full_gemms, full_casts, *_ = _step(backend, device, op, recipe, None)
    assert (full_gemms, gemms) == (3, 2)
    # rowwise_with_gw_hp's wgrad casts nothing.
    assert casts < full_casts or (frozen, recipe) == ("weight", "rowwise_with_gw_hp"), (casts, full_casts)
    shapes = [tuple(t.shape) for t in saved]
    if frozen == "weight":
        assert tuple(x.shape) not in shapes, shapes  # no activation kept
    else:
        w_shapes = {tuple(w.shape), tuple(w.transpose(-2, -1).shape)}
        assert not w_shapes & set(shapes), shapes  # no weight kept


@pytest.mark.parametrize("frozen", ["weight", "input"])
@pytest.mark.parametrize("backend, device, op, recipe", CASES)
def test_a_frozen_operand_costs_no_gemm_no_cast_and_keeps_nothing(backend, device, op, recipe, frozen):
    _check(backend, device, op, recipe, frozen)


@pytest.mark.xfail(strict=True, reason=f"TorchAO 0.18: {TORCHAO_OWN['grouped_mm']}")
@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_torchao_grouped_frozen_operand(frozen, monkeypatch):
    """TorchAO's own grouped autograd Function (its Python, on CPU stand-ins for its kernels):
    strict xfail, so it reports when TorchAO starts honouring ``needs_input_grad``."""
    torchao_grouped_kernels.install(monkeypatch)
    stand_in, calls = torch._scaled_grouped_mm, []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: calls.append(1) or stand_in(*a, **k))
    _step("torchao", "sm90", "grouped_mm", "rowwise", frozen)
    assert len(calls) == 2


@pytest.mark.xfail(strict=True, reason=f"TorchAO 0.18: {TORCHAO_OWN['mxfp8']}")
@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_torchao_mxfp8_frozen_operand(frozen):
    _check("torchao", "cpu", "linear", "mxfp8", frozen)
