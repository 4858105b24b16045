"""``titan-primus validate`` on TorchTitan 0.2.x: the same runs, verdicts and JSON as on 0.3, the
trainer launched with the job's TOML (``--job.config_file``) through titan_primus/integrations/torchtitan/v0_2/launch.py.
One quick run is shared by the module."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import corrupt_backend  # tests/ (conftest puts it on the path)
from support.once import once_per_session
from support.repo_root import ROOT

from titan_primus.diagnostics.results import load_document
from titan_primus.diagnostics.validate.run import judge_document

QUICK_STEPS = 20
TOML = "examples/torchtitan02/llama3_debug_fp8.toml"
DEEPSEEK_TOML = "examples/torchtitan02/deepseek_v3_debug_fp8.toml"
pytestmark = pytest.mark.trainer
# One worker runs the module's quick run and every test of it (tests/support/scheduling.py).
shares_the_quick_run = pytest.mark.xdist_group("validate_quick")


def _validate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # The CPU run, on a GPU machine too (ci/mi300x-image.sh runs this suite there): GPUs hidden.
    hidden = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **hidden, **(env or {})}
    cmd = [sys.executable, "-m", "titan_primus.cli", "validate", "--quick", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `validate --quick` run per session, shared by the xdist workers: (exit code, Markdown,
    JSON path, document)."""

    def run() -> dict:
        path = tmp_path_factory.mktemp("validate") / "validate-quick.json"
        proc = _validate("--json", str(path))
        assert path.exists(), proc.stdout + proc.stderr[-4000:]
        return {"code": proc.returncode, "markdown": proc.stdout, "path": str(path)}

    made = once_per_session("validate-quick", run)
    return made["code"], made["markdown"], Path(made["path"]), load_document(made["path"])


def _conclude(doc: dict, baseline: dict) -> dict:
    """The verdicts of the run's document judged again against ``baseline``."""
    return judge_document(copy.deepcopy(doc), baseline)


@shares_the_quick_run
def test_quick_run_passes_and_records_every_step(quick):
    code, markdown, _, doc = quick
    assert code == 0, markdown
    assert doc["summary"]["status"] == "pass" and doc["environment"]["versions"]["torchtitan"].startswith("0.2.")
    (result,) = doc["results"]
    assert result["config"] == result["fp8_config"] == TOML and result["module"] == "llama3"
    runs = result["runs"]
    assert set(runs) == {"bf16", "fp8", "seed_floor", "last_bit_floor"}
    for role, run in runs.items():
        assert [s["step"] for s in run["steps"]] == list(range(1, QUICK_STEPS + 1)), role
        assert all(s["tps"] > 0 and s["memory_bytes"] > 0 and s["grad_norm"] > 0 for s in run["steps"]), role
        assert "--job.config_file" in run["command"] and "torch.distributed.run" in run["command"], role
    # The TOML names titan-primus's converter: the bf16 runs train without it, the FP8 runs with it.
    assert runs["bf16"]["routing"] is None and runs["seed_floor"]["routing"] is None
    assert "titan-primus FP8 routing" in result["routing"] and "emulated" in result["routing"]
    assert runs["fp8"]["steps"][0]["loss"] != runs["bf16"]["steps"][0]["loss"]
    assert runs["last_bit_floor"]["last_bit_flipped"] > 0 and "last_bit_flipped" not in runs["fp8"]
    seed, last_bit = result["floors"]["seed"]["loss"], result["floors"]["last_bit"]["loss"]
    assert 0 < last_bit["curve"] < seed["curve"] / 5, result["floors"]
    assert result["runs"]["fp8"]["routing_data"]["ops"]["linear"]["backend"] == "emulated"


@shares_the_quick_run
def test_against_its_own_json_passes(quick):
    _, _, path, doc = quick
    judged = _conclude(doc, load_document(str(path)))
    assert judged["summary"]["status"] == "pass", judged["summary"]
    assert any(v["name"] == "fp8 loss curve vs baseline" for v in judged["results"][0]["verdicts"])


@shares_the_quick_run
def test_a_baseline_with_5_percent_lower_losses_fails_on_the_loss(quick):
    _, _, _, doc = quick
    lower = copy.deepcopy(doc)
    for run in lower["results"][0]["runs"].values():
        for step in run["steps"]:
            step["loss"] *= 0.95
    judged = _conclude(doc, lower)
    assert judged["summary"]["status"] == "fail"
    failed = judged["summary"]["failed_verdicts"]
    assert f"{TOML}: fp8 loss curve vs baseline" in failed and f"{TOML}: bf16 loss curve vs baseline" in failed, failed
    assert not any("tokens/s" in f or "memory" in f for f in failed), failed
    text = next(v["text"] for v in judged["results"][0]["verdicts"] if v["name"] == "fp8 loss curve vs baseline")
    assert "5.26%" in text and "last-bit floor" in text, text


