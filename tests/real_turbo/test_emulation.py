"""The emulated backend's Primus-Turbo definitions against Primus-Turbo's own code: the same FP8
payloads and scales, and GEMM results equal to within one bf16 ulp in all but a few elements
(what remains is accumulation order)."""

import sys

import pytest
import torch

import titan_primus as tp
from real_turbo.conftest import ARCH, RECIPES, TURBO
from support.closeness import fraction_beyond
from real_turbo.calls import grads
from titan_primus.fp8.blocks import cells_of, quantize_blocks
from titan_primus.fp8.scaling import quantize

# Measured: at most 4.07 in 100,000 elements more than one bf16 ulp apart (gfx950; gfx942 3.05),
# the same at every build (2026-12-01). docs/recipes.md and docs/measurements.md state this bound beside that figure.
MAX_FRACTION_BEYOND_ONE_ULP = 5e-5


def _beyond_one_ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements more than one bf16 ulp apart; a NaN or inf counts as apart."""
    a, b = a.float(), b.float()
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    return fraction_beyond(a - b, ulp)


def _backends(recipe):
    made = tp.make_recipe(recipe, "primus_turbo", tp.device_profile(ARCH))
    return tp.registry.get_backend("primus_turbo"), tp.registry.get_backend("emulated"), made


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_emulation_is_primus_turbo_to_one_ulp(recipe, dtype):
    turbo, emulated, made = _backends(recipe)
    x, w = torch.randn(256, 384, dtype=dtype), torch.randn(512, 384, dtype=dtype)
    ours = grads(lambda a, b: turbo.linear(a, b, None, made), x, w)
    emul = grads(lambda a, b: emulated.linear(a, b, None, made), x, w)
    for name, a, b in zip(("out", "grad_input", "grad_weight"), ours, emul):
        assert a.dtype == b.dtype, name
        assert _beyond_one_ulp(a, b) <= MAX_FRACTION_BEYOND_ONE_ULP, name


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_emulation_is_primus_turbo_to_one_ulp(recipe):
    turbo, emulated, made = _backends(recipe)
    offs = torch.tensor([96, 96, 256, 384], dtype=torch.int32)  # an empty expert, 16 trailing rows
    A, W = torch.randn(400, 256, dtype=torch.bfloat16), torch.randn(4, 512, 256, dtype=torch.bfloat16)
    ours = grads(lambda a, w: turbo.grouped_mm(a, w.transpose(-2, -1), offs, made), A, W)
    emul = grads(lambda a, w: emulated.grouped_mm(a, w.transpose(-2, -1), offs, made), A, W)
    for name, a, b in zip(("out", "grad_input", "grad_weight"), ours, emul):
        assert _beyond_one_ulp(a, b) <= MAX_FRACTION_BEYOND_ONE_ULP, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("axis", [None, -1, -2])
def test_emulated_quantization_is_the_quantizers(dtype, axis):
    """Tensorwise and rowwise: the same payload and scale_inv (fl(1 / scale)) as
    ``quantize_fp8_{tensorwise,rowwise}_impl`` (HIP: the stand-ins, citing the C++ maths)."""
    quant = sys.modules["primus_turbo.pytorch.kernels.quantization.quantization_impl"]
    x = torch.randn(96, 160, dtype=dtype) * torch.logspace(-3, 3, 160)
    for fp8 in (TURBO.float8_e4m3, TURBO.float8_e5m2):
        if axis is None:
            q, scale_inv = quant.quantize_fp8_tensorwise_impl(x, fp8)
        else:
            q, scale_inv = quant.quantize_fp8_rowwise_impl(x, fp8, axis % 2)
        data, scale = quantize(x, fp8, None if axis is None else axis % 2, pow2=False)
        assert torch.equal(data.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(torch.reciprocal(scale), scale_inv.reshape(scale.shape))


def test_emulated_block_quantization_is_the_triton_quantizers():
    """Blockwise: 1x128 activation tiles (row and column) and 128x128 weight blocks, as
    Primus-Turbo's Triton quantizers make them."""
    quant = sys.modules["primus_turbo.pytorch.kernels.quantization.quantization_impl"]
    rule = tp.make_recipe("blockwise", "primus_turbo", tp.device_profile(ARCH)).block_scale
    fp8 = TURBO.float8_e4m3
    x = (torch.randn(256, 384) * torch.logspace(-2, 2, 384)).bfloat16()
    row, row_s, col, col_s = quant.quant_fp8_blockwise_dual_impl(x, fp8, block_size=128)
    data, scale_inv = quantize_blocks(x, fp8, rule, cells_of(x.shape, (1, 128), x.device))
    assert torch.equal(data.view(torch.uint8), row.view(torch.uint8)) and torch.equal(scale_inv, row_s)
    data, scale_inv = quantize_blocks(x.t(), fp8, rule, cells_of((384, 256), (1, 128), x.device))
    assert torch.equal(data.t().view(torch.uint8), col.view(torch.uint8)) and torch.equal(scale_inv.t(), col_s)
    weight, weight_s = quant.quant_fp8_blockwise_for_weight_impl(x, fp8, block_size=128)
    data, scale_inv = quantize_blocks(x, fp8, rule, cells_of(x.shape, (128, 128), x.device))
    assert torch.equal(data.view(torch.uint8), weight.view(torch.uint8)) and torch.equal(scale_inv, weight_s)
