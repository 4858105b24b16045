"""Routing on named profiles, the environment override, explicit requests, third-party plugins."""

import importlib.abc
import sys

import pytest
import torch

import titan_primus as tp
from titan_primus.backends import EmulatedBackend
from titan_primus.checkpointing import fp8_gemm_save_ops
from titan_primus.diagnostics.environment import diagnose
from titan_primus.hookspec import hookimpl


@pytest.mark.parametrize(
    "device, op, recipe, expected",
    [
        ("cpu", "linear", "rowwise", "emulated"),
        ("cpu", "grouped_mm", "rowwise", "emulated"),
        ("sm90", "linear", "tensorwise", "torchao"),
        ("sm90", "grouped_mm", "rowwise", "torchao"),
        ("gfx942", "linear", "rowwise", "torchao"),  # no Primus-Turbo here
        ("gfx950", "grouped_mm", "rowwise", "torchao"),
        ("sm100", "linear", "mxfp8", "torchao"),
        ("sm100", "grouped_mm", "mxfp8", "torchao"),
        ("sm90", "linear", "blockwise", "torchao"),
    ],
)
def test_auto_routing_without_primus_turbo(device, op, recipe, expected):
    decision = tp.select_backend(op, recipe, device)
    assert decision.backend_name == expected, decision.explain()
    passed = dict(decision.passed_over)
    assert "primus_turbo" in passed and passed["primus_turbo"]  # every better backend says why not
    if expected == "emulated":
        assert "torchao" in passed


class _ImportsSeen(importlib.abc.MetaPathFinder):
    """Every import of a ``primus_turbo`` module asked of the import system (found or not)."""

    def __init__(self):
        self.names = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "primus_turbo":
            self.names.append(name)
        return None


def test_building_the_registry_on_a_cpu_does_not_import_primus_turbo(monkeypatch):
    """Its import needs a ROCm GPU and its compiled extension: it happens past the hardware check
    only (backends/primus_turbo/release.py), not when the registry is built, routing asks about
    another device, doctor runs here, or selective AC lists the GEMM ops to save."""
    assert not tp.detect_device().mi300_class and "primus_turbo" not in sys.modules
    seen = _ImportsSeen()
    monkeypatch.setattr(sys, "meta_path", [seen, *sys.meta_path])
    tp.registry.refresh()
    turbo = tp.registry.get_backend("primus_turbo")
    for op in ("linear", "grouped_mm"):
        assert tp.select_backend(op, "rowwise").backend_name == "emulated"
        assert tp.select_backend(op, "rowwise", "sm90").backend_name == "torchao"
        assert not turbo.takes_gathered_fp8_weight(
            tp.make_recipe("rowwise", "primus_turbo", tp.device_profile("gfx942")), op
        )
    assert fp8_gemm_save_ops() and turbo.fp8_gemm_ops() == frozenset() and turbo.execution_paths() is None
    assert "MI300-class" in diagnose()["primus_turbo"]
    assert seen.names == []
    decision = tp.select_backend("linear", "rowwise", "gfx942")  # the hardware check passes: it is looked for
    assert seen.names and "Primus-Turbo is not importable" in dict(decision.passed_over)["primus_turbo"]


def test_emulation_reproduces_the_devices_preferred_definition():
    assert tp.select_backend("linear", "rowwise", "gfx942", "emulated").recipe.definition == "primus_turbo"
    assert tp.select_backend("linear", "rowwise", "sm90", "emulated").recipe.definition == "torchao"
    assert tp.select_backend("linear", "rowwise_with_gw_hp", "gfx942", "emulated").recipe.definition == "torchao"


def test_environment_overrides_auto(monkeypatch):
    monkeypatch.setenv("TITAN_PRIMUS_BACKEND", "emulated")
    assert tp.select_backend("linear", "rowwise", "sm90").backend_name == "emulated"
    # An explicit request still wins over the environment.
    assert tp.select_backend("linear", "rowwise", "sm90", requested="torchao").backend_name == "torchao"
    monkeypatch.setenv("TITAN_PRIMUS_BACKEND", "primus_turbo")
    with pytest.raises(tp.BackendUnavailableError, match="TITAN_PRIMUS_BACKEND"):
        tp.select_backend("linear", "rowwise", "gfx942")


def test_explicit_unavailable_backend_is_a_clear_error():
    with pytest.raises(tp.BackendUnavailableError, match="MI300-class") as info:
        tp.select_backend("linear", "rowwise", "cpu", requested="primus_turbo")
    assert "'primus_turbo'" in str(info.value) and "cpu" in str(info.value)
    with pytest.raises(tp.BackendUnavailableError, match="Triton kernels"):
        tp.select_backend("grouped_mm", "rowwise", "cpu", requested="torchao")
    with pytest.raises(ValueError, match="registered backends: primus_turbo, torchao, emulated"):
        tp.select_backend("linear", "rowwise", "cpu", requested="cutlass")


