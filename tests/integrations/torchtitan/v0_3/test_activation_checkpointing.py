"""Selective activation checkpointing with the FP8 GEMMs in its policy (TorchTitan 0.3): with
``Fp8SelectiveAC`` (TorchTitan's ``SelectiveAC`` whose ``get_save_ops`` adds every backend's
``fp8_gemm_ops``), a training step of a converted debug model runs every second FP8 GEMM of a
block again in backward (``fp8_gemms="alternate"``, the default, TorchTitan's rule for
``aten.mm``), or none (``"save"``: three FP8 GEMMs per op, as without activation checkpointing);
TorchTitan's stock policy runs all of the emulated backend's again in backward. Counted per executed kernel (tests/support/gemm_count.py), eager and under TorchTitan's
per-block torch.compile. The 0.2.x save list: tests/integrations/torchtitan/v0_2/test_activation_checkpointing.py."""

import pytest
import torch
from support.titan_helpers import gemms_per_step, model_config

import titan_primus as tp
from titan_primus.checkpointing import attention_save_ops, fp8_gemm_save_ops
from titan_primus.torchtitan import Float8Converter, Fp8SelectiveAC


CASES = [
    pytest.param("emulated", "cpu", "llama3", "rowwise", False, id="emulated-llama3-eager"),
    pytest.param("emulated", "cpu", "deepseek_v3", "rowwise", False, id="emulated-deepseek_v3-eager"),
    pytest.param("emulated", "cpu", "llama3", "rowwise", True, id="emulated-llama3-compiled"),
    pytest.param("torchao", "cpu", "llama3", "tensorwise", False, id="torchao-llama3-eager"),
    pytest.param("torchao", "cpu", "llama3", "tensorwise", True, id="torchao-llama3-compiled"),
]


