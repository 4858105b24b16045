"""Routing on named device profiles: the 0.2 adapter picks what the 0.3 adapter picks, fixes it
in the swapped modules at conversion, and pads token groups only for TorchAO."""

from importlib.metadata import version

import pytest
import torch
import torchtitan.models.moe.utils as moe_utils
from tt02_helpers import convert, meta_model, parallel_dims

import titan_primus as tp
from titan_primus.torchtitan02 import Fp8GroupedExperts, Fp8Linear
from titan_primus.recipes import with_token_groups_padded_to


# TorchAO's FP8 grouped GEMM (_to_fp8_rowwise_then_scaled_grouped_mm) exists from torchao 0.17; on
# older ones (make test-oldest: 0.15) the experts of a GPU model stay in high precision (the
# emulation never stands in for missing kernels on a GPU), and the report says why.
TORCHAO_GROUPED_MM = tuple(int(part) for part in version("torchao").split(".")[:2]) >= (0, 17)
FP8_GROUPED_MM = {"grouped_mm": "torchao"} if TORCHAO_GROUPED_MM else {}


def routes(report) -> dict[str, str]:
    return {op: d.backend_name for op, d in report.decisions.items()}


def fp8_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8GroupedExperts))]


@pytest.mark.parametrize(
    "device, recipe, expected",
    [
        ("cpu", "rowwise", {"linear": "emulated", "grouped_mm": "emulated"}),
        ("sm90", "rowwise", {"linear": "torchao", **FP8_GROUPED_MM}),
        ("gfx950", "rowwise", {"linear": "torchao", **FP8_GROUPED_MM}),
        # TorchAO's grouped GEMM is rowwise only, and on a GPU the emulation never stands in for
        # missing kernels: tensorwise experts stay in high precision.
        ("gfx942", "tensorwise", {"linear": "torchao"}),
    ],
)
def test_routing_on_profiles_without_primus_turbo(device, recipe, expected):
    model = meta_model("deepseek_v3")
    report = convert(model, device=device, recipe=recipe).report
    assert routes(report) == expected
    for module in fp8_modules(model):
        op = "grouped_mm" if isinstance(module, Fp8GroupedExperts) else "linear"
        assert module.fp8_backend is report.decisions[op].backend  # decided once, held by the module
        expected = report.decisions[op].recipe
        if op == "grouped_mm":  # groups come padded by the dispatcher where the backend needs it
            expected = with_token_groups_padded_to(expected, module.fp8_backend.group_alignment(expected))
        assert module.fp8_recipe == expected
    if recipe == "rowwise" and device != "cpu" and not TORCHAO_GROUPED_MM:
        assert all("torchao 0.17" in r.reason for r in report.skipped("experts"))
    if device == "gfx942":
        assert "Primus-Turbo is not importable" in dict(report.decisions["linear"].passed_over)["primus_turbo"]
        assert report.decisions["linear"].recipe.e4m3 == torch.float8_e4m3fnuz


@pytest.mark.skipif(not TORCHAO_GROUPED_MM, reason=f"torchao {version('torchao')} has no FP8 grouped GEMM (0.17+)")
def test_torchao_experts_pad_token_groups_to_16():
    model = meta_model("deepseek_v3")
    convert(model, device="sm90")
    experts = [m for m in model.modules() if isinstance(m, Fp8GroupedExperts)]
    assert experts and all(m.pad_token_groups for m in experts)
    assert moe_utils.TOKEN_GROUP_ALIGN_SIZE_M == 16


def test_strict_refuses_a_fallback_and_a_named_backend_never_falls_back():
    with pytest.raises(tp.BackendUnavailableError, match="strict=True: primus_turbo.*not importable"):
        convert(meta_model("llama3"), device="gfx942", strict=True)
    with pytest.raises(tp.BackendUnavailableError, match="MI300-class"):
        convert(meta_model("llama3"), device="cpu", backend="primus_turbo", strict=True)
    # A named backend never falls back, strict or not.
    with pytest.raises(tp.BackendUnavailableError, match='MI300-class.*named in the FP8 config.*backend="auto"'):
        convert(meta_model("llama3"), device="cpu", backend="primus_turbo")


def test_backend_requested_by_name_and_by_environment(monkeypatch):
    assert routes(convert(meta_model("deepseek_v3"), device="sm90", backend="emulated").report) == {
        "linear": "emulated",
        "grouped_mm": "emulated",
    }
    monkeypatch.setenv("TITAN_PRIMUS_BACKEND", "emulated")
    assert routes(convert(meta_model("llama3"), device="sm90").report) == {"linear": "emulated"}


def test_parallelisms_that_would_change_the_numerics_are_refused_at_conversion():
    """As the 0.3 adapter does: FSDP is fine, TP is not, EP where scales stay within an expert or
    are defined over a rank's experts (Primus-Turbo's definitions)."""
    convert(meta_model("deepseek_v3"), parallel_dims(world_size=8))  # FSDP 8
    with pytest.raises(ValueError, match=r"tensor parallelism \(degree 2\).*Fp8Linear"):
        convert(meta_model("llama3"), parallel_dims(world_size=2, tp=2))
    # TP with every linear kept in high precision converts nothing, so nothing to refuse.
    convert(meta_model("llama3"), parallel_dims(world_size=2, tp=2), linears=False)

    ep = parallel_dims(world_size=4, ep=4)
    convert(meta_model("deepseek_v3"), ep, recipe="rowwise")  # TorchAO definition: per-expert scales
    with pytest.raises(ValueError, match=r"expert parallelism \(degree 4\) with recipe tensorwise"):
        convert(meta_model("deepseek_v3"), ep, recipe="tensorwise")
    convert(meta_model("deepseek_v3"), ep, recipe="tensorwise", grouped_experts=False)
    # Primus-Turbo's definitions: scales that span experts are taken over the rank's experts.
    for recipe in ("tensorwise", "rowwise"):
        report = convert(meta_model("deepseek_v3"), ep, recipe=recipe, device="gfx942", backend="emulated").report
        assert report.decisions["grouped_mm"].recipe.definition == "primus_turbo"
        assert "under expert parallelism: scales spanning experts" in report.summary()
    # Their expert weights gather FP8 where FSDP2 shards them within EP: test_fsdp_fp8_all_gather.py.