@pytest.mark.parametrize(
    "device, op, recipe, why",
    [
        ("sm90", "grouped_mm", "tensorwise", "only the rowwise recipe"),  # TorchAO: rowwise grouped only
        ("gfx90a", "linear", "rowwise", "no FP8 units"),  # MI250
        ("sm80", "linear", "tensorwise", "no FP8 units"),  # A100
        ("gfx942", "linear", "mxfp8", "SM100"),  # no MX hardware (Primus-Turbo runs MX on gfx950 only)
        ("sm90", "linear", "mxfp8", "SM100"),
        ("sm90", "grouped_mm", "blockwise", "DeepGEMM"),
        ("sm100", "linear", "blockwise", "SM90 only"),
    ],
)
def test_gpus_never_fall_back_to_emulation_automatically(device, op, recipe, why):
    """On a GPU, what its FP8 kernels cannot run is refused with the reasons (the converter then
    keeps those layers in high precision); the emulation runs there only when named."""
    with pytest.raises(tp.BackendUnavailableError, match=why) as info:
        tp.select_backend(op, recipe, device)
    assert "only when requested by name" in str(info.value)
    assert tp.select_backend(op, recipe, device, "emulated").backend_name == "emulated"


def test_shapes_the_kernels_cannot_take_are_refused_with_reason():
    with pytest.raises(tp.BackendUnavailableError, match="K=100"):
        tp.select_backend("linear", "rowwise", "sm90", k=100, n=64)
    with pytest.raises(tp.BackendUnavailableError, match=r"divisible by 32 \(K=48\)"):
        tp.select_backend("linear", "mxfp8", "sm100", k=48, n=64)
    assert tp.select_backend("linear", "mxfp8", "cpu", k=48, n=64).backend_name == "emulated"


class _BetterBackend(EmulatedBackend):
    """A third-party backend that says it is the best choice on H100s."""

    name = "vendor_fp8"

    def rank(self, device):
        return 1000 if device.arch == "sm90" else 0

    def availability(self, device):
        return tp.Verdict.yes() if device.arch == "sm90" else tp.Verdict.no("vendor kernels exist only for sm90")


class _Plugin:
    @hookimpl
    def titan_primus_register_backends(self):
        return [_BetterBackend()]


def test_third_party_backend_wins_when_it_ranks_higher():
    plugin = _Plugin()
    tp.registry.register(plugin, name="vendor")
    try:
        assert tp.select_backend("linear", "rowwise", "sm90").backend_name == "vendor_fp8"
        cpu = tp.select_backend("linear", "rowwise", "cpu")
        assert cpu.backend_name == "emulated"
        assert dict(cpu.passed_over)["vendor_fp8"].endswith("vendor kernels exist only for sm90")
        x, w = torch.randn(8, 32), torch.randn(16, 32)
        assert tp.fp8_linear(x, w, device="sm90").shape == (8, 16)
    finally:
        tp.registry.unregister(plugin)
    assert tp.select_backend("linear", "rowwise", "sm90").backend_name == "torchao"


class _TiedBackend(EmulatedBackend):
    """A plugin built on the emulation: it ranks as the emulation does, everywhere."""

    name = "vendor_tied"


def test_a_plugin_that_ties_a_built_in_does_not_win():
    """docs/plugins.md: a plugin is chosen where its rank beats the built-ins'. On a tie the built-in
    keeps the op, in routing and as the preferred backend; the registry lists built-ins first."""

    class Plugin:
        @hookimpl
        def titan_primus_register_backends(self):
            return [_TiedBackend()]

    plugin = Plugin()
    tp.registry.register(plugin, name="tied")
    try:
        assert list(tp.registry.backends())[-1] == "vendor_tied"
        assert tp.select_backend("linear", "rowwise", "cpu").backend_name == "emulated"
        assert tp.select_backend("linear", "rowwise", "cpu", "vendor_tied").backend_name == "vendor_tied"
        assert tp.routing.preferred_backend(tp.device_profile("cpu")).name == "emulated"
    finally:
        tp.registry.unregister(plugin)


class _OnRequestBackend(_BetterBackend):
    """Ranks first on sm90 but, for tensorwise, runs only when requested by name."""

    name = "vendor_on_request"

    def chosen_automatically(self, op, recipe, device):
        return tp.Verdict.no("not yet run on hardware") if recipe == "tensorwise" else tp.Verdict.yes()


