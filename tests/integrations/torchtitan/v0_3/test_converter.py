"""Float8Converter on TorchTitan 0.3's real debug model configs: what it converts, skips and
why, on each device profile; that the converted models build, run and keep their state dicts."""

import logging
from dataclasses import fields

import pytest
import torch
from support.closeness import assert_sqnr_at_least
from support.titan_helpers import build, convert, model_config, token_ids
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher

import titan_primus as tp
from titan_primus.torchtitan import Float8Converter, Fp8Linear

MODELS = ["llama3", "deepseek_v3", "qwen3"]


def linear_fqns(config):
    return {fqn: cfg for fqn, cfg, _, _ in config.traverse(Linear.Config)}


@pytest.mark.parametrize("model", MODELS)
def test_converts_every_plain_linear_and_expert_block(model):
    stock = model_config(model)
    before = linear_fqns(stock)
    config, report = convert(config=stock, device="cpu")
    after = linear_fqns(config)
    assert before.keys() == after.keys()
    for fqn, cfg in after.items():
        if "router.gate" in fqn:
            assert type(cfg) is Linear.Config  # kept exact by the default filter
        else:
            assert isinstance(cfg, Fp8Linear.Config) and isinstance(cfg, Linear.Config), fqn
            assert cfg.fp8_backend == "emulated"
            assert (cfg.in_features, cfg.out_features, cfg.bias) == (
                before[fqn].in_features,
                before[fqn].out_features,
                before[fqn].bias,
            )
            assert cfg.param_init is before[fqn].param_init
    experts = list(config.traverse(GroupedExperts.Config))
    assert len(report.converted("experts")) == len(experts)
    assert all(cfg.fp8_backend == "emulated" for _, cfg, _, _ in experts)
    assert len(report.converted("linear")) == sum(1 for f in before if "router.gate" not in f)
    assert {r.reason for r in report.skipped()} <= {"matches filter_fqns entry 'router.gate'"}


def test_filter_fqns_and_small_dims_stay_high_precision_with_reasons():
    config, report = convert(filter_fqns=["lm_head", "wo"], device="cpu")
    skipped = {r.fqn: r.reason for r in report.skipped("linear")}
    assert skipped["lm_head"] == "matches filter_fqns entry 'lm_head'"
    assert skipped["layers.0.attention.wo"] == "matches filter_fqns entry 'wo'"
    assert type(linear_fqns(config)["lm_head"]) is Linear.Config
    _, report = convert(auto_filter_small_kn=True, device="cpu")
    assert not report.converted("linear")  # debug dims (256..2048) are all below TorchAO's H100 thresholds
    assert "too small to gain from FP8 (K=256, N=768" in report.skipped("linear")[1].reason
    # A backend's shape limits keep a layer in high precision rather than moving it elsewhere.
    _, report = convert("deepseek_v3", device="sm90")
    assert all(r.backend == "torchao" for r in report.converted())


def test_report_summary_names_backends_recipes_and_skips():
    _, report = convert("deepseek_v3", device="cpu", recipe="tensorwise")
    text = report.summary()
    assert "recipe tensorwise" in text
    assert "linears: 43 -> emulated (tensorwise (torchao definition, e4m3fn)" in text
    assert "grouped experts: 5 -> emulated" in text
    assert "passed over primus_turbo" in text
    assert "kept in high precision: layers.1.moe.router.gate" in text


def routes(report):
    return {op: d.backend_name for op, d in report.decisions.items()}


def test_routing_on_profiles_without_primus_turbo():
    assert routes(convert("deepseek_v3", device="cpu")[1]) == {"linear": "emulated", "grouped_mm": "emulated"}
    assert routes(convert("deepseek_v3", device="sm90")[1]) == {"linear": "torchao", "grouped_mm": "torchao"}
    assert routes(convert("deepseek_v3", device="gfx950")[1]) == {"linear": "torchao", "grouped_mm": "torchao"}
    _, report = convert("deepseek_v3", device="gfx942", recipe="tensorwise")
    # No kernel here runs tensorwise grouped GEMMs: the experts stay in high precision, saying why
    # (on a GPU the emulation never stands in for missing kernels).
    assert routes(report) == {"linear": "torchao"}
    assert report.skipped("experts") and all(
        "no FP8 backend here" in r.reason and "only the rowwise recipe" in r.reason for r in report.skipped("experts")
    )
    assert "Primus-Turbo is not importable" in dict(report.decisions["linear"].passed_over)["primus_turbo"]
    assert report.decisions["linear"].recipe.e4m3 == torch.float8_e4m3fnuz


def test_torchao_experts_get_the_padding_token_dispatcher():
    config, _ = convert("deepseek_v3", device="sm90")
    dispatchers = [parent.token_dispatcher for _, _, parent, _ in config.traverse(GroupedExperts.Config)]
    assert dispatchers and all(
        isinstance(d, TorchAOTokenDispatcher.Config) and d.pad_multiple == 16 for d in dispatchers
    )


