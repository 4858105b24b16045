"""The attention route on TorchTitan 0.3 (titan_primus.attention, titan_primus.integrations.torchtitan.v0_3.attention):
which layers go where and why, the masks and scale kept, FP8 attention where its definition
holds (the emulation here), refused with the reason elsewhere, compiled and checkpointed.

On Primus-Turbo's own code: tests/real_turbo/test_attention_route.py (bf16, in TorchTitan's
trainer) and tests/real_turbo/test_attention_fp8.py (the FP8 kernel against the emulation)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from support.closeness import assert_sqnr_at_least, relative_gaps
from support.helpers import sgd_losses
from support.titan_helpers import MODEL_REGISTRIES, build, model_config, token_ids
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

import titan_primus as tp
from titan_primus.attention import (
    AttentionSite,
    attend,
    attention_backends,
    fp8_attention_refusal,
    route_attention,
)
from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.backends.emulated.attention import EmulatedAttention
from titan_primus.device import device_profile
from titan_primus.hookspec import hookimpl
from titan_primus.checkpointing import attention_save_ops
from titan_primus.torchtitan import Float8Converter
from titan_primus.integrations.torchtitan.v0_3.attention import (
    PrimusTurboSDPA,
    PrimusTurboVarlenAttention,
    flash_window,
)

ATTENTION_ONLY = {"linears": False, "grouped_experts": False}


def _converted(config, **options):
    converter = Float8Converter.Config(**ATTENTION_ONLY, **options).build()
    return converter.convert(config), converter.report


def _flex_config(model):
    """The stock config, FlexAttention (document masking) as TorchTitan 0.3 builds it."""
    return importlib.import_module(MODEL_REGISTRIES[model]).model_registry("debugmodel").model


def test_attention_options_are_off_by_default_and_record_nothing():
    config, report = _converted(_flex_config("llama3"), device="gfx942")
    assert not report.attention
    assert all(type(c) is FlexAttention.Config for _, c, _, _ in config.traverse(FlexAttention.Config))


@pytest.mark.parametrize("device", ["cpu", "gfx942", "sm90"])
def test_document_masked_layers_stay_torchtitans_with_the_reason(device):
    """Off MI300-class GPUs with Primus-Turbo (none here: gfx942 without it) every layer keeps
    TorchTitan's attention; FP8 attention cannot express document masking anywhere."""
    config, report = _converted(_flex_config("llama3"), device=device, attention=True, fp8_attention=True)
    assert len(report.attention) == 6 and all(r.backend is None for r in report.attention)
    assert sum(1 for _ in config.traverse(FlexAttention.Config)) == 6
    reasons = {r.reason for r in report.attention}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    if device == "gfx942":
        assert "the primus_turbo backend is not usable here: Primus-Turbo is not importable" in reason
    elif device == "cpu":
        assert "document masking needs varlen attention" in reason
    if device != "cpu":  # the registry's backends ranked here, each with why not
        assert "the torchao backend has no attention kernels" in reason
    data = report.as_dict()["attention"]
    assert set(data) == {r.fqn for r in report.attention}
    assert "attention:" in report.summary()


def test_fp8_attention_refusals_name_the_rule():
    assert fp8_attention_refusal(AttentionSite(causal=True, head_dims=(128, 128))) is None
    assert fp8_attention_refusal(AttentionSite(causal=False, head_dims=(192, 128))) is None
    refused = {
        "document masking": AttentionSite(documents=True),
        "sliding window": AttentionSite(window=(127, 0)),
        "dropout": AttentionSite(dropout=0.1),
        "head dims (16, 16)": AttentionSite(head_dims=(16, 16)),
        "head dims (33, 33)": AttentionSite(head_dims=(33, 33)),
        "sinks": AttentionSite(unmappable="sinks"),
        "grouped-query attention with head dims (64, 32)": AttentionSite(head_dims=(64, 32), grouped=True),
    }
    assert fp8_attention_refusal(AttentionSite(head_dims=(128, 128), grouped=True)) is None  # Llama3-8B's GQA
    assert fp8_attention_refusal(AttentionSite(head_dims=(192, 128))) is None  # DeepSeek-V3's MLA
    for what, site in refused.items():
        assert what in fp8_attention_refusal(site), what


def test_torchtitan_windows_map_to_flash_attention_convention():
    assert flash_window((-1, 0)) == (True, (-1, -1))  # causal
    assert flash_window((-1, -1)) == (False, (-1, -1))  # full
    assert flash_window((127, 0)) == (True, (127, 0))  # causal sliding window of 128 tokens