def test_a_backend_can_run_a_recipe_only_when_requested_by_name():
    class Plugin:
        @hookimpl
        def titan_primus_register_backends(self):
            return [_OnRequestBackend()]

    plugin = Plugin()
    tp.registry.register(plugin, name="on_request")
    try:
        auto = tp.select_backend("linear", "tensorwise", "sm90")
        assert auto.backend_name == "torchao"
        assert dict(auto.passed_over)["vendor_on_request"] == "not yet run on hardware"
        assert (
            tp.select_backend("linear", "tensorwise", "sm90", "vendor_on_request").backend_name == "vendor_on_request"
        )
        assert tp.select_backend("linear", "rowwise", "sm90").backend_name == "vendor_on_request"
    finally:
        tp.registry.unregister(plugin)


def test_primus_turbos_mxfp8_is_chosen_only_by_name():
    """Its MX quantizers and GEMMs (FlyDSL, HIP) run under no test here and have not run on an
    MI355X: ``auto`` passes over them, with the reason (the real-code tier routes on gfx950:
    tests/real_turbo/test_routing.py); its other recipes are chosen automatically."""
    from titan_primus.backends.primus_turbo import MX_ON_REQUEST

    turbo, gfx950 = tp.registry.get_backend("primus_turbo"), tp.device_profile("gfx950")
    for op in ("linear", "grouped_mm"):
        assert turbo.chosen_automatically(op, "mxfp8", gfx950).reason == MX_ON_REQUEST
        assert all(turbo.chosen_automatically(op, r, gfx950) for r in ("tensorwise", "rowwise", "blockwise"))
    assert "backend='primus_turbo'" in MX_ON_REQUEST and "MI355X" in MX_ON_REQUEST


def test_backend_name_clash_is_an_error():
    class Clash:
        @hookimpl
        def titan_primus_register_backends(self):
            return [EmulatedBackend()]

    plugin = Clash()
    with pytest.raises(ValueError, match="registered by both"):
        tp.registry.register(plugin, name="clash")
    assert tp.registry.plugin_manager().get_plugin("clash") is None
    assert tp.select_backend("linear", "rowwise", "cpu").backend_name == "emulated"


def test_a_second_reference_backend_is_an_error_and_the_oracle_is_read_from_the_capability():
    """Parity judges every backend against the one registered reference (``Fp8Backend.reference``,
    the emulation), found by capability, not by name; two references would make that ambiguous."""
    from titan_primus.diagnostics.parity import oracle

    assert tp.registry.reference_backend() is tp.registry.get_backend("emulated") and oracle() == "emulated"

    class BuiltOnTheEmulation(EmulatedBackend):
        name = "built_on_it"

    assert not BuiltOnTheEmulation.reference  # never inherited: a subclass computes what it likes

    class SecondReference(EmulatedBackend):
        name = "emulated_again"
        reference = True

    class Plugin:
        @hookimpl
        def titan_primus_register_backends(self):
            return [SecondReference()]

    with pytest.raises(ValueError, match="'emulated.*', 'emulated.*' .* all declare reference = True"):
        tp.registry.register(Plugin(), name="second_reference")
    assert tp.registry.plugin_manager().get_plugin("second_reference") is None
    assert oracle() == "emulated"


def test_entry_point_autoload_can_be_disabled(monkeypatch):
    """TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD=1 (set for this suite) skips entry points, as pytest does."""
    calls = []
    monkeypatch.setattr(
        "pluggy.PluginManager.load_setuptools_entrypoints", lambda self, group, name=None: calls.append(group)
    )
    tp.registry.plugin_manager.cache_clear()
    try:
        tp.registry.plugin_manager()
        assert calls == []
        monkeypatch.delenv("TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD")
        tp.registry.plugin_manager.cache_clear()
        tp.registry.plugin_manager()
        assert calls == ["titan_primus"]
    finally:
        tp.registry.plugin_manager.cache_clear()


@pytest.mark.parametrize("gpu, slower", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False)])
def test_the_report_says_where_fp8_experts_measured_no_faster_than_bf16(gpu, slower, monkeypatch):
    """On an H200 TorchAO's rowwise grouped GEMM measured 1.00x bf16 compiled (0.83x-0.90x eager):
    the routing report says so there, with how to keep experts in bf16; nothing was measured on
    an H100, so nothing is said."""
    import dataclasses

    from titan_primus import conversion

    profile = dataclasses.replace(tp.device_profile("sm90"), name=gpu)
    monkeypatch.setattr(conversion, "resolve_device", lambda device: profile)
    router = conversion.LayerRouter(conversion.ConversionOptions(recipe="rowwise"))
    router.linear("layers.0.wq", 256, 256)
    router.experts("layers.1.moe.experts", 256, 512)
    summary = router.report.summary()
    assert ("grouped experts: 1 -> torchao" in summary) and ("linears: 1 -> torchao" in summary), summary
    line = "not faster than bf16 here: TorchAO's rowwise FP8 grouped GEMM measured 1.00x bf16 compiled"
    assert (line in summary) == slower, summary
    assert ("grouped_experts=False keeps them in bf16" in summary) == slower
    assert "linears=False" not in summary
