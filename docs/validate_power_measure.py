"""How large a regression ``titan-primus validate`` catches: docs/validate.md's power table.

One healthy ``titan-primus validate`` of a model (its four runs and verdicts), then, for each
regression tests/support/regressions.py injects (the plugin, loaded through titan-primus's entry points)
and each size on a ladder from mild to severe, one more FP8 run with it. Each injected run is
judged as validate judges: without a baseline (against the healthy invocation's bf16 and seed
floor, which no injection touches), and with the healthy run as the baseline (bounded by the
healthy invocation's last-bit floor: the floor of an invocation with the regression would need
its own last-bit run, one more training per size). Prints, per regression and verdict, the
smallest size that fails it, and each healthy verdict's margin (value / bound).

    OMP_NUM_THREADS=1 python docs/validate_power_measure.py llama3 --json power-llama3.json
    OMP_NUM_THREADS=1 python docs/validate_power_measure.py deepseek_v3 --json power-moe.json  # EP 2, 2 ranks
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import regressions  # noqa: E402

from titan_primus.diagnostics.results import load_document  # noqa: E402
from titan_primus.diagnostics.validate.run import ConfigPlan, judge_document, run_trainer  # noqa: E402
from titan_primus.diagnostics.validate.judge import compare_with_baseline, fp8_engaged  # noqa: E402
from titan_primus.integrations.torchtitan import trainer_line  # noqa: E402

MODELS = {
    "llama3": ["--quick"],
    # CI's MoE validate (ci/cpu.sh): 2 gloo ranks, expert parallel degree 2, FP8 token dispatch.
    "deepseek_v3": (
        "--module deepseek_v3 --config deepseek_v3_debugmodel --steps 10 --seq-len 64 --nproc 2 --fp8-dispatch "
        "-- --parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs"
    ).split(),
}
# Mild to severe.
LADDERS = {
    "llama3": {
        "rounding": ["0.01", "0.03", "0.1", "0.3", "1.0"],
        "mantissa": ["1", "2", "3"],
        "saturation": ["0.9", "0.5", "0.25", "0.1"],
        "grad_rows": ["0.01", "0.03", "0.1", "0.3"],
        "wgrad_scale": ["0.99", "0.95", "0.9", "0.7", "0.5"],
        "fallen": ["up", "all"],
    },
    "deepseek_v3": {  # fewer sizes: each is a 2-rank run
        "rounding": ["0.3", "1.0"],
        "mantissa": ["1", "3"],
        "saturation": ["0.1"],
        "grad_rows": ["0.3"],
        "wgrad_scale": ["0.7", "0.5"],
        "fallen": ["all"],
    },
}
WITHOUT = ["fp8 engaged", "fp8 loss curve vs bf16", "fp8 grad-norm level vs bf16", "finite loss and grad norm"]
WITH = ["fp8 engaged", "fp8 loss curve vs baseline", "fp8 grad-norm level vs baseline"]


def _statuses(verdicts) -> dict:
    return {v["name"]: (v["status"], v["value"], v["bound"]) for v in verdicts}


def judge_injected(healthy: dict, fp8_run: dict) -> dict:
    """The verdicts of the healthy invocation with its FP8 run replaced by ``fp8_run``: without a
    baseline, and against the healthy run as the baseline (the healthy invocation's floors)."""
    injected = copy.deepcopy(healthy)
    result = injected["results"][0]
    result["runs"]["fp8"] = fp8_run
    without = _statuses(judge_document(injected)["results"][0]["verdicts"])
    before = healthy["results"][0]
    result["floors"] = before["floors"]
    expected = (result.get("fp8_options") or {}).get("backend")
    verdicts = [fp8_engaged(result["runs"], expected, before["runs"])]
    verdicts += compare_with_baseline(result, before, healthy["settings"])
    return {"without": without, "with": _statuses(verdicts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--json", required=True, help="write every figure here")
    parser.add_argument("--healthy", help="reuse this healthy validate JSON instead of running one")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="validate-power-"))
    healthy_path = args.healthy or str(work / "healthy.json")
    if not args.healthy:
        cmd = [sys.executable, "-m", "titan_primus.cli", "validate", *MODELS[args.model], "--json", healthy_path]
        subprocess.run(cmd, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    healthy = load_document(healthy_path)
    result, settings = healthy["results"][0], healthy["settings"]
    plan = ConfigPlan(**{k: result[k] for k in ConfigPlan.__dataclass_fields__})
    line = trainer_line()
    regressions.write_entry_point(work)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support"), str(work)])
    os.environ.pop("TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD", None)
    figures = {"healthy": healthy_path, "healthy_verdicts": _statuses(result["verdicts"]), "runs": {}}
    figures["healthy_with_baseline"] = judge_injected(healthy, result["runs"]["fp8"])["with"]
    for kind, sizes in LADDERS[args.model].items():
        for size in sizes:
            os.environ[regressions.ENV] = f"{kind}:{size}"
            run = run_trainer(line, plan, "fp8", settings["seed"], settings["nproc"], work, on_gpu=False)
            figures["runs"][f"{kind}:{size}"] = judge_injected(healthy, run)
            print(kind, size, {k: v[0] for d in figures["runs"][f"{kind}:{size}"].values() for k, v in d.items()})
            Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    print(render(figures, args.model))


def _caught(figures: dict, kind: str, sizes: list[str], side: str, verdict: str) -> str:
    tried = [s for s in sizes if f"{kind}:{s}" in figures["runs"]]
    for size in tried:
        if figures["runs"][f"{kind}:{size}"][side][verdict][0] == "fail":
            return size
    return f"not at {tried[-1]}" if tried else "not run"


def render(figures: dict, model: str) -> str:
    """The Markdown tables of docs/validate.md: smallest size caught, and the healthy margins."""
    out = [
        f"| {model}: regression (sizes tried) | "
        + " | ".join(WITHOUT)
        + " | "
        + " | ".join(f"baseline: {v}" for v in WITH)
        + " |"
    ]
    out.append("|" + "---|" * (1 + len(WITHOUT) + len(WITH)))
    for kind, sizes in LADDERS[model].items():
        cells = [_caught(figures, kind, sizes, "without", v) for v in WITHOUT]
        cells += [_caught(figures, kind, sizes, "with", v) for v in WITH]
        out.append(f"| {kind} ({', '.join(sizes)}) | " + " | ".join(cells) + " |")
    out += ["", "| healthy run: verdict | value | bound | margin (bound / value) |", "|---|---|---|---|"]
    healthy = {**figures["healthy_verdicts"], **figures["healthy_with_baseline"]}
    for name, (status, value, bound) in healthy.items():
        if isinstance(value, float) and isinstance(bound, float) and value and ("curve" in name or "level" in name):
            out.append(f"| {name} ({status}) | {value:.4g} | {bound:.4g} | {bound / value:.1f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
