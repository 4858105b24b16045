"""The Primus-Turbo adapter, exercised against a TEST DOUBLE of Primus-Turbo (tests/doubles/).

Nothing here is evidence about real Primus-Turbo kernels: those run only in the `mi300`-marked
tests, on MI300-class hardware. What this does prove: the adapter calls the API the way every
recorded release defines it (tests/data/primus_turbo_api.json, read from the upstream tags), maps
offsets and recipes correctly, never lets an unwritten (NaN) row escape, and agrees with the
emulated backend reproducing the same Primus-Turbo recipe definition.
"""

import inspect
import json
from pathlib import Path

import pytest
import torch
from doubles import primus_turbo_double
from helpers import make_offsets, run_grouped, run_linear, sqnrs

import titan_primus as tp
from titan_primus.backends.primus_turbo import BACKEND_ENUM_MODULE, CONFIG_MODULES, LOW_LEVEL_OPS, OPS_MODULE

API_RECORD = json.loads((Path(__file__).parent / "data" / "primus_turbo_api.json").read_text())
VERSIONS = list(API_RECORD["versions"])


@pytest.fixture
def turbo(request, monkeypatch):
    """Install the double (params: (version, arch)) and rebuild the registry around it."""
    version, arch = getattr(request, "param", ("v0.4.0", "gfx942"))
    api = primus_turbo_double.install(monkeypatch, version=version, arch=arch)
    tp.registry.refresh()
    return api, version, tp.device_profile(arch)


def test_record_covers_the_releases_the_adapter_claims():
    assert VERSIONS == ["v0.2.0", "v0.3.0", "v0.3.1", "v0.4.0"]
    for entry in API_RECORD["versions"].values():
        assert len(entry["commit"]) == 40


@pytest.mark.parametrize("version", VERSIONS)
def test_double_matches_the_recorded_api(version, monkeypatch):
    """The double's surface is what upstream had at that tag: same functions, parameters in the
    same order with the same defaults, same enum members, config at the same module path."""
    record = API_RECORD["versions"][version]
    primus_turbo_double.install(monkeypatch, version=version)
    import importlib

    for path, spec in record["functions"].items():
        module, name = path.rsplit(".", 1)
        fn = getattr(importlib.import_module(module), name)
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params] == [p["name"] for p in spec["params"]], path
        for got, want in zip(params, spec["params"]):
            default = None if got.default is inspect.Parameter.empty else repr(got.default).replace("torch.", "")
            assert default == want["default"], (path, got.name)
            assert got.kind.name == want["kind"], (path, got.name)
    config = importlib.import_module(record["config_module"])
    for enum_name, members in record["enums"].items():
        assert [m.name for m in getattr(config, enum_name)] == members, enum_name
    fields = list(inspect.signature(config.Float8QuantConfig).parameters)
    assert fields == [p["name"] for p in record["Float8QuantConfig"]["params"]]
    backend_enum = record["backend_enum"]
    if backend_enum is None:
        with pytest.raises(ImportError):
            importlib.import_module(BACKEND_ENUM_MODULE)
    else:
        assert [m.name for m in importlib.import_module(backend_enum["module"]).BackendType] == backend_enum["BackendType"]


@pytest.mark.parametrize("version", VERSIONS)
def test_double_has_the_recorded_low_level_ops(version, monkeypatch):
    """The low-level custom ops the compiled path is built on: present exactly at the tags that
    have them, with the recorded parameters and a fake implementation."""
    primus_turbo_double.install(monkeypatch, version=version)
    import importlib

    record = API_RECORD["versions"][version]["low_level_ops"]
    for qualname, spec in record.items():
        namespace, name = qualname.split("::")
        if namespace == "primus_turbo_cpp_extension":
            if spec is None:  # the double registers it process-wide; a call at this tag fails
                continue
            schema = str(getattr(torch.ops.primus_turbo_cpp_extension, name).default._schema)
            assert schema == f"{namespace}::{spec['schema']}", qualname
            continue
        module = importlib.import_module(LOW_LEVEL_OPS[name]) if spec else None
        if spec is None:
            with pytest.raises(ImportError):
                importlib.import_module(LOW_LEVEL_OPS[name])
            continue
        op = getattr(module, name)
        arguments = op._opoverload._schema.arguments
        assert [a.name for a in arguments] == [p["name"] for p in spec["params"]], qualname
        assert [repr(a.default_value) if a.has_default_value() else None for a in arguments] == [
            p["default"] for p in spec["params"]
        ], qualname
        assert spec["fake_impl"] and op._abstract_fn is not None


