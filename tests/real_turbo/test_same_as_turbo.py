"""titan-primus's Primus-Turbo path computes what Primus-Turbo's own public ops compute, bit for
bit: output, input gradient and weight gradient, for every recipe it routes there."""

import pytest
import torch

import titan_primus as tp
from real_turbo.conftest import RECIPES, TURBO
from titan_primus.backends.primus_turbo.autograd import group_offsets
from titan_primus.grouping import group_lens


def _config(recipe):
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity

    granularity = {"tensorwise": "TENSORWISE", "rowwise": "ROWWISE", "blockwise": "BLOCKWISE"}[recipe]
    return Float8QuantConfig(
        format=Format.HYBRID if recipe == "tensorwise" else Format.E4M3,
        granularity=getattr(ScalingGranularity, granularity),
        block_size=128 if recipe == "blockwise" else None,
    )


class CudaLooking(torch.Tensor):
    """Primus-Turbo's grouped quantization asserts ``group_lens.is_cuda`` (a CPU-only artefact)."""

    @property
    def is_cuda(self):
        return True


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(grad)
    return out.detach(), *(leaf.grad for leaf in leaves)


def _assert_bitwise(ours, theirs):
    for name, a, b in zip(("out", "grad_input", "grad_weight"), ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max difference"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_is_primus_turbos_own(recipe, dtype, device):
    x, w = torch.randn(256, 384, dtype=dtype), torch.randn(256, 384, dtype=dtype)
    backend = tp.registry.get_backend("primus_turbo")
    fp8 = tp.make_recipe(recipe, "primus_turbo", device)
    ours = _grads(lambda a, b: backend.linear(a, b, None, fp8), x, w)
    config = _config(recipe)
    out_dtype = dtype if dtype != torch.float32 else torch.bfloat16
    theirs = _grads(
        lambda a, b: TURBO.ops.gemm_fp8(a, b, trans_b=True, out_dtype=out_dtype, config=config).to(dtype), x, w
    )
    _assert_bitwise(ours, theirs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_is_primus_turbos_own(recipe, device):
    counts = torch.tensor([96, 0, 160, 256])
    offs = counts.cumsum(0).to(torch.int32)
    A = torch.randn(int(offs[-1]), 256, dtype=torch.bfloat16)
    W = torch.randn(4, 384, 256, dtype=torch.bfloat16)  # [E, N, K], TorchTitan's B_t is its transposed view
    backend = tp.registry.get_backend("primus_turbo")
    fp8 = tp.make_recipe(recipe, "primus_turbo", device)
    ours = _grads(lambda a, w: backend.grouped_mm(a, w.transpose(-2, -1), offs, fp8), A, W)
    lens = group_lens(offs).as_subclass(CudaLooking)
    theirs = _grads(
        lambda a, w: TURBO.ops.grouped_gemm_fp8(
            a, w, lens, group_offs=group_offsets(offs), trans_b=True, out_dtype=torch.bfloat16, config=_config(recipe)
        ),
        A,
        W,
    )
    _assert_bitwise(ours, theirs)