def test_models_with_masks_of_their_own_keep_flex_with_the_reason():
    from torchtitan.models.gpt_oss import model_registry

    config = model_registry("debugmodel").model
    _, report = _converted(config, device="cpu", attention=True, fp8_attention=True)
    assert report.attention and all(r.backend is None for r in report.attention)
    assert all("builds attention masks of its own" in r.reason for r in report.attention), report.summary()


def _kimi_k2_7():
    return importlib.import_module("torchtitan.models.kimi_k2_7").model_registry("debugmodel").model


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_outside_the_decoder_layers_keeps_the_models_own(fp8):
    """kimi_k2_7's vision encoder attends through a FlexAttention with its own bidirectional
    padding BlockMask, not the decoder's get_attention_masks: it is never routed (before, it was
    reported document-causal and crashed on its first call on an MI300), with the reason; the
    decoder's layers are routed as any decoder's (on Primus-Turbo's code:
    tests/real_turbo/test_attention_route.py)."""
    _, report = _converted(_kimi_k2_7(), device="cpu", attention=True, fp8_attention=fp8)
    routes = {r.fqn: r for r in report.attention}
    assert len(routes) == 7, report.summary()
    vision = routes.pop("vision_encoder.block.attn.inner_attention")
    assert vision.backend is None and "is not in KimiK25Model's decoder layers" in vision.reason, vision
    assert "vision encoder" in vision.reason
    assert all(r.fqn.startswith("layers.") and "decoder layers" not in r.reason for r in routes.values())


def test_sdpa_sites_are_labelled_causal_or_full_by_their_calls():
    """TorchTitan's ScaledDotProductAttention takes is_causal per call (flux passes False):
    the report says so rather than "causal" (deepseek_v3 debug with SDPA, whose MLA head dims
    qualify for FP8 attention; flux itself needs transformers to import)."""
    _, report = _converted(model_config("deepseek_v3"), device="cpu", attention=True, fp8_attention=True)
    assert report.attention and all(r.backend == "emulated" and r.fp8 for r in report.attention), report.summary()
    assert all("causal or full, as each call's is_causal says" in r.reason for r in report.attention)
    assert AttentionSite(causal=None).describe() == "causal or full, as each call's is_causal says"


def _train(model, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(0)
    return sgd_losses(model, token_ids(2, 128, g), token_ids(2, 128, g), steps)


def test_fp8_attention_trains_where_it_qualifies():
    """deepseek_v3 debug with plain causal attention (TorchTitan's ScaledDotProductAttention, its
    MLA head dims 192/128): every layer runs the emulation of Primus-Turbo's FP8 attention, and
    trains as the stock model does. Measured (SGD, 3 steps, seq 128): at most 0.02% apart; bound
    0.5%, and not bitwise (FP8 ran). llama3 debug (head dim 16) is refused by the FP8 backward's
    rule, and trains bitwise as stock."""
    config, report = _converted(model_config("deepseek_v3"), device="cpu", fp8_attention=True)
    assert len(report.attention) == 6 and all(r.backend == "emulated" and r.fp8 for r in report.attention)
    assert sum(1 for _ in config.traverse(PrimusTurboSDPA.Config)) == 6
    fp8, stock = _train(build(config)), _train(build(model_config("deepseek_v3")))
    assert all(0 < g <= 5e-3 for g in relative_gaps(fp8, stock)), (fp8, stock)

    llama, report = _converted(model_config("llama3"), device="cpu", fp8_attention=True)
    assert all(r.backend is None and "head dims (16, 16)" in r.reason for r in report.attention)
    assert _train(build(llama), steps=2) == _train(build(model_config("llama3")), steps=2)


def _sdpa_module(route):
    module = PrimusTurboSDPA(PrimusTurboSDPA.Config(attention_route=route))
    return module


def _qkv(B=1, L=128, H=4, Hkv=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, L, h, D, generator=g).bfloat16().requires_grad_() for h in (H, Hkv, Hkv)]


def _emulated_route():
    return route_attention(
        "layer",
        AttentionSite(head_dims=(64, 64)),
        device=tp.device_profile("gfx942"),
        backend="emulated",
        bf16=False,
        fp8=True,
    )


def test_fp8_route_keeps_the_softmax_scale():
    """deepseek_v3's mscale² (YaRN) reaches the kernel: a scale other than 1/sqrt(D) changes the
    output, and equals fp32 attention at that scale to FP8's accuracy."""
    q, k, v = _qkv()
    module = _sdpa_module(_emulated_route())
    scale = 0.37
    out = module(q, k, v, scale=scale)
    reference = F.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    assert_sqnr_at_least(reference, out.float(), 22)
    assert not torch.equal(out, module(q, k, v, scale=None))


