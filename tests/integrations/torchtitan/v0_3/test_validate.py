"""``titan-primus validate``: TorchTitan's real trainer (bf16, FP8, the seed floor, the last-bit
floor) through the CLI, run as installed (a wheel of this checkout installed into a folder of
its own, run from another folder), its verdicts, the baseline checks and comparison, and the
report. One quick run is shared by the module; an injected regression and FP8 that never
engaged need runs of their own."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import corrupt_backend
from support.once import once_per_session
from support.repo_root import ROOT

from titan_primus.cli import build_parser
from titan_primus.diagnostics.results import load_document
from titan_primus.diagnostics.validate.baseline import BaselineMismatch, mismatches, refuse_mismatches
from titan_primus.diagnostics.validate.run import judge_document
from titan_primus.cli.validate_results import render_validate_markdown

QUICK_STEPS = 20
pytestmark = pytest.mark.trainer
# One worker runs every test of the shared quick run (tests/support/scheduling.py).
shares_the_quick_run = pytest.mark.xdist_group("validate_quick")


def _validate(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "titan_primus.cli", "validate", "--quick", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def _install_wheel(shared: Path) -> Path:
    """This checkout built as a wheel and pip-installed (not editable, no dependencies: the venv
    has them) into a folder of its own; returns the folder."""
    target, wheels = shared / "installed", shared / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    subprocess.run([*build, str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("titan_primus-*.whl")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    return target


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `validate --quick` run per session, shared by the xdist workers, from a non-editable
    install of this checkout, in a folder outside the clone: (exit code, Markdown, JSON path,
    document, the installed package's folder)."""

    def run() -> dict:
        shared = tmp_path_factory.mktemp("validate-quick")
        target = _install_wheel(shared)
        elsewhere, path = shared / "elsewhere", shared / "validate-quick.json"
        elsewhere.mkdir()
        proc = _validate("--json", str(path), env={"PYTHONPATH": str(target)}, cwd=elsewhere)
        assert path.exists(), proc.stdout + proc.stderr[-4000:]
        return {"code": proc.returncode, "markdown": proc.stdout, "path": str(path), "installed": str(target)}

    made = once_per_session("validate-quick", run)
    return made["code"], made["markdown"], Path(made["path"]), load_document(made["path"]), Path(made["installed"])


def _judged(doc: dict, baseline: dict | None = None) -> dict:
    return judge_document(copy.deepcopy(doc), baseline)


def _verdict(doc: dict, name: str) -> dict:
    (verdict,) = [v for v in doc["results"][0]["verdicts"] if v["name"] == name]
    return verdict


@shares_the_quick_run
def test_quick_run_as_installed_passes_and_records_every_step(quick):
    code, markdown, _, doc, installed = quick
    assert code == 0, markdown
    assert doc["kind"] == "validate" and doc["summary"]["status"] == "pass"
    (result,) = doc["results"]
    assert set(result["runs"]) == {"bf16", "fp8", "seed_floor", "last_bit_floor"}
    for role, run in result["runs"].items():
        assert [s["step"] for s in run["steps"]] == list(range(1, QUICK_STEPS + 1)), role
        assert all(s["tps"] > 0 and s["memory_bytes"] > 0 and s["grad_norm"] > 0 for s in run["steps"]), role
        assert "torch.distributed.run" in run["command"]
        # The run's one spec leads its command, as the child got it (RunSpec).
        spec = json.loads(shlex.split(run["command"])[0].removeprefix("TITAN_PRIMUS_VALIDATE_RUN="))
        assert (spec["fp8"], spec["last_bit"]) == (role in ("fp8", "last_bit_floor"), role == "last_bit_floor"), spec
        assert spec["cpu_launcher"].endswith("v0_3/launch.py") and spec["metrics"].endswith(".metrics.jsonl")
        # The trainer ran the installed package's launcher, not the clone's.
        assert str(installed / "titan_primus" / "diagnostics" / "validate" / "launch.py") in run["command"], run[
            "command"
        ]
    assert result["runs"]["last_bit_floor"]["last_bit_flipped"] > 0
    assert result["runs"]["fp8"]["config"] == "llama3_debugmodel_fp8"
    assert "titan-primus FP8 routing" in result["routing"] and "emulated" in result["routing"]
    routing = result["runs"]["fp8"]["routing_data"]
    assert routing["preferred_backend"] == "emulated" and routing["ops"]["linear"]["backend"] == "emulated"
    assert result["runs"]["bf16"]["routing_data"] is None
    # Both floors measured on both curves, the last-bit one far below the seed one.
    for key in ("loss", "grad_norm"):
        seed, last_bit = result["floors"]["seed"][key], result["floors"]["last_bit"][key]
        assert 0 < last_bit["curve"] < seed["curve"] / 5, result["floors"]
    assert doc["environment"]["versions"]["torchtitan"] and doc["environment"]["device_name"]
    names = {v["name"] for v in result["verdicts"]}
    assert {"fp8 engaged", "fp8 loss curve vs bf16", "fp8 grad-norm level vs bf16"} <= names
    assert "PASS" in markdown and "seed floor" in markdown