def test_strict_refuses_a_fallback_and_a_named_backend_never_falls_back(caplog):
    with pytest.raises(tp.BackendUnavailableError, match="strict=True: primus_turbo.*not importable"):
        convert(device="gfx942", strict=True)
    with pytest.raises(tp.BackendUnavailableError, match="MI300-class"):
        convert(device="cpu", backend="primus_turbo", strict=True)
    with caplog.at_level(logging.INFO, logger="titan_primus"):
        _, report = convert(device="gfx942")
    assert routes(report) == {"linear": "torchao"}
    assert "passed over primus_turbo: Primus-Turbo is not importable" in caplog.text
    # A named backend never falls back, strict or not: another backend is another FP8 definition.
    with pytest.raises(tp.BackendUnavailableError, match='MI300-class.*named in the FP8 config.*backend="auto"'):
        convert(device="cpu", backend="primus_turbo")


def test_bad_converter_config_fails_at_build():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp8'"):
        Float8Converter.Config(recipe="fp8").build()
    with pytest.raises(ValueError, match="unknown FP8 backend 'turbo'"):
        Float8Converter.Config(backend="turbo").build()
    with pytest.raises(ValueError, match="unknown device profile"):
        Float8Converter.Config(device="mi300x").build()


def test_config_is_a_torchtitan_config():
    """A keyword-only dataclass (TorchTitan rejects anything else) of a QuantizationConverter."""
    from torchtitan.components.quantization import QuantizationConverter

    assert issubclass(Float8Converter, QuantizationConverter)
    names = {f.name for f in fields(Float8Converter.Config)}
    assert {
        "backend",
        "recipe",
        "linears",
        "grouped_experts",
        "filter_fqns",
        "auto_filter_small_kn",
        "strict",
        "model_compile_enabled",
    } <= names
    assert all(f.kw_only for f in fields(Float8Converter.Config))


@pytest.mark.parametrize("model", MODELS)
def test_converted_model_builds_runs_and_trains(model):
    config, _ = convert(model, device="cpu")
    fp8 = build(config)
    ref = build(model_config(model))
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    tokens = token_ids(2, 32)
    out = fp8(tokens)
    assert torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    grads = [p.grad for p in fp8.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    # Same init, same input: each FP8 rowwise GEMM is ~28 dB from exact, and the error adds up
    # over the 6-8 layers of a debug model; measured 19.3 dB (qwen3) to 2x dB on the logits.
    assert tp.sqnr(ref(tokens), fp8(tokens)) >= 15


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_state_dict_identical_for_every_backend(model):
    """Same keys, shapes and dtypes as the unconverted model, whichever backend a profile picks
    (Primus-Turbo's: tests/real_turbo/test_routing.py)."""

    def signature(config):
        with torch.device("meta"):
            module = config.build()
        return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}

    stock = signature(model_config(model))
    for device, backend in (("cpu", "emulated"), ("sm90", "torchao")):
        config, report = convert(model, device=device)
        assert routes(report)["linear"] == backend
        assert signature(config) == stock, device


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_dcp_checkpoint_round_trips_between_bf16_and_fp8(model, tmp_path):
    import torch.distributed.checkpoint as dcp

    plain = build(model_config(model), seed=1)
    fp8 = build(convert(model, device="cpu")[0], seed=2)
    dcp.save(plain.state_dict(), checkpoint_id=str(tmp_path / "plain"))
    state = fp8.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "plain"))
    fp8.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fp8.state_dict().values()))
    dcp.save(fp8.state_dict(), checkpoint_id=str(tmp_path / "fp8"))
    fresh = build(model_config(model), seed=3)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "fp8"))
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.parametrize(
    "model, options", [("llama3", {}), ("deepseek_v3", {"linears": False}), ("deepseek_v3", {"recipe": "tensorwise"})]
)
def test_torchtitan_has_quantization_recognises_converted_configs(model, options):
    """The trainer asks TorchTitan's has_quantization (and then logs no bf16-peak MFU); it must
    say True for a converted model, as for TorchTitan's own float8 converters, also through the
    name torchtitan.trainer imported before any converter existed."""
    import torchtitan.trainer
    from torchtitan.components.quantization import utils

    stock = model_config(model)
    assert not utils.has_quantization(stock)
    converted, report = convert(config=model_config(model), device="cpu", **options)
    assert report.converted()
    for has_quantization in (utils.has_quantization, torchtitan.trainer.has_quantization):
        assert has_quantization(converted)
        assert not has_quantization(stock)


def test_a_torchtitan_without_has_quantization_warns_and_converts(monkeypatch, caplog):
    """Issue 42: a renamed has_quantization was a bare AttributeError at the converter's build. Only
    the MFU line depends on it, so conversion goes on, saying what moved and what it costs."""
    from torchtitan.components.quantization import utils

    from titan_primus.integrations.torchtitan.v0_3 import seams

    monkeypatch.delattr(utils, "has_quantization")
    seams._warn_has_quantization_moved.cache_clear()
    with caplog.at_level(logging.WARNING, logger="titan_primus"):
        _, report = convert(device="cpu")
    assert report.converted()
    assert "has no torchtitan.components.quantization.utils.has_quantization" in caplog.text
    assert "logs MFU against the bf16 peak. Training is unaffected" in caplog.text


