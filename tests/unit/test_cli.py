"""The titan-primus command line on a CPU: doctor, parity, bench and report, with small case sets.

Parity with Primus-Turbo as a third backend, on its own code: tests/real_turbo/test_routing.py.
"""

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from support.doubles.plugin_backends import CrashingBackend, Plugin, WrongBackend

import titan_primus as tp
from titan_primus import cli
from titan_primus.diagnostics import bench as bench_lib
from titan_primus.diagnostics import parity as parity_matrix
from titan_primus.diagnostics.results import SCHEMA_VERSION, load_document


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def strict_json(path) -> dict:
    """The file parses as strict JSON: no NaN or Infinity literals."""

    def refuse(literal):
        raise AssertionError(f"{path} contains the non-JSON literal {literal}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def plugin_backend(request):
    plugin = Plugin(request.param)
    tp.registry.register(plugin, name=f"test-plugin-{request.param.name}")
    yield request.param.name
    tp.registry.unregister(plugin)


# The tests that read these results run on one worker (--dist loadgroup), which makes them once.
shares_results = pytest.mark.xdist_group("cli_results")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Quick parity runs on the CPU and gfx942 profiles and a quick bench: results files, and the
    bench's console output under "bench_out"."""
    folder = tmp_path_factory.mktemp("results")
    paths = {name: folder / f"{name}.json" for name in ("parity_cpu", "parity_gfx942", "bench_cpu")}
    tp.registry.refresh()
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert cli.main(["parity", "--quick", "--json", str(paths["parity_cpu"])]) == 0
        assert cli.main(["parity", "--quick", "--device", "gfx942", "--json", str(paths["parity_gfx942"])]) == 0
    with redirect_stdout(io.StringIO()) as bench_out, redirect_stderr(io.StringIO()):
        assert cli.main(["bench", "--quick", "--recipe", "rowwise", "--json", str(paths["bench_cpu"])]) == 0
    return {**paths, "bench_out": bench_out.getvalue()}


def test_console_script_lists_the_subcommands():
    done = subprocess.run(
        [sys.executable, "-m", "titan_primus.cli", "--help"], capture_output=True, text=True, check=True
    )
    for command in ("doctor", "parity", "bench", "report"):
        assert command in done.stdout


def test_doctor_reports_versions_device_backends_and_routing(capsys):
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0
    for expected in ("torch", "torchtitan", "torchao", "primus-turbo", "device: CPU", "routing on cpu"):
        assert expected in out
    for backend in ("primus_turbo", "torchao", "emulated"):
        assert f"| {backend}" in out
    # Which MI300-class part a CPU run imitates, and how to get the other (issue 40).
    assert 'a CPU run emulates float8_e4m3fn (OCP, MI355X\'s gfx950): device="gfx942"' in out
    _, named, _ = run_cli(capsys, "doctor", "--device", "gfx942")
    assert "FP8 formats: float8_e4m3fnuz" in named and "a CPU run emulates" not in named


def test_a_torchao_that_renamed_a_symbol_is_a_reason_not_a_crash(capsys, monkeypatch):
    """TorchAO without ``float8_ops.float8_mm`` (issue 42's simulated rename): doctor reports it and
    exits 0 (before: ImportError out of doctor --device gfx942), routing passes TorchAO over with
    the symbol named (here nothing is left: the emulation never stands in on a GPU), and TorchAO named as the backend refuses at routing, not in a step."""
    import torchao.float8.float8_ops as float8_ops

    monkeypatch.delattr(float8_ops, "float8_mm")
    tp.registry.refresh()
    code, out, _ = run_cli(capsys, "doctor", "--json", "--device", "gfx942")
    assert code == 0
    doc = json.loads(out)
    (torchao,) = [b for b in doc["backends"] if b["name"] == "torchao"]
    assert not torchao["available"] and "lacks torchao.float8.float8_ops.float8_mm" in torchao["reason"]
    (row,) = [r for r in doc["routing"] if r["op"] == "linear" and r["recipe"] == "tensorwise"]
    assert row["backend"] is None, row  # nothing else runs FP8 automatically on a GPU without Primus-Turbo
    assert any(p["backend"] == "torchao" and "float8_mm" in p["reason"] for p in row["passed_over"]), row
    with pytest.raises(
        tp.BackendUnavailableError, match=r"lacks torchao\.float8\.float8_ops\.float8_mm.*verified on TorchAO"
    ):
        tp.select_backend("linear", "tensorwise", "gfx942", "torchao")


def test_doctor_says_what_the_expert_scales_cover_under_expert_parallelism(capsys, monkeypatch):
    monkeypatch.setenv("TITAN_PRIMUS_BACKEND", "emulated")  # Primus-Turbo's definitions, as on an MI300X
    code, out, _ = run_cli(capsys, "doctor", "--device", "gfx942")
    assert code == 0
    section = out.split("grouped_mm under expert parallelism")[1]
    assert (
        "rowwise (emulated, primus_turbo definition): scales spanning experts (grad_weight.grad_output, "
        "grad_weight.input) are taken over the rank's own experts" in section
    )
    assert "tensorwise (emulated, primus_turbo definition): scales spanning experts (all of them)" in section
    assert "blockwise (emulated, primus_turbo definition): every scale covers one expert's data" in section
    assert "rowwise_with_gw_hp (emulated, torchao definition): refused" in section
    code, out, _ = run_cli(capsys, "doctor", "--json", "--device", "gfx942")
    rows = {(r["op"], r["recipe"]): r["expert_parallel"] for r in json.loads(out)["routing"]}
    assert rows["linear", "rowwise"] is None and rows["grouped_mm", "tensorwise"].startswith("scales spanning")


def test_doctor_says_how_fp8_dispatch_sends_each_recipes_tokens(capsys, monkeypatch):
    monkeypatch.setenv("TITAN_PRIMUS_BACKEND", "emulated")
    code, out, _ = run_cli(capsys, "doctor", "--device", "gfx942")
    section = out.split("token dispatch with fp8_dispatch on")[1].split("\n\n")[0]
    assert "rowwise: in FP8 (payload + scales of its activation cast)" in section
    assert "tensorwise: in the activations' dtype: its activation scale spans every routed token" in section
    assert "blockwise: in the activations' dtype: its tile scales are not powers of two" in section
    code, out, _ = run_cli(capsys, "doctor", "--json", "--device", "gfx942")
    rows = {(r["op"], r["recipe"]): r["fp8_dispatch"] for r in json.loads(out)["routing"]}
    assert rows["linear", "rowwise"] is None and rows["grouped_mm", "rowwise"].startswith("in FP8")


def test_doctor_reports_a_missing_torchtitan_in_one_line(capsys, monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(name):
        if name == "torchtitan":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("| torchtitan")]
    assert "not installed" in line


def test_doctor_routing_rows_are_short_and_each_long_reason_is_listed_once(capsys):
    # As a new user tries it: a named MI300X profile without Primus-Turbo, where most rows have no
    # backend and every row passes over the same backends for the same long reasons.
    code, out, _ = run_cli(capsys, "doctor", "--device", "gfx942")
    assert code == 0
    table = out[out.index("routing on gfx942") :].split("\n\n")[0].splitlines()[1:]
    assert len(table) == 2 + 2 * len(tp.RECIPE_NAMES)
    assert max(len(line) for line in table) <= 160
    notes = out[out.index("why backends were passed over:") :].splitlines()[1:]
    assert len(notes) == len(set(notes)) and all(line.startswith("  [") for line in notes if line)
    turbo = [line for line in notes if "Primus-Turbo is not importable" in line]
    assert len(turbo) == 1 and out.count("Primus-Turbo is not importable") == 3  # versions, backends, notes
    number = turbo[0].split("]")[0].strip() + "]"
    assert all(f"primus_turbo {number}" in row for row in table[2:])
    diagnosis = json.loads(run_cli(capsys, "doctor", "--json", "--device", "gfx942")[1])
    unrouted = [r for r in diagnosis["routing"] if r["backend"] is None]
    assert unrouted and all(r["reason"].startswith("no backend can run") for r in unrouted)
    assert all({p["backend"] for p in r["passed_over"]} == {"primus_turbo", "torchao", "emulated"} for r in unrouted)


@pytest.mark.parametrize("plugin_backend", [WrongBackend], indirect=True)
def test_doctor_json_shows_plugins_and_a_named_profile(capsys, plugin_backend):
    code, out, _ = run_cli(capsys, "doctor", "--json", "--device", "gfx942")
    assert code == 0
    diagnosis = json.loads(out)
    assert diagnosis["environment"]["device"]["arch"] == "gfx942"
    assert diagnosis["environment"]["device"]["e4m3"] == "float8_e4m3fnuz"
    names = [b["name"] for b in diagnosis["backends"]]
    assert plugin_backend in names and "primus_turbo" in names
    turbo = next(b for b in diagnosis["backends"] if b["name"] == "primus_turbo")
    assert not turbo["available"] and "not importable" in turbo["reason"]
    assert len(diagnosis["routing"]) == len(tp.RECIPE_NAMES) * 2
    assert {r["backend"] for r in diagnosis["routing"]} == {plugin_backend}


@shares_results
def test_parity_quick_passes_on_cpu_and_writes_the_schema(results):
    doc = strict_json(results["parity_cpu"])
    assert load_document(str(results["parity_cpu"])) == doc
    assert doc["schema_version"] == SCHEMA_VERSION and doc["kind"] == "parity"
    assert {"date", "versions", "device"} <= set(doc["environment"])
    assert doc["summary"]["ok"] and doc["summary"]["fail"] == doc["summary"]["error"] == 0
    rows = doc["results"]
    assert {r["op"] for r in rows} == {"linear", "grouped_mm", "attention"}
    assert {r["recipe"] for r in rows if r["op"] != "attention"} == set(tp.RECIPE_NAMES)
    for row in rows:
        if row["status"] == "skipped":
            assert row["reason"], row
        else:
            quantities = 4 if row["op"] == "attention" else 3  # out, dq, dk, dv; out, grad_input, grad_weight
            assert row["status"] == "pass" and len([c for c in row["checks"] if c["against"] == "fp32"]) == quantities
    turbo = [r for r in rows if r["backend"] == "primus_turbo"]
    assert turbo and all(r["status"] == "skipped" and ("MI300" in r["reason"] or "fnuz" in r["reason"]) for r in turbo)
    # TorchAO's linear is compared with the emulation of the same (torchao) definition.
    ao = [r for r in rows if r["backend"] == "torchao" and r["op"] == "linear" and r["status"] == "pass"]
    assert ao and all(any(c["against"] == "emulated" and c["threshold_db"] == 40 for c in r["checks"]) for r in ao)
    # The fnuz-range case runs under gfx942 (this CPU is not FNUZ), emulation only.
    fnuz = [r for r in rows if r["case"] == "fnuz_range" and r["status"] != "skipped"]
    assert fnuz and {(r["device"], r["backend"]) for r in fnuz} == {("gfx942", "emulated")}


@pytest.mark.parametrize("name", ["parity_cpu", "parity_gfx942"])
@shares_results
def test_parity_quick_runs_fp8_attention_on_the_emulation_against_fp32_sdpa(results, name):
    """Causal, full, GQA and a v head dim below q/k's; measured on this CPU at both profiles'
    formats (2026-12-02): out 25.6-27.5 dB, dq 23.3-23.9, dk 23.5-24.1, dv 25.2-27.0 against the
    bar of 20 (Primus-Turbo's own FP8 attention gate)."""
    doc = strict_json(results[name])
    rows = [r for r in doc["results"] if r["op"] == "attention"]
    assert {r["case"] for r in rows} == {"causal", "full", "gqa_causal", "dv_differs"}
    assert {c["name"] for c in doc["settings"]["cases"] if c["op"] == "attention"} == {r["case"] for r in rows}
    assert doc["settings"]["thresholds_db"]["fp8_attention_vs_fp32"] == 20
    emulated = [r for r in rows if r["backend"] == "emulated"]
    assert len(emulated) == 4 and all(r["status"] == "pass" and r["definition"] == "primus_turbo" for r in emulated)
    # backend="auto" picks the emulation for FP8 attention on a CPU, nothing under a named gfx942 without Primus-Turbo.
    assert all(r["routed"] == (name == "parity_cpu") for r in emulated)
    for row in emulated:
        db = {c["quantity"]: c["sqnr_db"] for c in row["checks"]}
        assert {c["against"] for c in row["checks"]} == {"fp32"} and list(db) == ["out", "dq", "dk", "dv"]
        assert db["out"] > 24.5 and db["dq"] > 22.5 and db["dk"] > 22.5 and db["dv"] > 24.5, row
    turbo = [r for r in rows if r["backend"] == "primus_turbo"]
    assert len(turbo) == 4 and all(r["status"] == "skipped" and r["reason"].startswith("unavailable") for r in turbo)


def test_parity_fails_fp8_attention_that_returns_nan(monkeypatch):
    from titan_primus.backends.emulated import attention as emulated_attention

    real = emulated_attention.fp8_attention

    def nan_attention(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + torch.full_like(out, float("nan"))

    monkeypatch.setattr(emulated_attention, "fp8_attention", nan_attention)
    (row, _) = parity_matrix.run_matrix(tp.detect_device(), (), attention_cases=parity_matrix.QUICK_ATTENTION_CASES[:1])
    assert row.backend == "emulated" and row.status == "fail"
    assert "out has NaN/inf" in row.reason and "out vs fp32 -inf dB < 20" in row.reason


@shares_results
def test_parity_on_the_gfx942_profile_compares_differently_defined_recipes_with_fp32_only(results):
    rows = strict_json(results["parity_gfx942"])["results"]
    rowwise = [
        r
        for r in rows
        if r["op"] == "linear" and r["recipe"] == "rowwise" and r["case"] == "m255" and r["status"] == "pass"
    ]
    assert {(r["backend"], r["definition"]) for r in rowwise} == {
        ("emulated", "primus_turbo"),
        ("emulated", "torchao"),
        ("torchao", "torchao"),
    }
    torchao = next(r for r in rowwise if r["backend"] == "torchao")
    assert "emulated (primus_turbo)" in torchao["differs_from"]
    assert {c["against"] for c in torchao["checks"]} == {"fp32", "emulated"}
    # TorchAO's grouped kernels cannot run on this CPU under the named profile: skipped, with the error.
    grouped = next(
        r for r in rows if r["backend"] == "torchao" and r["op"] == "grouped_mm" and r["recipe"] == "rowwise"
    )
    assert grouped["status"] == "skipped" and "named profile gfx942" in grouped["reason"]


@pytest.mark.parametrize("plugin_backend", [WrongBackend, CrashingBackend], indirect=True)
def test_parity_fails_when_a_backend_is_wrong_or_crashes(capsys, plugin_backend, tmp_path):
    path = tmp_path / "parity.json"
    code, out, _ = run_cli(capsys, "parity", "--quick", "--json", str(path))
    assert code == 1
    assert "failures:" in out
    rows = [r for r in strict_json(path)["results"] if r["backend"] == plugin_backend and r["status"] != "skipped"]
    assert rows and all(r["status"] in ("fail", "error") and r["reason"] for r in rows)
    # Its attention too: a plugin's attention kernels are compared as any backend's (the registry's).
    assert any(r["op"] == "attention" for r in rows)
    if plugin_backend == "wrong":  # 1.5x the answer: ~6 dB against fp32 and against the emulation
        assert all(not c["passed"] for r in rows for c in r["checks"])
    else:
        assert all("kernel launch failed" in r["reason"] for r in rows)


@pytest.mark.parametrize(
    "required, expected", [("primus_turbo", "unavailable on cpu"), ("no_such_backend", "not a registered backend")]
)
def test_parity_fails_when_a_required_backend_does_not_run(capsys, required, expected):
    code, out, err = run_cli(capsys, "parity", "--quick", "--require", required)
    assert code == 1
    assert "required backends that did not run" in out and expected in out
    # Off a terminal (a CI log), each case is named on stderr as it starts: never silent.
    started = [line for line in err.splitlines() if line.startswith("parity [")]
    assert started[0].startswith("parity [1/") and "emulated" in started[0], err[:500]
    assert len(started) == int(started[0].split("/")[1].split("]")[0])


def test_progress_names_each_item_before_it_runs():
    import io

    from titan_primus.cli.progress import progress

    err = io.StringIO()
    with progress("bench", 2, err) as reporter:
        reporter.starting("linear w1: bf16, torchao")
        reporter.finished()
        reporter.starting("grouped_mm experts: bf16")
    assert err.getvalue().splitlines() == [
        "bench [1/2] linear w1: bf16, torchao",
        "bench [2/2] grouped_mm experts: bf16",
    ]


@shares_results
def test_bench_quick_on_cpu_says_what_cpu_figures_mean(results):
    assert "CPU figures are not FP8 performance" in results["bench_out"]
    doc = strict_json(results["bench_cpu"])
    assert doc["kind"] == "bench" and doc["schema_version"] == SCHEMA_VERSION
    measured = [r for r in doc["results"] if r["status"] == "ok"]
    assert {(r["op"], r["backend"]) for r in measured} >= {
        ("linear", "bf16"),
        ("linear", "emulated"),
        ("linear", "torchao"),
        ("grouped_mm", "bf16"),
        ("grouped_mm", "emulated"),
        ("attention", "bf16"),
        ("attention", "emulated"),
    }
    attention = [r for r in doc["results"] if r["op"] == "attention"]
    assert {r["case"] for r in attention} == {"llama3_8b.attention", "deepseek_v3.attention"}
    assert {(r["backend"], r["recipe"]) for r in attention} == {
        ("bf16", None),
        ("primus_turbo", "bf16"),
        ("primus_turbo", "fp8_blockwise64"),
        ("emulated", "fp8_blockwise64"),
    }
    assert all(r["status"] == "skipped" and "MI300" in r["reason"] for r in attention if r["backend"] == "primus_turbo")
    assert "attention FLOPs (FlashAttention's convention)" in results["bench_out"]
    for row in measured:  # shapes of the figures, never their values: timings are not asserted
        assert row["ms"] > 0 and row["tflops"] > 0 and row["fraction_of_peak"] is None
        assert (row["speedup_vs_bf16"] is None) == (row["backend"] == "bf16")
    assert all(r["reason"] for r in doc["results"] if r["status"] == "skipped")
    # Stock TorchAO beside the torchao backend, on the linears it defines (its grouped GEMM runs
    # no CPU kernel: the backend's row is skipped here, and so no stock row).
    stock = [r for r in doc["results"] if r.get("stock_of")]
    assert [(r["op"], r["backend"], r["recipe"]) for r in stock] == [("linear", "torchao (stock)", "rowwise")]
    for row in stock:
        assert row["stock_path"] == "TorchAO convert_to_float8_training" and row["status"] == "ok", row
        assert row["titan_primus_vs_stock"] > 0 and isinstance(row["bitwise_equal_to_titan_primus"], bool)
    assert all("stock_of" not in r for r in doc["results"] if r["backend"] != "torchao (stock)")
    assert (
        "tp/stock" in results["bench_out"]
        and "torchao (stock): TorchAO convert_to_float8_training" in (results["bench_out"])
    )


def test_attention_flops_follow_flash_attentions_convention():
    """Llama3-8B causal at 8192 tokens: 4*B*H*S^2*D forward, halved; backward 2.5x. DeepSeek-V3's
    MLA: 2*B*H*S^2*(192 + 128) forward. On a CPU the heads shrink but keep 4 query heads per KV head."""
    llama, deepseek = bench_lib.ATTENTION_SHAPES
    assert llama.forward_flops == 4 * 32 * 8192**2 * 128 // 2 and llama.flops == llama.forward_flops * 3.5
    assert deepseek.forward_flops == 2 * 128 * 8192**2 * (192 + 128) // 2
    scaled = llama.scaled(64)
    assert (scaled.seq, scaled.heads.heads, scaled.heads.kv_heads, scaled.heads.head_dim) == (128, 4, 1, 128)


def test_peaks_are_found_by_marketing_name():
    assert bench_lib.peak_for("AMD Instinct MI300X")[1].fp8 == pytest.approx(2614.9)
    assert bench_lib.peak_for("NVIDIA H100 80GB HBM3")[0] == "H100"
    assert bench_lib.peak_for("CPU") is None


@shares_results
def test_report_renders_files_side_by_side_with_a_png(capsys, results, tmp_path):
    png = tmp_path / "sqnr.png"
    files = [str(results[name]) for name in ("parity_cpu", "parity_gfx942", "bench_cpu")]
    code, out, _ = run_cli(capsys, "report", *files, "--png", str(png))
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("| op ") and "recipe" in line)
    assert "parity_cpu.json (cpu)" in header and "parity_gfx942.json (gfx942)" in header
    assert "## Bench" in out and "bench_cpu.json (cpu)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_bad_files_in_one_line(capsys, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(
            {"schema_version": 0, "kind": "parity", "environment": {}, "settings": {}, "results": [], "summary": {}}
        )
    )
    for path, expected in (
        (tmp_path / "missing.json", "cannot read"),
        (bad_json, "not valid JSON"),
        (old, "schema_version 0"),
    ):
        code, out, err = run_cli(capsys, "report", str(path))
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith("titan-primus report: error:") and expected in err


def test_an_unknown_device_profile_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["parity", "--device", "gfx999"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'gfx999'" in capsys.readouterr().err