def test_a_config_that_is_not_a_toml_file_is_one_line(capsys):
    from titan_primus import cli

    for argv, expected in (
        (["validate", "--config", "llama3_debugmodel"], "on TorchTitan 0.2.x, --config is the job's TOML file"),
        (["validate", "--module", "deepseek_v3", "--config", TOML], f"{TOML} trains model 'llama3'"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err


def test_the_cpu_defaults_ship_with_the_package_and_resolve_from_any_folder(tmp_path, monkeypatch):
    """Issue 41: the package reads no file of the clone. The debug TOMLs ship as package data; the
    names the defaults and docs use (examples/torchtitan02/, links in a clone) find them from any
    folder, and a job's own TOML there is taken first."""
    from titan_primus.integrations.torchtitan.v0_2.trainer import LINE, SHIPPED_CONFIGS

    monkeypatch.chdir(tmp_path)
    for model, config, _ in LINE.cpu_default:
        assert LINE.check_plan(None, config) == model
        assert LINE._toml(config) == SHIPPED_CONFIGS / Path(config).name
    own = tmp_path / "examples" / "torchtitan02" / "llama3_debug_fp8.toml"
    own.parent.mkdir(parents=True)
    own.write_text('[model]\nname = "deepseek_v3"\n')
    assert LINE.check_plan(None, "examples/torchtitan02/llama3_debug_fp8.toml") == "deepseek_v3"
    with pytest.raises(ValueError, match="does not exist here"):
        LINE.check_plan(None, "examples/torchtitan02/absent.toml")


def test_the_mi300x_job_validates_tomls_this_line_takes():
    """ci/mi300x-image.sh's validate steps (a GPU, no --quick): their arguments parse, their TOMLs
    are the 0.2.x job's, and the FP8 runs get the converter's options (the attention step's
    attention options too), the bf16 runs none of them."""
    import shlex

    from titan_primus.cli import build_parser
    from titan_primus.diagnostics.validate.run import plans
    from titan_primus.integrations.torchtitan.v0_2.trainer import Line02

    script = (ROOT / "ci" / "mi300x-image.sh").read_text().replace("\\\n", " ").splitlines()
    lines = [s for s in script if "ci/validate.sh" in s and not s.lstrip().startswith("#")]
    steps = {}
    for line in lines:
        name, *argv = shlex.split(line[line.index("ci/validate.sh") :])[1:]
        steps[name] = build_parser().parse_args(["validate", *argv])
    assert steps.keys() == {"mi300x", "mi300x-attention"}
    expected = {
        "mi300x": ("llama3", TOML, {}),
        "mi300x-attention": ("deepseek_v3", DEEPSEEK_TOML, {"attention": True, "fp8_attention": True}),
    }
    trainer = Line02()
    for name, args in steps.items():
        (plan,) = plans(args, on_gpu=True, line=trainer)
        module, toml, options = expected[name]
        assert (plan.module, plan.config, plan.steps, plan.seq_len, plan.fp8_options) == (
            module,
            toml,
            300,
            None,
            options,
        )
        fp8 = trainer.trainer_args(plan, True, 42, Path("dump"), on_gpu=True)
        bf16 = trainer.trainer_args(plan, False, 42, Path("dump"), on_gpu=True)
        assert fp8[fp8.index("--job.config_file") + 1] == str(ROOT / toml)
        assert "--titan_primus.recipe" in fp8 and "--titan_primus.recipe" not in bf16
        assert "--model.hf_assets_path" in fp8  # the debug model trains on the shipped tokenizer there too


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_a_stock_toml_gets_the_converter_in_the_fp8_runs_only(fp8, tmp_path, monkeypatch):
    """The job's TOML may name titan-primus or not: the FP8 runs train with its converter (the
    recipe validate was given), the bf16 runs without it; the TOML's other converters stay."""
    from torchtitan.config import ConfigManager

    from titan_primus.diagnostics.validate.run import ConfigPlan
    from titan_primus.integrations.torchtitan.common.trainer import RunSpec
    from titan_primus.integrations.torchtitan.v0_2.trainer import Line02

    text = (ROOT / TOML).read_text()
    start, end = text.index("\n[titan_primus]"), text.index("\n[optimizer]")
    text = text[:start] + text[end:]
    for line in [s for s in text.splitlines() if "titan_primus" in s]:
        text = text.replace(line, 'converters = ["another"]' if line.startswith("converters") else "")
    stock = tmp_path / "stock.toml"
    stock.write_text(text)
    assert "titan_primus" not in text
    line = Line02()
    plan = ConfigPlan("llama3", str(stock), 3, 128, 2, "tensorwise")
    plan.fp8_config = line.fp8_config(plan)
    from titan_primus.integrations.torchtitan.v0_2.converter import Float8Converter

    monkeypatch.setattr(ConfigManager, "parse_args", ConfigManager.parse_args)  # restored afterwards
    monkeypatch.setattr(Float8Converter, "__init__", Float8Converter.__init__)
    line.install_hooks(RunSpec(fp8=fp8), lambda entry: None, lambda model: 0)
    config = ConfigManager().parse_args(line.trainer_args(plan, fp8, 42, tmp_path / "dump", on_gpu=False))
    assert config.model.converters == (["another", "titan_primus.float8"] if fp8 else ["another"])
    assert config.titan_primus.recipe == ("tensorwise" if fp8 else "rowwise")
    assert config.training.steps == 3 and config.debug.seed == 42 and not config.checkpoint.enable


def test_a_corrupted_backend_fails_the_convergence_verdict(tmp_path):
    """The FP8 runs of the 0.2.x trainer go through the backend routing picks: one made wrong from
    step 3 on (tests/support/corrupt_backend.py) fails FP8's curve against bf16, over 10 steps (one window
    of the loss verdict, half the quick run's cost)."""
    corrupt_backend.write_entry_point(tmp_path)
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(corrupt_backend.__file__).parent), str(tmp_path)]),
        "TITAN_PRIMUS_BACKEND": "corrupted",
        corrupt_backend.ENV: "rows:3",
        "TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD": "",  # conftest turns plugins off; this one is the point
    }
    path = tmp_path / "corrupted.json"
    proc = _validate("--steps", "10", "--json", str(path), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    doc = load_document(str(path))
    assert "-> corrupted" in (doc["results"][0]["routing"] or ""), proc.stdout
    failed = doc["summary"]["failed_verdicts"]
    assert f"{TOML}: fp8 loss curve vs bf16" in failed and f"{TOML}: runs complete" not in failed, failed
