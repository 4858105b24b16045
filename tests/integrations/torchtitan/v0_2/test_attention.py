"""The attention route on TorchTitan 0.2.x: which wrappers are swapped and why, FP8 attention (the
emulation of Primus-Turbo's, on a CPU) where its definition holds, in TorchTitan's real trainer
from the TOML options. On Primus-Turbo's own code: tests/integrations/torchtitan/v0_2/real_turbo/test_attention.py."""

import pytest
from support.closeness import relative_gaps
from support.helpers import sgd_losses
from torchtitan.models.attention import FlexAttentionWrapper, ScaledDotProductAttentionWrapper
from tt02_helpers import EXAMPLES, convert, materialize, meta_model, run_trainer, tokens

from titan_primus.integrations.torchtitan.v0_2.attention import PrimusTurboSDPAWrapper

ATTENTION_ONLY = {"linears": False, "grouped_experts": False}


def _train(model, steps=3) -> list[float]:
    return sgd_losses(model, tokens(seq=128), tokens(seq=128, seed=2), steps)


def test_fp8_attention_trains_deepseek_v3_and_refuses_llama3_with_the_reason():
    """deepseek_v3 debug (SDPA causal, MLA head dims 192/128) runs every layer's attention on the
    emulation of Primus-Turbo's FP8 attention, with its softmax scale. Measured (SGD, 3 steps,
    seq 128): at most 0.016% from the stock model; bound 0.5%, and not bitwise (FP8 ran).
    llama3 debug's head dim 16 is under the FP8 backward's minimum (32): refused, bitwise stock."""
    model = meta_model("deepseek_v3")
    report = convert(model, device="cpu", fp8_attention=True, **ATTENTION_ONLY).report
    assert len(report.attention) == 6 and all(r.backend == "emulated" and r.fp8 for r in report.attention)
    assert not any(isinstance(m, ScaledDotProductAttentionWrapper) for m in model.modules())
    fp8, stock = _train(materialize(model)), _train(materialize(meta_model("deepseek_v3")))
    assert all(0 < g <= 5e-3 for g in relative_gaps(fp8, stock)), (fp8, stock)

    llama = meta_model("llama3")
    report = convert(llama, device="cpu", fp8_attention=True, **ATTENTION_ONLY).report
    assert all(r.backend is None and "head dims (16, 16)" in r.reason for r in report.attention)
    assert _train(materialize(llama), steps=2) == _train(materialize(meta_model("llama3")), steps=2)


def test_flex_attention_keeps_torchtitans_path_with_the_reason():
    model = meta_model("deepseek_v3", "debugmodel_flex_attn")
    report = convert(model, device="gfx942", attention=True, fp8_attention=True, **ATTENTION_ONLY).report
    assert report.attention and all(r.backend is None for r in report.attention)
    assert sum(isinstance(m, FlexAttentionWrapper) for m in model.modules()) == len(report.attention)


def test_context_parallelism_keeps_torchtitans_attention_with_the_reason():
    from tt02_helpers import parallel_dims

    model = meta_model("deepseek_v3")
    report = convert(model, parallel_dims(2, cp=2), device="cpu", fp8_attention=True, **ATTENTION_ONLY).report
    assert report.attention and all(r.backend is None and "context parallelism" in r.reason for r in report.attention)
    assert not any(isinstance(m, PrimusTurboSDPAWrapper) for m in model.modules())


def test_off_by_default_and_nothing_swapped():
    model = meta_model("llama3")
    report = convert(model, device="cpu").report
    assert not report.attention
    assert not any(isinstance(m, PrimusTurboSDPAWrapper) for m in model.modules())


@pytest.mark.trainer
def test_trainer_runs_fp8_attention_from_the_toml_options(tmp_path):
    """TorchTitan 0.2.2's trainer, deepseek_v3 debug example, ``--titan_primus.fp8_attention``
    (the linears and experts in FP8 too, as the example converts them): the routing report names
    every attention layer, and the run tracks the same run without FP8 attention (measured: at most
    0.03% apart over 3 steps, seq 128; bound 0.5%)."""
    toml = EXAMPLES / "deepseek_v3_debug_fp8.toml"
    fp8, log = run_trainer(toml, tmp_path / "fp8", 3, "--titan_primus.fp8_attention")
    assert "attention: layers.0.attention.inner_attention" in log and "emulated FP8 attention (blockwise 64)" in log
    without, _ = run_trainer(toml, tmp_path / "bf16", 3)
    assert sorted(fp8) == [1, 2, 3]
    assert max(relative_gaps(fp8, without)) <= 5e-3, (fp8, without)
    assert fp8 != without