def test_torchtitan_orders_the_converter_as_a_quantization_converter():
    """TorchTitan's other question about converters: quantization ones must precede LoRA."""
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.utils import validate_converter_order

    validate_converter_order([Float8Converter.Config(), LoRAConverter.Config()])
    with pytest.raises(ValueError, match="must be applied before LoRAConverter"):
        validate_converter_order([LoRAConverter.Config(), Float8Converter.Config()])


@pytest.mark.parametrize("model", MODELS)
def test_the_cpu_attention_swap_attends_causally_over_the_sequence(model):
    """The CPU launcher's causal SDPA (FlexAttention has no CPU backward) on either token layout:
    changing the first token changes the last position's logits (it is attended), changing the
    last one leaves every earlier position's (it is not). Given TorchTitan main's [T, N, H] as
    (B, L, N, H), SDPA would attend each token to itself only (llama3) or crash."""
    net = build(model_config(model))
    tokens = token_ids(1, 16, torch.Generator().manual_seed(5))

    def logits(ids):
        with torch.no_grad():
            out = net(ids)
        return out.reshape(-1, out.shape[-1])  # one row per token, in order, on either layout

    base = logits(tokens)
    first, last = tokens.clone(), tokens.clone()
    first.view(-1)[0] = (first.view(-1)[0] + 1) % 2048
    last.view(-1)[-1] = (last.view(-1)[-1] + 1) % 2048
    assert tp.sqnr(base[-1], logits(first)[-1]) < 80
    assert_sqnr_at_least(base[:-1], logits(last)[:-1], 80, "positions before the changed token")


@pytest.mark.parametrize(
    "recipe, device, fsdp, kept_in_bf16",
    [
        # wkv_a [576, 256]: 288 rows per rank, not whole 128-row blocks; the rest is
        ("blockwise", "cpu", 2, {f"layers.{i}.attention.wkv_a" for i in range(6)}),
        # 16 ranks for 8 experts: TorchTitan shards expert weights on dim 1 (N), each rank's
        # N whole rows; every linear's rows split whole too
        ("rowwise", "gfx942", 16, set()),
    ],
)
def test_parallelize_keeps_in_bf16_and_names_each_weight_whose_shards_cannot_carry_fp8_scales(
    recipe, device, fsdp, kept_in_bf16, caplog
):
    """TorchTitan 0.3 builds the model before it knows the FSDP degree: each FP8 layer decides in
    ``parallelize``, where it knows its shapes and the degree, and names itself and why."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    config, _ = convert(
        config=model_config("deepseek_v3"),
        device=device,
        recipe=recipe,
        backend="emulated",
        enable_fsdp_float8_all_gather=True,
    )
    model = build(config, seed=0)
    dims = ParallelDims(dp_replicate=1, dp_shard=fsdp, cp=1, tp=1, pp=1, ep=1, world_size=fsdp)
    fp8 = {fqn: m for fqn, m in model.named_modules() if hasattr(m, "use_fp8_all_gather")}
    assert all(m.fp8_all_gather for m in fp8.values())
    with caplog.at_level(logging.WARNING, logger="titan_primus"):
        for module in fp8.values():
            module.parallelize(dims)
    assert {fqn for fqn, m in fp8.items() if not m.fp8_all_gather} == kept_in_bf16
    for fqn in kept_in_bf16:
        assert (
            f"FSDP2 gathers the weights of {fqn} in bf16: weight [576, 256]: its 128x128 block scales need shards "
            f"of whole 128-row blocks, and FSDP2 shards its 576 rows (dim 0) in 288 per rank (FSDP degree 2)"
        ) in caplog.text
    assert caplog.text.count("FSDP2 gathers the weights of") == len(kept_in_bf16)


def test_parallelize_names_layers_whose_weights_lost_the_fp8_all_gather_wrapper(caplog, monkeypatch):
    """Should TorchTitan's parallelize hand the weights back without the FP8 all-gather weight
    inside (expert parallelism distributes expert weights; a torch whose distribute_tensor kept
    no tensor subclass would drop it), the layer says it gathers in bf16, and why."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.protocols.module import Module

    config, _ = convert(
        config=model_config("deepseek_v3"), recipe="tensorwise", backend="emulated", enable_fsdp_float8_all_gather=True
    )
    model = build(config, seed=0)
    fqn, experts = next((fqn, m) for fqn, m in model.named_modules() if getattr(m, "covers_experts", False))
    assert experts.fp8_all_gather

    def dropping_the_wrapper(self, parallel_dims):
        for name in self.fp8_weight_names:
            setattr(self, name, torch.nn.Parameter(getattr(self, name)._tensor))

    monkeypatch.setattr(Module, "parallelize", dropping_the_wrapper)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    with caplog.at_level(logging.WARNING, logger="titan_primus"):
        experts.parallelize(dims)
    assert not experts.fp8_all_gather
    assert (
        f"FSDP2 gathers the weights of {fqn} in bf16: TorchTitan's parallelize made them DTensors without the FP8 "
        f"all-gather weight inside"
    ) in caplog.text