@shares_the_quick_run
def test_report_renders_the_curves(quick, tmp_path):
    _, _, path, _, _ = quick
    png = tmp_path / "curves.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "titan_primus.cli", "report", str(path), "--png", str(png)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "fp8 loss curve vs bf16" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@shares_the_quick_run
def test_against_its_own_json_passes(quick):
    _, _, path, doc, _ = quick
    judged = _judged(doc, load_document(str(path)))
    assert judged["summary"]["status"] == "pass", judged["summary"]
    names = {v["name"] for v in judged["results"][0]["verdicts"]}
    assert {"fp8 loss curve vs baseline", "fp8 grad-norm level vs baseline", "fp8 tokens/s vs baseline"} <= names
    assert "the same backends, definitions and layers as the baseline" in _verdict(judged, "fp8 engaged")["text"]


@shares_the_quick_run
def test_a_baseline_with_5_percent_lower_losses_fails_on_the_loss(quick):
    _, _, _, doc, _ = quick
    lower = copy.deepcopy(doc)
    for run in lower["results"][0]["runs"].values():
        for step in run["steps"]:
            step["loss"] *= 0.95
    judged = _judged(doc, lower)
    failed = judged["summary"]["failed_verdicts"]
    assert "llama3_debugmodel: fp8 loss curve vs baseline" in failed, failed
    assert "llama3_debugmodel: bf16 loss curve vs baseline" in failed, failed
    assert not any("tokens/s" in f or "memory" in f or "grad-norm" in f for f in failed), failed
    text = _verdict(judged, "fp8 loss curve vs baseline")["text"]
    assert "5.26%" in text and "last-bit floor" in text, text


@shares_the_quick_run
def test_a_weight_gradient_off_in_scale_fails_the_grad_norm_level(quick):
    """AdamW hides a weight gradient's scale from the loss; the grad norm shows it."""
    _, _, _, doc, _ = quick
    off = copy.deepcopy(doc)
    for role in ("fp8", "last_bit_floor"):  # a regression moves both FP8 runs
        for step in off["results"][0]["runs"][role]["steps"]:
            step["grad_norm"] *= 0.85
    judged = _judged(off)
    assert _verdict(judged, "fp8 grad-norm level vs bf16")["status"] == "fail"
    assert _verdict(judged, "fp8 loss curve vs bf16")["status"] == "pass"
    assert _verdict(_judged(off, doc), "fp8 grad-norm level vs baseline")["status"] == "fail"


@shares_the_quick_run
def test_zero_floors_are_no_bound(quick):
    """A seed floor of zero (the seed run equals bf16) and a last-bit floor of zero fail the
    verdicts they bound, even where the gap is zero too."""
    _, _, _, doc, _ = quick
    same = copy.deepcopy(doc)
    runs = same["results"][0]["runs"]
    runs["seed_floor"]["steps"] = copy.deepcopy(runs["bf16"]["steps"])
    runs["last_bit_floor"]["steps"] = copy.deepcopy(runs["fp8"]["steps"])
    judged = _judged(same, doc)
    for name in ("fp8 loss curve vs bf16", "fp8 grad-norm level vs bf16", "fp8 loss curve vs baseline"):
        verdict = _verdict(judged, name)
        assert verdict["status"] == "fail" and "no bound" in verdict["text"], verdict