def test_adapter_imports_only_recorded_paths():
    recorded_config_modules = {v["config_module"] for v in API_RECORD["versions"].values()}
    assert CONFIG_MODULES[0] in recorded_config_modules
    for path in {p for v in API_RECORD["versions"].values() for p in v["functions"]}:
        assert path.startswith(OPS_MODULE + ".ops.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("version, arch, recipe, min_db", [
    ("v0.2.0", "gfx942", "rowwise", 80),
    ("v0.3.1", "gfx942", "tensorwise", 80),
    ("v0.4.0", "gfx942", "rowwise", 80),
    ("v0.4.0", "gfx942", "blockwise", float("inf")),
    ("v0.4.0", "gfx950", "mxfp8", float("inf")),
])
def test_emulation_rounds_like_the_16_bit_kernels(version, arch, recipe, min_db, dtype, monkeypatch):
    """Primus-Turbo's GEMMs write bf16/fp16 only: a float32 linear gets a bf16 result, and its
    backward quantizes that result's gradient, rounded to bf16. The emulation of its definition
    rounds the same way, so in every dtype it is as close to the adapter as in bf16 (float32
    gradients were 33-38 dB apart without it); block recipes bit-identical. Bias in all dtypes."""
    primus_turbo_double.install(monkeypatch, version=version, arch=arch)
    tp.registry.refresh()
    decision = tp.select_backend("linear", recipe, arch)
    assert decision.backend_name == "primus_turbo" and decision.recipe.sixteen_bit_gemms
    torch.manual_seed(0)
    x = torch.randn(2, 128, 256, dtype=dtype)
    w = (torch.randn(128, 256) * 0.05).to(dtype)
    b = torch.randn(128, dtype=dtype)
    g = torch.randn(2, 128, 128, dtype=dtype)
    got = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b, recipe=recipe, device=arch), x, w, b, g)
    emulated = run_linear(
        lambda x, w, b: tp.fp8_linear(x, w, b, recipe=decision.recipe, backend="emulated", device=arch), x, w, b, g
    )
    assert [t.dtype for t in got] == [t.dtype for t in emulated] == [dtype] * 4
    assert min(sqnrs(emulated, got)) >= min_db, sqnrs(emulated, got)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_adapter_matches_emulation_of_the_same_recipe(version, arch, monkeypatch):
    api = primus_turbo_double.install(monkeypatch, version=version, arch=arch)
    tp.registry.refresh()
    record = API_RECORD["versions"][version]
    for recipe in ("tensorwise", "rowwise"):
        decision = tp.select_backend("linear", recipe, arch)
        if version == "v0.2.0" and recipe == "tensorwise":
            assert decision.backend_name != "primus_turbo"
            assert "HYBRID" in dict(decision.passed_over)["primus_turbo"]
            continue
        assert decision.backend_name == "primus_turbo"
        assert decision.recipe.definition == ("primus_turbo" if version >= "v0.3.1" else "primus_turbo_v0.2")

        x = torch.randn(3, 85, 128, dtype=torch.bfloat16)  # M = 255, as Primus-Turbo's own tests
        w = torch.randn(96, 128) * 0.05
        b = torch.randn(96)
        g = torch.randn(3, 85, 96)
        got = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b, recipe=recipe, device=arch), x, w, b, g)
        emulated = run_linear(
            lambda x, w, b: tp.fp8_linear(x, w, b, recipe=decision.recipe, backend="emulated", device=arch), x, w, b, g
        )
        assert all(torch.isfinite(t).all() for t in got)
        assert min(sqnrs(emulated, got)) >= 40, sqnrs(emulated, got)

        if version == "v0.3.0" and recipe == "tensorwise":
            continue  # no device kernel for its grouped backward (test_primus_turbo_rules.py)
        counts = [37, 0, 90, 1, 29]
        offs = make_offsets(counts)
        A = torch.randn(sum(counts) + 13, 256, dtype=torch.bfloat16)  # 13 trailing rows
        W = (torch.randn(len(counts), 256, 256) * 0.05).bfloat16()  # K, N >= 256: Triton's limit
        gA = torch.randn(A.shape[0], 256)
        got = run_grouped(lambda A, B_t, offs: tp.fp8_grouped_mm(A, B_t, offs, recipe=recipe, device=arch), A, W, offs, gA)
        emulated = run_grouped(
            lambda A, B_t, offs: tp.fp8_grouped_mm(A, B_t, offs, recipe=decision.recipe, backend="emulated", device=arch),
            A, W, offs, gA,
        )
        out, grad_A, grad_W = got
        assert all(torch.isfinite(t).all() for t in got), "a row the double left NaN escaped"
        assert torch.equal(out[-13:], torch.zeros_like(out[-13:]))
        assert torch.equal(grad_A[-13:], torch.zeros_like(grad_A[-13:]))
        assert min(sqnrs(emulated, got)) >= 40, sqnrs(emulated, got)

    # Every call the adapter made fits the recorded signature of that release.
    assert api.calls
    for fn_name, n_positional, keywords in api.calls:
        spec = record["functions"][f"{OPS_MODULE}.ops.{fn_name}"]
        names = [p["name"] for p in spec["params"]]
        assert n_positional <= len(names) and set(keywords) <= set(names[n_positional:]), (fn_name, keywords)


