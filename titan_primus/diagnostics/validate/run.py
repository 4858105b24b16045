"""What ``titan-primus validate`` computes (the upgrade gate): Does FP8 training still converge like bf16, at
the speed and memory it had, and did FP8 engage at all?

For each config it runs TorchTitan's real trainer (torchrun; on a CPU through the CPU launcher
titan-primus ships, titan_primus/integrations/torchtitan, the debug models on the shipped corpus) four times
on the same data:

- ``bf16``: the stock config, no converter, at ``--seed``;
- ``fp8``: the same config with the titan-primus converter (``--module titan_primus --config
  NAME_fp8[_RECIPE]``), same seed, with the FP8-only options (backend, fp8_dispatch,
  filter_fqns);
- ``seed_floor``: bf16 at ``--floor-seed``: how far two equally good bf16 runs lie apart;
- ``last_bit_floor``: the FP8 run with the lowest bit of every initial weight flipped: how far a
  numerically trivial change moves the same run.

The verdicts are judge.py's; a baseline is checked before any training (baseline.py). With
``--baseline`` and no ``--config`` the baseline's own configs and settings run again, so the same
command works after every upgrade. Exit 1 when a verdict fails, 2 on bad usage.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..records import ValidateResult
from ..results import document, load_document
from .baseline import BaselineMismatch, check_baseline, mismatches, pair, refuse_mismatches
from .judge import compare_with_baseline, judge
from ...integrations.torchtitan import TrainerLine, trainer_line
from ...integrations.torchtitan.common.trainer import RunSpec

__all__ = [
    "ConfigPlan",
    "ROLES",
    "RefusedBeforeTraining",
    "conclude",
    "fp8_options",
    "judge_document",
    "plans",
    "run_trainer",
    "validate_document",
]

ROLES = ("bf16", "fp8", "seed_floor", "last_bit_floor")
LAUNCH_SCRIPT = Path(__file__).resolve().with_name("launch.py")

# CPU defaults (the configs and steps are the line's: lines.py).
CPU_SEQ_LEN, CPU_QUICK_SEQ_LEN, CPU_BATCH = 256, 128, 2
# The invocation's settings, when neither the command line nor a baseline gives them.
DEFAULTS = {"seed": 42, "floor_seed": 43, "window": 10, "recipe": "rowwise"}


@dataclass
class ConfigPlan:
    """One config's four runs (``config``: on 0.3 a config name, on 0.2.x the job's TOML)."""

    module: str
    config: str
    steps: int | None
    seq_len: int | None
    batch: int | None
    recipe: str
    overrides: list[str] = field(default_factory=list)
    fp8_options: dict = field(default_factory=dict)
    """Converter options of the FP8 runs only (ConversionOptions fields)."""
    fp8_config: str = ""


def fp8_options(args) -> dict:
    """The FP8-only converter options the command line names (the bf16 runs never get them)."""
    options = {}
    backend = args.backend or os.environ.get("TITAN_PRIMUS_BACKEND")
    if backend and backend != "auto":
        options["backend"] = backend
    for option in ("fp8_dispatch", "attention", "fp8_attention"):
        if getattr(args, option):
            options[option] = True
    if args.filter_fqns is not None:
        options["filter_fqns"] = [f for f in args.filter_fqns.split(",") if f]
    return options


def _setting(args, name: str, baseline: dict | None):
    """A setting: the command line's, else the baseline's, else the default."""
    value = getattr(args, name)
    if value is None and baseline is not None:
        value = baseline["settings"].get(name)
    return DEFAULTS[name] if value is None else value


def plans(args, on_gpu: bool, line: TrainerLine, baseline: dict | None = None) -> list[ConfigPlan]:
    overrides = list(args.overrides or [])
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    recipe = _setting(args, "recipe", baseline)
    if baseline is not None and not args.config and not args.quick:
        # The baseline's own configs and settings, what the command line does not change.
        configs = [
            ConfigPlan(
                b["module"],
                b["config"],
                args.steps or b["steps"],
                args.seq_len or b["seq_len"],
                args.batch or b["batch"],
                args.recipe or b["recipe"],
                overrides or list(b["overrides"]),
                fp8_options(args) or dict(b["fp8_options"]),
            )
            for b in baseline["results"]
        ]
    else:
        if args.config:
            defaults = [(line.check_plan(args.module, args.config), args.config, None)]
        elif on_gpu:
            raise ValueError(
                f"on a GPU, name the config to validate: {line.config_example}, or --baseline an earlier "
                "validate JSON to run its configs again (see docs/validate.md)"
            )
        else:
            defaults = line.cpu_quick if args.quick else line.cpu_default
        seq_len = args.seq_len or (None if on_gpu else CPU_QUICK_SEQ_LEN if args.quick else CPU_SEQ_LEN)
        batch = args.batch or (None if on_gpu else CPU_BATCH)
        configs = [
            ConfigPlan(module, config, args.steps or steps, seq_len, batch, recipe, overrides, fp8_options(args))
            for module, config, steps in defaults
        ]
    for plan in configs:
        plan.fp8_config = line.fp8_config(plan)
    return configs


# --- running the trainer --------------------------------------------------------------------


def _fp8(role: str) -> bool:
    return role in ("fp8", "last_bit_floor")


def _trainer_command(line, plan: ConfigPlan, role: str, seed: int, nproc: int, dump: Path, on_gpu: bool) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*cmd, str(LAUNCH_SCRIPT), *line.trainer_args(plan, _fp8(role), seed, dump, on_gpu), *plan.overrides]


def _read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], offset
    with path.open() as f:
        f.seek(offset)
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)


def _take(run: dict, metrics: Path, offset: int, bar) -> int:
    """Add what the trainer recorded since ``offset`` to ``run``; returns the new offset."""
    entries, offset = _read_new(metrics, offset)
    for entry in entries:
        if "step" in entry:
            run["steps"].append(entry)
            bar.update(1)
            bar.set_postfix(loss=f"{entry['loss']:.4f}")
        elif "routing" in entry:
            run["routing"], run["routing_data"] = entry["routing"], entry["routing_data"]
        elif "last_bit_flipped" in entry:
            run["last_bit_flipped"] = entry["last_bit_flipped"]
    return offset


def run_trainer(line, plan: ConfigPlan, role: str, seed: int, nproc: int, work: Path, on_gpu: bool) -> dict:
    """One trainer run; its per-step records, routing summary, command and wall time."""
    from tqdm import tqdm

    tag = f"{Path(plan.config).stem}-{role}"
    metrics, log_path = work / f"{tag}.metrics.jsonl", work / f"{tag}.log"
    metrics.unlink(missing_ok=True)
    cmd = _trainer_command(line, plan, role, seed, nproc, work / tag, on_gpu)
    spec = RunSpec(
        metrics=str(metrics),
        fp8=_fp8(role),
        fp8_options=plan.fp8_options if _fp8(role) else {},
        last_bit=role == "last_bit_floor",
        cpu_launcher=None if on_gpu else str(line.cpu_launcher),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env()}
    env.setdefault("OMP_NUM_THREADS", "1")
    module, config = line.run_names(plan, _fp8(role))
    run = {"module": module, "config": config, "seed": seed}
    # The spec is part of the command: the line printed runs the same trainer run.
    command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in spec.env().items()), shlex.join(cmd)])
    run.update(
        last_bit=role == "last_bit_floor", command=command, steps=[], routing=None, routing_data=None, status="ok"
    )
    start, offset = time.perf_counter(), 0
    bar = tqdm(total=plan.steps, desc=f"{plan.config} {role}", unit="step", file=sys.stderr, mininterval=1)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            offset = _take(run, metrics, offset, bar)
        code = proc.wait()
    _take(run, metrics, offset, bar)
    bar.close()
    run["wall_s"] = round(time.perf_counter() - start, 1)
    if code != 0:
        tail = log_path.read_text().splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        run.update(status="failed", reason=f"the trainer exited with {code} (its last lines are above; log {log_path})")
    elif not run["steps"]:
        run.update(status="failed", reason=f"the trainer logged no step metrics (log {log_path})")
    if role == "last_bit_floor" and not run.get("last_bit_flipped") and run["status"] == "ok":
        run.update(status="failed", reason="the last-bit perturbation did not run (the model was not initialised)")
    return run


# --- the document ---------------------------------------------------------------------------


def judge_document(doc: dict, baseline: dict | None = None) -> dict:
    """Every config's verdicts from its runs and ``doc["settings"]`` (against ``baseline``, an
    earlier validate document, where given), and the summary; returns the document as strict JSON.
    Verdicts already in ``doc`` are replaced, so a saved run can be judged again."""
    settings = doc["settings"]
    befores = [b for _, b in pair(doc["results"], baseline)] if baseline else [None] * len(doc["results"])
    for result, before in zip(doc["results"], befores):
        expected = (result.get("fp8_options") or {}).get("backend")
        result["verdicts"] = judge(result, settings, expected, before["runs"] if before else None)
        result.pop("baseline", None)
        if before is not None:
            result["verdicts"] += compare_with_baseline(result, before, settings)
            result["baseline"] = {
                "config": before["config"],
                "runs": {role: {"steps": before["runs"][role]["steps"]} for role in ("bf16", "fp8")},
            }
    return conclude(doc)


def conclude(doc: dict) -> dict:
    """The summary of every verdict; returns the document as strict JSON."""
    failed = [f"{r['config']}: {v['name']}" for r in doc["results"] for v in r["verdicts"] if v["status"] != "pass"]
    doc["summary"] = {
        "verdicts": sum(len(r["verdicts"]) for r in doc["results"]),
        "failed": len(failed),
        "status": "fail" if failed else "pass",
        "failed_verdicts": failed,
    }
    doc = _finite_json(doc)
    doc["results"] = [ValidateResult.from_fields(result).to_json() for result in doc["results"]]
    return doc


def _stack(doc: dict) -> dict:
    env = doc["environment"]
    stack = {f"version: {k}": v for k, v in env.get("versions", {}).items()}
    stack["device"] = env.get("device", {}).get("description")
    stack["device name"] = env.get("device_name")
    stack["gpus visible"] = env.get("gpus_visible")
    return stack


def _differences(before: dict, now: dict) -> list[dict]:
    return [
        {"field": k, "baseline": before.get(k), "now": now.get(k)}
        for k in dict.fromkeys([*before, *now])
        if before.get(k) != now.get(k)
    ]


def _environment() -> dict:
    import torch

    from ...integrations.torchtitan.common.imports import installed_version
    from ...backends.primus_turbo.release import describe_build
    from ...device import detect_device
    from ..environment import environment

    env = environment(detect_device())
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    else:
        env["device_name"] = _cpu_name()
    turbo = installed_version("primus-turbo")
    env["primus_turbo_build"] = describe_build(turbo) if turbo else None
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def _finite_json(value):
    """Non-finite floats as the strings "nan"/"inf"/"-inf", so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