@pytest.mark.parametrize("backend, device, model, recipe, compiled", CASES)
def test_selective_ac_runs_three_fp8_gemms_per_op_when_it_saves_them(backend, device, model, recipe, compiled):
    """Debug models (llama3: 31 FP8 linears, 30 of them in checkpointed blocks; deepseek_v3: 58
    FP8 linears and grouped GEMMs) converted to one backend: FP8 GEMMs per step without activation
    checkpointing, with TorchTitan's SelectiveAC and with Fp8SelectiveAC saving every FP8 GEMM.
    Measured (2026-12-01): emulated llama3 93 / 123 / 93 eager, 93 / 117 / 93 compiled;
    deepseek_v3 174 / 231 / 174; TorchAO 93 / 93 / 93 (its FP8 GEMMs reach the policy as
    aten._scaled_mm, in TorchTitan's default save set). Primus-Turbo's own code:
    tests/real_turbo/test_checkpointing_and_memory_audit.py."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    ops = tp.registry.get_backend(backend).fp8_gemm_ops()
    config = Float8Converter.Config(device=device, backend=backend, recipe=recipe).build().convert(model_config(model))
    forward, plain = gemms_per_step(config, None, compiled, ops)
    _, stock = gemms_per_step(config, SelectiveAC.Config(), compiled, ops)
    _, fp8 = gemms_per_step(config, Fp8SelectiveAC.Config(fp8_gemms="save"), compiled, ops)
    assert forward > 0 and plain == 3 * forward, (forward, plain)
    assert fp8 == plain, (plain, stock, fp8)
    if backend == "emulated":  # the emulated GEMM ops are in no stock save set: recomputed
        assert stock > plain, (plain, stock, fp8)


@pytest.mark.parametrize(
    "backend, recipe, model, blocks, per_block",
    [("emulated", "rowwise", "llama3", 6, 5), ("emulated", "rowwise", "deepseek_v3", None, None)]
    + [("torchao", "tensorwise", "llama3", 6, 5)],
    ids=["emulated-llama3", "emulated-deepseek_v3", "torchao-llama3"],
)
def test_alternation_recomputes_every_second_fp8_gemm_of_each_block(backend, recipe, model, blocks, per_block):
    """``fp8_gemms="alternate"`` (the default): llama3's blocks each run 5 FP8 GEMMs in forward
    (wqkv, wo, w1, w3, w2), of which the 2nd and 4th run again in backward: 93 + 6 x 2 = 105 per
    step, TorchAO's included (its aten._scaled_mm, which the stock policy saves, alternates too).
    Measured (2026-12-01): emulated llama3 105, deepseek_v3 202 (174 without AC, 231 stock)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    ops = tp.registry.get_backend(backend).fp8_gemm_ops()
    config = Float8Converter.Config(device="cpu", backend=backend, recipe=recipe).build().convert(model_config(model))
    forward, plain = gemms_per_step(config, None, False, ops)
    _, alternate = gemms_per_step(config, Fp8SelectiveAC.Config(), False, ops)
    if blocks is not None:
        assert forward == blocks * per_block + 1 and alternate == plain + blocks * (per_block // 2), (plain, alternate)
    else:
        _, stock = gemms_per_step(config, SelectiveAC.Config(), False, ops)
        assert plain < alternate < stock and alternate - plain < (stock - plain) * 0.6, (plain, alternate, stock)


def test_save_set_is_torchtitans_plus_the_backends_gemm_ops_and_the_attention_ops():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    stock = SelectiveAC.Config().build().get_save_ops()
    ours = Fp8SelectiveAC.Config().build().get_save_ops()
    assert ours == set(stock) | fp8_gemm_save_ops() | attention_save_ops()
    assert torch.ops.titan_primus.emulated_fp8_mm.default in ours
    assert torch.ops.titan_primus.emulated_fp8_grouped_mm.default in ours
    assert torch.ops.aten._scaled_mm.default in ours


def test_config_registry_and_override_select_it():
    """``--module titan_primus --config <stock>_fp8`` turns a stock SelectiveAC.Config into
    Fp8SelectiveAC.Config (same fields); other activation checkpointing is left alone. The
    ``fp8_selective_ac`` override does the same on a stock config."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from titan_primus import config_registry
    from titan_primus.integrations.torchtitan.v0_3.activation_checkpoint import with_fp8_gemms_saved
    from titan_primus.torchtitan.overrides import fp8_selective_ac

    config = config_registry.llama3_debugmodel_fp8()
    assert type(config.activation_checkpoint) is Fp8SelectiveAC.Config
    stock = SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["x.y"], preserve_rng_state=False)
    ours = with_fp8_gemms_saved(stock)
    assert type(ours) is Fp8SelectiveAC.Config
    assert (ours.force_recompute_mm_shapes_by_fqns, ours.preserve_rng_state) == (["x.y"], False)
    full = FullAC.Config()
    assert with_fp8_gemms_saved(full) is full and with_fp8_gemms_saved(None) is None
    assert type(fp8_selective_ac(SelectiveAC.Config())) is Fp8SelectiveAC.Config


# One test per way of enabling the converter on TorchTitan 0.3: a step of the stock llama3 debug
# config (TorchTitan's SelectiveAC) runs every FP8 GEMM three times, and the 2nd and 4th of each
# block's five once more (Fp8SelectiveAC's default alternation).


def assert_fp8_gemms_alternate(model_spec_model, ac_config) -> None:
    from titan_primus.integrations.torchtitan.v0_3.launch import use_causal_sdpa
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    assert isinstance(ac_config, SelectiveAC.Config)  # per-op selective, whichever class
    use_causal_sdpa(model_spec_model)
    ops = tp.registry.get_backend("emulated").fp8_gemm_ops()
    forward, step = gemms_per_step(model_spec_model, ac_config, False, ops)
    assert forward == 31 and step == 3 * forward + 6 * 2, (forward, step)  # stock SelectiveAC: 31 / 123


def stock_llama3_debug_config():
    from titan_primus.config_registry import stock_config

    return stock_config("llama3_debugmodel")()


def test_python_config_warns_once_and_its_one_line_fix_keeps_the_gemms(caplog, monkeypatch):
    """README's way ("Enable it"): ``model_registry(..., converters=[Float8Converter.Config()])`` in a config
    function. TorchTitan gives the converter no access to the trainer's activation checkpointing,
    so the converter names the one-line fix, in one line, the first time it converts in a process;
    with that line, the FP8 GEMMs are in the policy."""
    from torchtitan.models.llama3 import model_registry

    from titan_primus.integrations.torchtitan.v0_3 import converter
    from titan_primus.integrations.torchtitan.v0_3.converter import SELECTIVE_AC_FIX
    from titan_primus.torchtitan import with_fp8_gemms_saved

    monkeypatch.setattr(converter, "_selective_ac_fix_logged", False)  # as in a fresh process
    config = stock_llama3_debug_config()
    with caplog.at_level("WARNING", logger="titan_primus"):
        config.model_spec = model_registry("debugmodel", converters=[Float8Converter.Config(backend="emulated")])
        model_registry("debugmodel", converters=[Float8Converter.Config(backend="emulated")])
    assert caplog.messages.count(SELECTIVE_AC_FIX) == 1
    assert "\n" not in SELECTIVE_AC_FIX and SELECTIVE_AC_FIX.endswith("docs/memory.md")
    assert "config.activation_checkpoint = with_fp8_gemms_saved(config.activation_checkpoint)" in SELECTIVE_AC_FIX
    config.activation_checkpoint = with_fp8_gemms_saved(config.activation_checkpoint)  # the line it names
    assert_fp8_gemms_alternate(config.model_spec.model, config.activation_checkpoint)


def test_ready_config_keeps_the_gemms(caplog, monkeypatch):
    """``--module titan_primus --config llama3_debugmodel_fp8``: nothing to add, nothing warned."""
    from titan_primus import config_registry
    from titan_primus.integrations.torchtitan.v0_3.converter import SELECTIVE_AC_FIX

    monkeypatch.setenv("TITAN_PRIMUS_BACKEND", "emulated")
    with caplog.at_level("WARNING", logger="titan_primus"):
        config = config_registry.llama3_debugmodel_fp8()
    assert SELECTIVE_AC_FIX not in caplog.messages
    assert_fp8_gemms_alternate(config.model_spec.model, config.activation_checkpoint)


def test_override_imports_keep_the_gemms():
    """``--override.imports`` on a stock config, applied as TorchTitan's trainer applies them:
    the ``fp8`` override and ``fp8_selective_ac`` (named by the converter's warning)."""
    from torchtitan.config.override import apply_overrides

    config = stock_llama3_debug_config()
    config.override.imports = [
        ("titan_primus.torchtitan.overrides.fp8", {"backend": "emulated"}),
        "titan_primus.torchtitan.overrides.fp8_selective_ac",
    ]
    apply_overrides(config.override, config)
    assert_fp8_gemms_alternate(config.model_spec.model, config.activation_checkpoint)
