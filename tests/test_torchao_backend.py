"""TorchAO's real float8 linear path (its _scaled_mm on the CPU) against the emulation of the same
TorchAO recipe, OCP and FNUZ. Shapes stay small: TorchAO's CPU path is only a reference."""

import pytest
import torch
from helpers import run_linear, sqnrs

import titan_primus as tp


@pytest.mark.parametrize(
    "device, recipe",
    [(d, r) for d in ("cpu", "gfx942") for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")]
    + [("cpu", "mxfp8")],  # TorchAO's emulated MX (its real MX kernels need SM100)
)
def test_torchao_linear_matches_emulation(device, recipe):
    x = torch.randn(2, 48, 128, dtype=torch.bfloat16)
    w = torch.randn(64, 128) * 0.05
    b = torch.randn(64)
    g = torch.randn(2, 48, 64)
    ao = tp.select_backend("linear", recipe, device, "torchao")
    got = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b, recipe=recipe, backend="torchao", device=device), x, w, b, g)
    emulated = run_linear(
        lambda x, w, b: tp.fp8_linear(x, w, b, recipe=ao.recipe, backend="emulated", device=device), x, w, b, g
    )
    assert got[0].dtype == torch.bfloat16
    assert min(sqnrs(emulated, got)) >= 40, sqnrs(emulated, got)
    assert torch.backends.mkldnn.enabled  # oneDNN is off only inside the FP8 region


def test_torchao_refuses_other_definitions():
    recipe = tp.make_recipe("rowwise", "primus_turbo", tp.device_profile("gfx942"))
    with pytest.raises(tp.BackendUnavailableError, match="torchao definition"):
        tp.fp8_linear(torch.randn(4, 16), torch.randn(16, 16), recipe=recipe, backend="torchao", device="gfx942")


@pytest.mark.cuda
def test_torchao_on_real_fp8_gpu_matches_emulation():
    decision = tp.select_backend("linear", "rowwise")
    assert decision.backend_name == "torchao", decision.explain()
    x = torch.randn(512, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, 1024, device="cuda") * 0.02
    g = torch.randn(512, 2048, device="cuda")
    got = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b), x, w, None, g)
    emulated = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b, recipe=decision.recipe, backend="emulated"), x, w, None, g)
    assert min(sqnrs(emulated, got)) >= 40
