"""The TorchTitan 0.2.x adapter with Primus-Turbo's own package: routing, and the converted
modules computing what the shared ops compute (tests/integrations/torchtitan/v0_2/test_numerics.py does the same for the
backends that run in any process)."""

import os

import pytest
import adapter_numerics as numerics
import torchtitan.models.moe.utils as moe_utils
from tt02_helpers import convert, meta_model

from titan_primus.torchtitan02 import Fp8GroupedExperts

ARCH = os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")  # the harness: conftest.py here


def test_routing_on_mi300_with_primus_turbo():
    model = meta_model("deepseek_v3")
    report = convert(model, device=ARCH).report
    assert {op: d.backend_name for op, d in report.decisions.items()} == {
        "linear": "primus_turbo",
        "grouped_mm": "primus_turbo",
    }
    assert report.decisions["linear"].recipe.definition == "primus_turbo"
    # Primus-Turbo takes ragged token groups: TorchTitan's alignment and the experts are left alone.
    assert moe_utils.TOKEN_GROUP_ALIGN_SIZE_M == 8
    assert not any(m.pad_token_groups for m in model.modules() if isinstance(m, Fp8GroupedExperts))
    # rowwise_with_gw_hp has no Primus-Turbo equivalent: linears fall back to TorchAO, experts
    # (no TorchAO grouped GEMM for it) stay in high precision, saying why.
    report = convert(meta_model("deepseek_v3"), device=ARCH, recipe="rowwise_with_gw_hp").report
    assert {op: d.backend_name for op, d in report.decisions.items()} == {"linear": "torchao"}
    assert report.skipped("experts") and all("no FP8 backend here" in r.reason for r in report.skipped("experts"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_matches_the_shared_op(recipe):
    numerics.fp8_linear_matches_the_shared_op("primus_turbo", ARCH, recipe)


@pytest.mark.parametrize("tokens", numerics.TOKENS_PER_EXPERT)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_experts_match_the_shared_op(recipe, tokens):
    """On Primus-Turbo's own code too, a rank whose experts receive no token among them."""
    numerics.fp8_experts_match_the_shared_op("primus_turbo", ARCH, recipe, pad_token_groups=False, tokens=tokens)
