"""titan-primus's Primus-Turbo path computes what Primus-Turbo's own public ops compute, bit for
bit: output, input gradient and weight gradient, for every recipe it routes there."""

import pytest
import torch

import titan_primus as tp
from real_turbo.calls import CudaLooking, grads, turbo_config
from real_turbo.conftest import RECIPES, TURBO
from titan_primus.backends.primus_turbo.autograd import group_offsets
from titan_primus.grouping import group_lens


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
    ours = grads(lambda a, b: backend.linear(a, b, None, fp8), x, w)
    config = turbo_config(recipe)
    out_dtype = dtype if dtype != torch.float32 else torch.bfloat16
    theirs = grads(
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
    ours = grads(lambda a, w: backend.grouped_mm(a, w.transpose(-2, -1), offs, fp8), A, W)
    lens = group_lens(offs).as_subclass(CudaLooking)
    theirs = grads(
        lambda a, w: TURBO.ops.grouped_gemm_fp8(
            a,
            w,
            lens,
            group_offs=group_offsets(offs),
            trans_b=True,
            out_dtype=torch.bfloat16,
            config=turbo_config(recipe),
        ),
        A,
        W,
    )
    _assert_bitwise(ours, theirs)