@shares_the_quick_run
def test_fp8_that_fell_away_fails_fp8_engaged(quick):
    _, _, _, doc, _ = quick
    # The FP8 run's curve is bf16's: FP8 changed nothing.
    nothing = copy.deepcopy(doc)
    runs = nothing["results"][0]["runs"]
    runs["fp8"]["steps"] = copy.deepcopy(runs["bf16"]["steps"])
    assert "FP8 changed nothing" in _verdict(_judged(nothing), "fp8 engaged")["text"]
    # Layers the baseline ran in FP8 stay in high precision now, with the routing's reason.
    fell = copy.deepcopy(doc)
    layers = fell["results"][0]["runs"]["fp8"]["routing_data"]["layers"]
    for layer in layers[:3]:
        layer.update(backend=None, kept="unsupported", reason="the kernel refuses K=256")
    verdict = _verdict(_judged(fell, doc), "fp8 engaged")
    assert verdict["status"] == "fail" and "3 layers the baseline ran in FP8" in verdict["text"], verdict
    assert layers[0]["fqn"] in verdict["text"] and "the kernel refuses K=256" in verdict["text"], verdict
    assert _verdict(_judged(fell), "fp8 engaged")["status"] == "pass"  # a shape refusal, without a baseline
    # Another backend or definition than the baseline's.
    moved = copy.deepcopy(doc)
    moved["results"][0]["runs"]["fp8"]["routing_data"]["ops"]["linear"]["definition"] = "tensorwise (other)"
    verdict = _verdict(_judged(moved, doc), "fp8 engaged")
    assert verdict["status"] == "fail" and "tensorwise (other)" in verdict["text"], verdict
    # Expert blocks the baseline dispatched in FP8 that dispatch in high precision now.
    dispatched = copy.deepcopy(doc)
    routing = dispatched["results"][0]["runs"]["fp8"]["routing_data"]
    routing["token_dispatch"] = {"layers.1.moe.experts": {"fp8": True, "reason": "one scale per row"}}
    verdict = _verdict(_judged(doc, dispatched), "fp8 engaged")
    assert verdict["status"] == "fail" and "1 expert blocks whose tokens the baseline dispatched" in verdict["text"]
    # Attention layers the baseline ran on a backend (or in FP8) that run otherwise now.
    attention = copy.deepcopy(doc)
    routing = attention["results"][0]["runs"]["fp8"]["routing_data"]
    routing["attention"] = {
        f"layers.{i}.attention.inner_attention": {"backend": "emulated", "fp8": True, "reason": "causal"}
        for i in range(2)
    }
    assert "2 of 2 attention layers on emulated (FP8)" in _verdict(_judged(attention), "fp8 engaged")["text"]
    now = copy.deepcopy(attention)
    now["results"][0]["runs"]["fp8"]["routing_data"]["attention"]["layers.1.attention.inner_attention"] = {
        "backend": None,
        "fp8": False,
        "reason": "the attention option is off",
    }
    verdict = _verdict(_judged(now, attention), "fp8 engaged")
    assert verdict["status"] == "fail" and "1 attention layers no longer run as in the baseline" in verdict["text"]
    assert "layers.1.attention.inner_attention" in verdict["text"] and "option is off" in verdict["text"], verdict
    # Another backend than the one expected here.
    expected = copy.deepcopy(doc)
    expected["results"][0]["fp8_options"] = {"backend": "torchao"}
    verdict = _verdict(_judged(expected), "fp8 engaged")
    assert verdict["status"] == "fail" and "linear ran on emulated, not torchao" in verdict["text"], verdict