def test_v01x_is_refused_with_a_reason(monkeypatch):
    """v0.1.x keeps its config enums at core.float8 and its gemm_fp8 has no ROWWISE path."""
    primus_turbo_double.install(monkeypatch, version=primus_turbo_double.LEGACY_VERSION)
    tp.registry.refresh()
    decision = tp.select_backend("linear", "rowwise", "gfx942")
    assert decision.backend_name != "primus_turbo"
    reason = dict(decision.passed_over)["primus_turbo"]
    assert "v0.1.x" in reason and ">= v0.2.0" in reason and "\n" not in reason


def test_gw_hp_has_no_primus_turbo_equivalent(turbo):
    decision = tp.select_backend("linear", "rowwise_with_gw_hp", "gfx942")
    assert decision.backend_name != "primus_turbo"
    assert "no 'rowwise_with_gw_hp' recipe" in dict(decision.passed_over)["primus_turbo"]
    with pytest.raises(tp.BackendUnavailableError, match="rowwise_with_gw_hp"):
        tp.select_backend("linear", "rowwise_with_gw_hp", "gfx942", requested="primus_turbo")


def test_primus_turbo_is_never_imported_off_mi300(turbo, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "primus_turbo.pytorch", None)  # importing it would fail loudly
    tp.registry.refresh()
    decision = tp.select_backend("linear", "rowwise", "sm90")
    assert decision.backend_name == "torchao"
    assert "MI300-class" in dict(decision.passed_over)["primus_turbo"]


def test_unimportable_primus_turbo_is_a_one_line_reason():
    reason = tp.registry.get_backend("primus_turbo").availability(tp.device_profile("gfx942")).reason
    assert "not importable" in reason and "\n" not in reason


@pytest.mark.mi300
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_primus_turbo_matches_emulation(recipe):
    """On real MI300-class hardware: the real kernels against the emulation of their recipe."""
    device = tp.detect_device()
    decision = tp.select_backend("linear", recipe, device)
    assert decision.backend_name == "primus_turbo", decision.explain()
    x = torch.randn(507, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, 1024, device="cuda") * 0.02
    g = torch.randn(507, 2048, device="cuda")
    got = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b, recipe=recipe), x, w, None, g)
    emulated = run_linear(lambda x, w, b: tp.fp8_linear(x, w, b, recipe=decision.recipe, backend="emulated"), x, w, None, g)
    assert min(sqnrs(emulated, got)) >= 30