def test_fp8_route_refuses_a_sequence_length_off_its_blocks_with_the_fix():
    q, k, v = _qkv(L=96)
    with pytest.raises(ValueError, match="multiple of 64.*training.seq_len"):
        _sdpa_module(_emulated_route())(q, k, v)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_route_compiles_fullgraph_equal_to_eager(backend):
    q, k, v = _qkv()
    module = _sdpa_module(_emulated_route())
    eager = module(q, k, v, scale=0.125)
    eager.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    compiled = torch.compile(module, fullgraph=True, backend=backend)(q, k, v, scale=0.125)
    compiled.float().square().sum().backward()
    assert torch.equal(eager, compiled)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_selective_ac_saves_the_attention_ops():
    """The routes' forward ops are in Fp8SelectiveAC's save set, like TorchTitan's own attention
    ops: under selective AC a training step of deepseek_v3 debug (FP8 attention in its 6 layers)
    runs the attention forward once per layer, as without AC; TorchTitan's stock policy (which
    does not know the op) and full AC run it twice."""
    from support.titan_helpers import gemms_per_step
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from titan_primus.backends.emulated.attention import FORWARD_OP
    from titan_primus.torchtitan import Fp8SelectiveAC

    assert FORWARD_OP in attention_save_ops()
    save_ops = Fp8SelectiveAC(Fp8SelectiveAC.Config()).get_save_ops()
    assert FORWARD_OP in save_ops and torch.ops.aten._scaled_dot_product_flash_attention.default in save_ops
    config, _ = _converted(model_config("deepseek_v3"), device="cpu", fp8_attention=True)
    policies = (None, Fp8SelectiveAC.Config(), SelectiveAC.Config(), FullAC.Config())
    runs = [gemms_per_step(config, ac, False, {FORWARD_OP}, seq_len=64) for ac in policies]
    assert runs == [(6, 6), (6, 6), (6, 12), (6, 12)], runs


def test_varlen_config_subclasses_keep_torchtitans_masks():
    """The replacement of a VarlenAttention config is one, so Decoder.get_attention_masks keeps
    building VarlenMetadata for it; its window is kept."""
    route = route_attention(
        "l", AttentionSite(documents=True), device=tp.device_profile("cpu"), backend="auto", bf16=True, fp8=False
    )
    config = PrimusTurboVarlenAttention.Config(attention_route=route, window_size=(127, 0))
    assert isinstance(config, VarlenAttention.Config) and not isinstance(config, ScaledDotProductAttention.Config)
    module = PrimusTurboVarlenAttention(config)
    assert module.causal and module.flash_window == (127, 0)


class _CountedAttention(EmulatedAttention):
    calls = 0

    def fp8_attention(self, q, k, v, *, causal, softmax_scale):
        type(self).calls += 1
        return super().fp8_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)


class _AttentionPlugin:
    """A plugin backend that provides FP8 attention and ranks above the emulation on a CPU."""

    class Backend(EmulatedBackend):
        name = "attention_plugin"

        def rank(self, device):
            return 500 if device.kind == "cpu" else 0

        def attention(self):
            return _CountedAttention

    @hookimpl
    def titan_primus_register_backends(self):
        return [self.Backend()]


def test_attention_is_routed_by_the_registry_as_the_gemms_are():
    """Attention goes through the GEMMs' registry: under auto the highest-ranked backend here that
    provides attention kernels (a plugin's, whose kernels each call runs), the backend named
    otherwise; a backend without attention kernels (TorchAO) is named with that reason."""
    site, cpu = AttentionSite(causal=True, head_dims=(64, 64)), device_profile("cpu")
    plugin = _AttentionPlugin()
    tp.registry.register(plugin, name="test-attention-plugin")
    try:
        route = route_attention("layer", site, device=cpu, backend="auto", bf16=False, fp8=True)
        assert (route.backend, route.fp8, route.fp8_dtype) == ("attention_plugin", True, cpu.e4m3), route
        q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.bfloat16) for _ in range(3))
        attend(route, q, k, v, scale=None, causal=True)
        assert _CountedAttention.calls == 1
        assert "attention_plugin" in attention_backends() and "torchao" not in attention_backends()
        assert attention_save_ops() >= _CountedAttention.forward_ops()
        named = route_attention("layer", site, device=cpu, backend="emulated", bf16=False, fp8=True)
        assert named.backend == "emulated", named
        refused = route_attention("layer", site, device=cpu, backend="torchao", bf16=True, fp8=True)
        assert refused.backend is None and "the torchao backend has no attention kernels" in refused.reason
        bf16_only = route_attention("layer", site, device=cpu, backend="auto", bf16=True, fp8=False)
        assert bf16_only.backend is None and "the attention_plugin backend has none" in bf16_only.reason
    finally:
        tp.registry.unregister(plugin)