def _named_backend_refusal(config_plans: list[ConfigPlan]) -> str | None:
    """Why the backend named for the FP8 runs (--backend, else TITAN_PRIMUS_BACKEND) cannot run
    their linears here, if it cannot: the converter would refuse it at conversion (a named
    backend never falls back), so nothing is trained to learn it."""
    from ...routing import BackendUnavailableError, select_backend

    for plan in config_plans:
        backend = plan.fp8_options.get("backend")
        if backend:
            try:
                select_backend("linear", plan.recipe, None, backend)
            except BackendUnavailableError as e:
                return (
                    f"{e}. The FP8 runs name {backend!r}, which never falls back to another backend: validate "
                    f"where it runs, or name another with --backend"
                )
    return None


class RefusedBeforeTraining(Exception):
    """Nothing was trained: the named backend cannot run here, or the baseline does not match
    (the message says which and the fix)."""


def validate_document(args, argv: list[str]) -> dict:
    """Run every planned config's four trainer runs and judge them: the "validate" results
    document (verdicts in ``summary``). ``args``: ``titan-primus validate``'s options."""
    import torch

    line = trainer_line()
    on_gpu = torch.cuda.is_available()
    baseline = load_document(args.baseline) if args.baseline else None
    if baseline is not None:
        check_baseline(baseline, args.baseline)
    config_plans = plans(args, on_gpu, line, baseline)
    seed, floor_seed = _setting(args, "seed", baseline), _setting(args, "floor_seed", baseline)
    if seed == floor_seed:
        raise ValueError("--floor-seed must differ from --seed: the seed floor is bf16 at another seed")
    refusal = _named_backend_refusal(config_plans)
    if refusal:
        raise RefusedBeforeTraining(refusal)
    nproc = args.nproc or (baseline["settings"]["nproc"] if baseline else None)
    nproc = nproc or (torch.cuda.device_count() if on_gpu else 1)
    settings = {
        "command": shlex.join(["titan-primus", *argv]),
        "quick": args.quick,
        "seed": seed,
        "floor_seed": floor_seed,
        "window": _setting(args, "window", baseline),
        "nproc": nproc,
        "recipe": config_plans[0].recipe,
        "backend": config_plans[0].fp8_options.get("backend", "auto"),
        "seed_factor": args.seed_factor,
        "last_bit_factor": args.last_bit_factor,
        "spike_factor": args.spike_factor,
        "tps_tolerance": args.tps_tolerance,
        "memory_tolerance": args.memory_tolerance,
        "allow_mismatch": sorted(args.allow_mismatch),
    }
    plan_dicts = [asdict(p) for p in config_plans]
    doc = document("validate", _environment(), settings, [], {})
    if baseline is not None:
        found = mismatches(plan_dicts, settings, baseline)
        try:
            refuse_mismatches(found, set(args.allow_mismatch), args.baseline)
        except BaselineMismatch as e:
            raise RefusedBeforeTraining(str(e)) from None
        doc["baseline"] = {
            "path": args.baseline,
            "date": baseline["environment"].get("date"),
            "stack_differences": _differences(_stack(baseline), _stack(doc)),
            "allowed_differences": found,
        }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titan-primus-validate-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for plan in config_plans:
            seeds = {"bf16": seed, "fp8": seed, "seed_floor": floor_seed, "last_bit_floor": seed}
            runs = {role: run_trainer(line, plan, role, seeds[role], nproc, work, on_gpu) for role in ROLES}
            doc["results"].append({**asdict(plan), "runs": runs, "routing": runs["fp8"]["routing"]})
    doc = judge_document(doc, baseline)
    doc["summary"]["wall_s"] = round(time.perf_counter() - started, 1)
    return doc