@shares_the_quick_run
def test_a_baseline_compares_like_with_like(quick, tmp_path):
    """Other steps fail, naming them, before any training (seconds); allowed, they are compared on
    the steps both have."""
    _, _, path, doc, _ = quick
    shorter = copy.deepcopy(doc)
    result = shorter["results"][0]
    result["steps"] = 5
    for run in result["runs"].values():
        run["steps"] = run["steps"][:5]
    baseline = tmp_path / "shorter.json"
    baseline.write_text(json.dumps(shorter))
    started = time.perf_counter()
    proc = _validate("--baseline", str(baseline), "--json", str(tmp_path / "x.json"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "steps (baseline 5, now 20)" in proc.stderr and "--allow-mismatch steps" in proc.stderr, proc.stderr
    assert time.perf_counter() - started < 60 and not (tmp_path / "x.json").exists()
    settings = {k: doc["settings"][k] for k in ("seed", "floor_seed", "window", "nproc")}
    found = mismatches(doc["results"], settings, shorter)
    assert [m["field"] for m in found] == ["steps"]
    with pytest.raises(BaselineMismatch, match="steps"):
        refuse_mismatches(found, set(), "shorter.json")
    refuse_mismatches(found, {"steps"}, "shorter.json")
    judged = _judged(doc, shorter)
    text = _verdict(judged, "fp8 loss curve vs baseline")["text"]
    assert "5 steps compared" in text and "5 steps compared" in render_validate_markdown(judged, "x"), text
    # Every setting named: another seed and an FP8-only option.
    other = copy.deepcopy(doc)
    other["settings"]["seed"] = 7
    other["results"][0]["fp8_options"] = {"fp8_dispatch": True}
    assert {m["field"] for m in mismatches(doc["results"], settings, other)} == {"seed", "fp8_options"}


@shares_the_quick_run
@pytest.mark.parametrize("missing", ["fp8 run", "tps", "routing_data", "steps setting"])
def test_a_baseline_missing_a_run_or_a_field_exits_2_at_once(quick, tmp_path, missing):
    _, _, _, doc, _ = quick
    broken = copy.deepcopy(doc)
    result = broken["results"][0]
    if missing == "fp8 run":
        del result["runs"]["fp8"]
    elif missing == "tps":
        for step in result["runs"]["bf16"]["steps"]:
            del step["tps"]
    elif missing == "routing_data":
        del result["runs"]["fp8"]["routing_data"]
    else:
        del result["steps"]
    baseline = tmp_path / "broken.json"
    baseline.write_text(json.dumps(broken))
    started = time.perf_counter()
    proc = _validate("--baseline", str(baseline))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    expected = {
        "fp8 run": "the fp8 run",
        "tps": "per-step tps",
        "routing_data": "routing_data",
        "steps setting": ".steps",
    }
    assert expected[missing] in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert time.perf_counter() - started < 60


@shares_the_quick_run
def test_a_nan_loss_fails_every_loss_verdict(quick):
    _, _, _, doc, _ = quick
    nan = copy.deepcopy(doc)
    nan["results"][0]["runs"]["fp8"]["steps"][-3]["loss"] = float("nan")
    judged = _judged(nan, doc)
    for name in ("finite loss and grad norm", "fp8 loss curve vs bf16", "fp8 loss curve vs baseline"):
        assert _verdict(judged, name)["status"] == "fail", _verdict(judged, name)


@shares_the_quick_run
def test_grad_norm_spikes_bf16_lacks_are_judged_against_the_seed_floor(quick):
    _, _, _, doc, _ = quick
    s = doc["settings"]
    name = "no more grad-norm spikes bf16 lacks than the seed floor"
    spiked = copy.deepcopy(doc)

    def spike(role, step):
        spiked["results"][0]["runs"][role]["steps"][step - 1]["grad_norm"] *= 10 * s["spike_factor"]

    spike("fp8", 15)
    verdict = _verdict(_judged(spiked), name)
    assert verdict["status"] == "fail" and "FP8 [15]" in verdict["text"], verdict
    spike("seed_floor", 17)  # an equally good bf16 run with a spike of its own
    assert _verdict(_judged(spiked), name)["status"] == "pass"
    spike("bf16", 14)  # bf16 spikes there too: FP8's is not its own
    verdict = _verdict(_judged(spiked), name)
    assert verdict["status"] == "pass" and "FP8 none" in verdict["text"], verdict


def _plugin_env(tmp_path: Path, module, **extra) -> dict:
    module.write_entry_point(tmp_path)
    return {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(module.__file__).parent), str(tmp_path)]),
        "TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD": "",  # conftest turns plugins off; this one is the point
        **extra,
    }


