"""The TorchTitan 0.2.x adapter with Primus-Turbo's own package: routing, and the converted
modules computing what the shared ops compute (tests_tt02/test_numerics.py does the same for the
backends that run in any process)."""

import os

import pytest
import torch
import torchtitan.models.moe.utils as moe_utils
from test_numerics import TOKENS_PER_EXPERT, assert_close_db, converted_module, leaf, reference_experts
from tt02_helpers import convert, meta_model

import titan_primus as tp
from titan_primus.torchtitan02 import Fp8GroupedExperts, Fp8Linear

ARCH = os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")  # the harness: conftest.py here


def test_routing_on_mi300_with_primus_turbo():
    model = meta_model("deepseek_v3")
    report = convert(model, device=ARCH).report
    assert {op: d.backend_name for op, d in report.decisions.items()} == {"linear": "primus_turbo", "grouped_mm": "primus_turbo"}
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
    module = converted_module("llama3", "layers.0.feed_forward.w1", "primus_turbo", ARCH, recipe)
    assert isinstance(module, Fp8Linear)
    x = torch.randn(2, 24, module.in_features)
    x1 = leaf(x)
    out = module(x1)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    x2, w2 = leaf(x), leaf(module.weight)
    ref = tp.fp8_linear(x2, w2, None, recipe=recipe, backend="primus_turbo", device=ARCH)
    ref.backward(grad_out)
    assert_close_db(ref, out, "output")
    assert_close_db(x2.grad, x1.grad, "grad_input")
    assert_close_db(w2.grad, module.weight.grad, "grad_weight")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_experts_match_the_shared_op(recipe):
    experts = converted_module("deepseek_v3", "layers.1.moe.experts", "primus_turbo", ARCH, recipe)
    assert isinstance(experts, Fp8GroupedExperts)
    counts = torch.tensor(TOKENS_PER_EXPERT)
    x = torch.randn(int(counts.sum()), experts.w1.shape[2])
    x1 = leaf(x)
    out = experts(x1, counts)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    x2, w1, w2, w3 = (leaf(t) for t in (x, experts.w1, experts.w2, experts.w3))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    ref = reference_experts(x2, w1, w2, w3, offs, recipe=recipe, backend="primus_turbo", device=ARCH)
    ref.backward(grad_out)
    assert_close_db(ref, out, "output")
    assert_close_db(x2.grad, x1.grad, "grad_input")
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        assert_close_db(w.grad, getattr(experts, name).grad, f"grad {name}")
