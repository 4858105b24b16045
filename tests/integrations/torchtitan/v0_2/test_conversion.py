"""Float8Converter on TorchTitan 0.2.2's real debug models: what it swaps, what it keeps and why;
that converted models keep their state dicts, initialise, and run forward and backward."""

import logging

import pytest
import torch
from torch import nn
from torchtitan.models.moe.moe import GroupedExperts
from tt02_helpers import MODELS, convert, materialize, meta_model, tokens

from titan_primus.torchtitan02 import Fp8GroupedExperts, Fp8Linear


def signature(model: nn.Module) -> dict:
    return {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("model_name", MODELS)
def test_swaps_every_plain_linear_and_expert_block_keeping_parameters(model_name):
    model = meta_model(model_name)
    before = signature(model)
    params = dict(model.named_parameters())
    linears = {f for f, m in model.named_modules() if isinstance(m, nn.Linear)}
    experts = {f for f, m in model.named_modules() if isinstance(m, GroupedExperts)}
    report = convert(model).report

    assert signature(model) == before  # same names, shapes, dtypes: checkpoints load either way
    assert all(p is params[name] for name, p in model.named_parameters())  # moved, not copied
    modules = dict(model.named_modules())
    for fqn in linears:
        expected = nn.Linear if "router.gate" in fqn else Fp8Linear
        assert type(modules[fqn]) is expected, fqn
    assert all(type(modules[fqn]) is Fp8GroupedExperts for fqn in experts)
    assert {r.fqn for r in report.converted("linear")} == {f for f in linears if "router.gate" not in f}
    assert {r.fqn for r in report.converted("experts")} == experts
    assert {r.reason for r in report.skipped()} <= {"matches filter_fqns entry 'router.gate'"}
    assert all(m.fp8_backend.name == "emulated" for m in modules.values() if hasattr(m, "fp8_backend"))


def test_report_matches_the_0_3_adapters_on_deepseek_v3(caplog):
    """The same counts and wording the 0.3 adapter logs for its deepseek_v3 debug model."""
    with caplog.at_level(logging.INFO, logger="titan_primus"):
        report = convert(meta_model("deepseek_v3"), recipe="tensorwise").report
    text = report.summary()
    assert text in caplog.text
    assert "titan-primus FP8 routing on CPU" in text and "recipe tensorwise" in text
    assert "linears: 43 -> emulated (tensorwise (torchao definition, e4m3fn)" in text
    assert "grouped experts: 5 -> emulated" in text
    assert "passed over primus_turbo" in text
    assert "kept in high precision: layers.1.moe.router.gate" in text


def test_options_choose_what_is_converted():
    report = convert(meta_model("deepseek_v3"), grouped_experts=False).report
    assert len(report.converted("linear")) == 43 and not [r for r in report.layers if r.kind == "experts"]
    model = meta_model("deepseek_v3")
    report = convert(model, linears=False).report
    assert not [r for r in report.layers if r.kind == "linear"] and len(report.converted("experts")) == 5
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())

    report = convert(meta_model("llama3"), filter_fqns=["output", "wo"]).report
    skipped = {r.fqn: r.reason for r in report.skipped("linear")}
    assert skipped["output"] == "matches filter_fqns entry 'output'"
    assert skipped["layers.0.attention.wo"] == "matches filter_fqns entry 'wo'"
    assert len(skipped) == 1 + 6

    report = convert(meta_model("llama3"), auto_filter_small_kn=True).report
    assert not report.converted()  # debug dims are all below TorchAO's H100 thresholds
    assert "too small to gain from FP8 (K=256" in report.skipped()[0].reason


def test_linear_subclasses_and_already_converted_layers_stay_as_they_are():
    model = meta_model("llama3")
    convert(model)
    report = convert(model).report  # listed twice in [model] converters
    assert not report.converted()
    assert report.skipped()[0].reason == "Fp8Linear has its own forward, which FP8 would replace"


@pytest.mark.parametrize("model_name", MODELS)
def test_converted_model_initialises_and_trains_on_cpu(model_name):
    model = materialize(meta_model(model_name))
    converted = meta_model(model_name)
    convert(converted)  # on the meta model, as the trainer does
    converted = materialize(converted)
    # init_weights sees the same parameters in the same order: the same initial values.
    for (name, p), (_, q) in zip(model.named_parameters(), converted.named_parameters()):
        torch.testing.assert_close(p, q, msg=name)

    out = converted(tokens())
    loss = nn.functional.cross_entropy(out.flatten(0, 1).float(), tokens(seed=2).flatten())
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in converted.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    ref_loss = nn.functional.cross_entropy(model(tokens()).flatten(0, 1).float(), tokens(seed=2).flatten())
    assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item()


def test_high_precision_checkpoint_loads_into_the_converted_model():
    stock = materialize(meta_model("deepseek_v3"), seed=3)
    converted = meta_model("deepseek_v3")
    convert(converted)
    converted = materialize(converted, seed=4)
    converted.load_state_dict(stock.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), converted.state_dict().values()))