def test_a_corrupted_backend_fails_the_convergence_verdict(tmp_path):
    """A backend wrong from step 3 on (tests/support/corrupt_backend.py), over 10 steps: one window of the
    loss verdict, half the quick run's cost."""
    env = _plugin_env(tmp_path, corrupt_backend, TITAN_PRIMUS_BACKEND="corrupted", **{corrupt_backend.ENV: "rows:3"})
    path = tmp_path / "corrupted.json"
    proc = _validate("--steps", "10", "--json", str(path), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    doc = json.loads(path.read_text())
    assert "-> corrupted" in (doc["results"][0]["routing"] or ""), proc.stdout + proc.stderr[-4000:]
    failed = doc["summary"]["failed_verdicts"]
    assert "llama3_debugmodel: fp8 loss curve vs bf16" in failed, failed
    assert "llama3_debugmodel: runs complete" not in failed and "llama3_debugmodel: fp8 engaged" not in failed


def test_primus_turbo_named_on_a_cpu_fails_before_training(tmp_path):
    """Issue 42's case: Primus-Turbo named (nothing can convert here). A named backend never falls
    back, so the converter would refuse it: validate says so before it trains anything."""
    path = tmp_path / "pt.json"
    proc = _validate("--steps", "4", "--json", str(path), env={"TITAN_PRIMUS_BACKEND": "primus_turbo"})
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert "titan-primus validate: FAIL before training: backend 'primus_turbo' (from TITAN_PRIMUS_BACKEND)" in (
        proc.stderr
    )
    assert "Primus-Turbo runs only on" in proc.stderr and "never falls back" in proc.stderr
    assert "step" not in proc.stdout and not path.exists()


def test_the_fp8_only_options_reach_the_fp8_runs_only():
    from titan_primus.diagnostics.validate.run import fp8_options, plans
    from titan_primus.integrations.torchtitan.v0_3.trainer import Line03

    args = build_parser().parse_args(
        ["validate", "--quick", "--backend", "torchao", "--fp8-dispatch", "--filter-fqns", "router.gate,output"]
    )
    (plan,) = plans(args, on_gpu=False, line=Line03())
    assert (
        plan.fp8_options
        == fp8_options(args)
        == {
            "backend": "torchao",
            "fp8_dispatch": True,
            "filter_fqns": ["router.gate", "output"],
        }
    )


@pytest.mark.parametrize("script", ["cpu-moe.sh", "cuda.sh"])
def test_ci_jobs_run_validate_with_arguments_it_takes(script):
    text = (ROOT / "ci" / script).read_text().replace("\\\n", " ")  # continued lines joined
    lines = [line for line in text.splitlines() if "ci/validate.sh" in line and not line.startswith("#")]
    assert lines, f"ci/{script} runs no validate"
    for line in lines:
        name, *argv = shlex.split(line[line.index("ci/validate.sh") :])[1:]
        assert name.split("-")[0] == script.removesuffix(".sh").split("-")[0]
        build_parser().parse_args(["validate", *argv])  # exits (fails the test) on an unknown option


def _envelope(kind: str, results: list) -> dict:
    return {"schema_version": 1, "kind": kind, "environment": {}, "settings": {}, "results": results, "summary": {}}


def test_bad_validate_input_is_one_line(tmp_path, capsys):
    from titan_primus import cli

    no_runs = tmp_path / "no-runs.json"
    no_runs.write_text(json.dumps(_envelope("validate", [{"config": "x", "module": "llama3", "verdicts": []}])))
    parity = tmp_path / "parity.json"
    parity.write_text(json.dumps(_envelope("parity", [])))
    for argv, expected in (
        (["report", str(no_runs)], "results[0] lacks runs"),
        (["validate", "--quick", "--baseline", str(parity)], "a parity file, not a validate JSON"),
        (["validate", "--quick", "--floor-seed", "42"], "--floor-seed must differ from --seed"),
        (["validate", "--config", "llama3_debugmodel"], "--config needs --module"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err


def test_the_injected_casts_are_the_regressions_they_name():
    """tests/support/regressions.py, the plugin behind docs/validate.md's power table: each cast
    regression changes the FP8 codes the way its name says, and nothing else."""
    from support import regressions

    import titan_primus.fp8.scaling as scaling

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().max()
    healthy = scaling.scaled_cast(x, scale, torch.float8_e4m3fn).float()

    def cast(kind, size):
        return regressions.regressed_cast(kind, size, scaling.scaled_cast)(x, scale, torch.float8_e4m3fn).float()

    down = cast("rounding", 1.0)
    changed = down != healthy
    assert 0.3 < changed.float().mean() < 0.7  # the casts that rounded away from zero
    assert (down.abs() <= healthy.abs()).all() and (down[changed].abs() < (x * scale)[changed].abs()).all()
    assert (cast("rounding", 0.1) != healthy).float().mean() < changed.float().mean() / 5
    errors = [((cast("mantissa", k) if k else healthy) - x * scale).abs().mean() for k in range(4)]
    assert errors == sorted(errors) and errors[3] > 4 * errors[0]  # each bit dropped: coarser
    clipped = cast("saturation", 0.5)
    assert clipped.abs().max() <= 0.5 * torch.finfo(torch.float8_e4m3fn).max
    assert torch.equal(clipped[healthy.abs() < 200], healthy[healthy.abs() < 200])


@pytest.mark.multiprocess
def test_under_pipeline_parallelism_the_steps_come_from_the_last_stage(tmp_path):
    """2 gloo ranks, pipeline parallel degree 2: rank 0 (the first stage) logs a loss of -1.0, the
    last stage the real one; validate records the last stage's, once per step."""
    from titan_primus.integrations.torchtitan.common import debug_data
    from titan_primus.integrations.torchtitan.v0_3.trainer import LAUNCHER
    from titan_primus.diagnostics.validate import run as command
    from titan_primus.integrations.torchtitan.common.trainer import RunSpec

    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.update(RunSpec(metrics=str(metrics), cpu_launcher=str(LAUNCHER)).env())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(command.LAUNCH_SCRIPT), "--module", "llama3", "--config", "llama3_debugmodel"]
    cmd += ["--hf_assets_path", str(debug_data.TOKENIZER), "--dataloader.dataset_path", str(debug_data.CORPUS)]
    cmd += ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
    cmd += ["--metrics.log_freq", "1", "--checkpoint.no-enable", "--validator.no-enable"]
    cmd += ["--dump_folder", str(tmp_path / "dump"), "--parallelism.pipeline_parallel_degree", "2"]
    cmd += ["--training.disable_cuda_graphs"]  # TorchTitan 0.3 refuses PP with its CUDA-graph default
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    logged = re.findall(r"step:\s*(\d+)\s+loss:\s*(-?[0-9.]+)", re.sub(r"\x1b\[[0-9;]*m", "", log))
    assert {float(loss) for _, loss in logged} >= {-1.0}, logged  # the first stage's placeholder
    real = {int(step): float(loss) for step, loss in logged if float(loss) != -1.0}
    recorded = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recorded if "step" in r]
    assert [s["step"] for s in steps] == [1, 2], recorded
    assert all(abs(s["loss"] - real[s["step"]]) < 1e-4 for s in steps), (steps, real)


@shares_the_quick_run
def test_the_readme_upgrade_command_takes_its_configs_from_the_baseline(quick):
    """`titan-primus validate --baseline last-good.json` on a GPU (no --config): the baseline's
    configs and settings, each overridable on the command line."""
    from titan_primus.diagnostics.validate.run import plans
    from titan_primus.integrations.torchtitan.v0_3.trainer import Line03

    _, _, _, doc, _ = quick
    args = build_parser().parse_args(["validate", "--baseline", "last-good.json"])
    (plan,) = plans(args, on_gpu=True, line=Line03(), baseline=doc)
    before = doc["results"][0]
    assert (plan.module, plan.config, plan.steps, plan.seq_len, plan.batch) == (
        before["module"],
        before["config"],
        before["steps"],
        before["seq_len"],
        before["batch"],
    )
    assert plan.fp8_config == "llama3_debugmodel_fp8" and plan.overrides == before["overrides"]
    args = build_parser().parse_args(["validate", "--baseline", "last-good.json", "--steps", "7"])
    assert plans(args, on_gpu=True, line=Line03(), baseline=doc)[0].steps == 7
    with pytest.raises(ValueError, match="--baseline an earlier validate JSON"):
        plans(build_parser().parse_args(["validate"]), on_gpu=True, line=Line03())
