"""``titan-primus validate``: the upgrade gate. Does FP8 training still converge like bf16, at
the speed and memory it had?

For each config it runs TorchTitan's real trainer (torchrun; on a CPU through
examples/cpu_launch.py, the debug models on the shipped corpus) four times on the same data:

- ``bf16``: the stock config, no converter, at ``--seed``;
- ``fp8``: the same config with the titan-primus converter (``--module titan_primus --config
  NAME_fp8[_RECIPE]``), same seed;
- ``seed_floor``: bf16 at ``--floor-seed``: how far two equally good bf16 runs lie apart;
- ``last_bit_floor``: the FP8 run with the lowest bit of every initial weight flipped: how far a
  numerically trivial change moves the same run.

Verdicts (verdicts.py): every loss and grad norm finite, every run complete; FP8's loss
over the last window and its whole curve within ``--seed-factor`` times the seed floor of bf16's;
no more grad-norm spikes bf16 lacks than the seed floor has. With ``--baseline`` (an earlier validate JSON): each run's
loss curve within ``--last-bit-factor`` times the last-bit floor of the baseline's, tokens/s not
lower and memory not higher than the tolerances, and a table of what changed in the stack and
the settings (a baseline of another config is compared on what both have, the differences listed).
Exit 1 when a verdict fails.
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

from .lines import TrainerLine, trainer_line
from .verdicts import Verdict, curve_gaps, finite_problems, grad_norm_spikes, median_tps, peak_memory

__all__ = ["ConfigPlan", "ROLES", "command", "compare_with_baseline", "conclude", "judge", "plans"]

ROLES = ("bf16", "fp8", "seed_floor", "last_bit_floor")
REPO = Path(__file__).resolve().parents[3]
LAUNCH_SCRIPT = Path(__file__).resolve().with_name("launch.py")

# CPU defaults (the configs and steps are the line's: lines.py).
CPU_SEQ_LEN, CPU_QUICK_SEQ_LEN, CPU_BATCH = 256, 128, 2


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
    fp8_config: str = ""


def plans(args, on_gpu: bool, line: TrainerLine) -> list[ConfigPlan]:
    overrides = list(args.overrides or [])
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    if args.config:
        defaults = [(line.check_plan(args.module, args.config), args.config, None)]
    elif on_gpu:
        raise ValueError(f"on a GPU, name the config to validate: {line.config_example} (see docs/validate.md)")
    else:
        defaults = line.cpu_quick if args.quick else line.cpu_default
    seq_len = args.seq_len or (None if on_gpu else CPU_QUICK_SEQ_LEN if args.quick else CPU_SEQ_LEN)
    batch = args.batch or (None if on_gpu else CPU_BATCH)
    configs = [
        ConfigPlan(module, config, args.steps or steps, seq_len, batch, args.recipe, overrides)
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
            run["routing"] = entry["routing"]
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
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TITAN_PRIMUS_VALIDATE_METRICS": str(metrics)}
    env.update(line.run_env(_fp8(role)))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if role == "last_bit_floor":
        env["TITAN_PRIMUS_VALIDATE_LAST_BIT"] = "1"
    if not on_gpu:
        env["TITAN_PRIMUS_VALIDATE_CPU_LAUNCHER"] = str(line.cpu_launcher)
    module, config = line.run_names(plan, _fp8(role))
    run = {"module": module, "config": config, "seed": seed}
    settings = " ".join(f"{k}={v}" for k, v in line.run_env(_fp8(role)).items())  # part of the command
    command = f"{settings} {shlex.join(cmd)}" if settings else shlex.join(cmd)
    run.update(last_bit=role == "last_bit_floor", command=command, steps=[], routing=None, status="ok")
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


# --- verdicts --------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "nan" if x is None or math.isnan(x) else f"{100 * x:.2f}%"


def _within(value: float, bound: float) -> bool:
    return not math.isnan(value) and not math.isnan(bound) and value <= bound


def judge(result: dict, window: int, seed_factor: float, spike_factor: float) -> list[Verdict]:
    """The verdicts of one config's four runs (result["runs"]); fills result["floors"] and
    result["gaps"]."""
    runs = result["runs"]
    verdicts = []
    problems = []
    for role, run in runs.items():
        if run["status"] != "ok":
            problems.append(f"{role}: {run['reason']}")
        elif result["steps"] and len(run["steps"]) < result["steps"]:
            problems.append(f"{role}: {len(run['steps'])} of {result['steps']} steps logged")
    verdicts.append(
        Verdict(
            "runs complete",
            not problems,
            None,
            None,
            "; ".join(problems) or f"all {len(runs)} runs logged every step",
        )
    )
    nonfinite = [f"{role}: {p}" for role, run in runs.items() for p in finite_problems(run["steps"])]
    verdicts.append(
        Verdict(
            "finite loss and grad norm",
            not nonfinite,
            len(nonfinite),
            0,
            "; ".join(nonfinite[:6]) or "every loss and grad norm of every run is finite",
        )
    )
    seed = curve_gaps(runs["seed_floor"]["steps"], runs["bf16"]["steps"], window)
    last_bit = curve_gaps(runs["last_bit_floor"]["steps"], runs["fp8"]["steps"], window)
    fp8 = curve_gaps(runs["fp8"]["steps"], runs["bf16"]["steps"], window)
    result["floors"] = {"seed": seed, "last_bit": last_bit}
    result["gaps"] = {"fp8_vs_bf16": fp8}
    floor_note = "" if seed["final"] > 0 else " (a zero seed floor: the two seeds gave the same curve; pick another)"
    bound = seed_factor * seed["final"]
    verdicts.append(
        Verdict(
            "fp8 loss vs bf16, last window",
            _within(fp8["final"], bound),
            fp8["final"],
            bound,
            f"FP8's loss over the last {window} steps lies {_pct(fp8['final'])} from bf16's (mean per-step gap); "
            f"bound {seed_factor:g} x seed floor {_pct(seed['final'])} = {_pct(bound)}{floor_note}",
        )
    )
    bound = seed_factor * seed["curve"]
    verdicts.append(
        Verdict(
            "fp8 loss curve vs bf16",
            _within(fp8["curve"], bound),
            fp8["curve"],
            bound,
            f"FP8's curve is at most {_pct(fp8['curve'])} from bf16's over any {window} steps "
            f"(worst window ending at step {fp8['curve_step']}); bound {seed_factor:g} x seed floor "
            f"{_pct(seed['curve'])} = {_pct(bound)}",
        )
    )
    # Spikes bf16 lacks, judged against the seed floor: an equally good bf16 run at another seed
    # has spikes bf16 lacks too (deepseek_v3's debug model, 50 steps on a CPU: 5 of them).
    spikes = {
        role: grad_norm_spikes(runs[role]["steps"], window, spike_factor) for role in ("fp8", "bf16", "seed_floor")
    }

    def lacked_by_bf16(role: str) -> list[int]:
        return [s for s in spikes[role] if not any(abs(s - b) <= 2 for b in spikes["bf16"])]

    own, floor = lacked_by_bf16("fp8"), lacked_by_bf16("seed_floor")
    verdicts.append(
        Verdict(
            "no more grad-norm spikes bf16 lacks than the seed floor",
            len(own) <= len(floor),
            len(own),
            len(floor),
            f"grad-norm spikes (> {spike_factor:g} x the median of the {window} steps before) bf16 lacks "
            f"(within 2 steps): FP8 {own or 'none'}, the seed floor {floor or 'none'}; "
            f"FP8's spikes {spikes['fp8'] or 'none'}, bf16's {spikes['bf16'] or 'none'}",
        )
    )
    return verdicts


# --- the baseline ----------------------------------------------------------------------------

_PLAN_FIELDS = ("module", "config", "fp8_config", "steps", "seq_len", "batch", "recipe", "overrides")


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


def _settings_view(doc: dict, result: dict) -> dict:
    view = {k: result.get(k) for k in _PLAN_FIELDS}
    s = doc["settings"]
    view.update({k: s.get(k) for k in ("seed", "floor_seed", "nproc", "backend", "window")})
    return view


def _pair(results: list[dict], baseline: list[dict]) -> list[tuple[dict, dict | None]]:
    """Pair configs by name; a lone unmatched config on each side is paired anyway (its
    differences listed)."""
    by_name = {b["config"]: b for b in baseline}
    pairs = [(r, by_name.get(r["config"])) for r in results]
    lone_now = [r for r, b in pairs if b is None]
    lone_before = [b for b in baseline if b["config"] not in {r["config"] for r in results}]
    if len(lone_now) == 1 and len(lone_before) == 1:
        pairs = [(r, lone_before[0] if b is None else b) for r, b in pairs]
    return pairs


def compare_with_baseline(doc: dict, baseline: dict, path: str, last_bit_factor: float, tps_tol: float, mem_tol: float):
    """Add each config's baseline verdicts and the differences to ``doc``."""
    doc["baseline"] = {
        "path": path,
        "date": baseline["environment"].get("date"),
        "stack_differences": _differences(_stack(baseline), _stack(doc)),
        "unmatched_baseline_configs": [],
    }
    pairs = _pair(doc["results"], baseline["results"])
    matched = {id(b) for _, b in pairs if b is not None}
    doc["baseline"]["unmatched_baseline_configs"] = [b["config"] for b in baseline["results"] if id(b) not in matched]
    for result, before in pairs:
        if before is None:
            result["baseline"] = None
            result["verdicts"].append(
                Verdict(
                    "baseline has this config",
                    False,
                    None,
                    None,
                    f"{path} has no run of {result['config']} (it has "
                    f"{', '.join(b['config'] for b in baseline['results']) or 'none'})",
                )
            )
            continue
        floor = float(result["floors"]["last_bit"]["curve"])
        result["baseline"] = {
            "config": before["config"],
            "settings_differences": _differences(_settings_view(baseline, before), _settings_view(doc, result)),
            "runs": {role: {"steps": run["steps"]} for role, run in before["runs"].items() if role in ("bf16", "fp8")},
        }
        for role in ("fp8", "bf16"):
            now_steps, before_steps = result["runs"][role]["steps"], before["runs"][role]["steps"]
            gap = curve_gaps(now_steps, before_steps, doc["settings"]["window"])
            bound = last_bit_factor * floor
            result["verdicts"].append(
                Verdict(
                    f"{role} loss vs baseline",
                    _within(gap["curve"], bound),
                    gap["curve"],
                    bound,
                    f"{role}'s loss curve is at most {_pct(gap['curve'])} from the baseline's over any window "
                    f"(last window {_pct(gap['final'])}; {gap['steps']} steps compared); bound "
                    f"{last_bit_factor:g} x last-bit floor {_pct(floor)} = {_pct(bound)}",
                )
            )
            tps, tps_before = median_tps(now_steps), median_tps(before_steps)
            ratio = tps / tps_before if tps_before else math.nan
            result["verdicts"].append(
                Verdict(
                    f"{role} tokens/s vs baseline",
                    _within(1 - tps_tol, ratio),
                    ratio,
                    1 - tps_tol,
                    f"{role}: {tps:,.0f} tokens/s (median) against the baseline's {tps_before:,.0f}: "
                    f"{ratio:.3f}x; must be at least {1 - tps_tol:.3f}x",
                )
            )
            mem, mem_before = peak_memory(now_steps), peak_memory(before_steps)
            ratio = mem / mem_before if mem_before else math.nan
            result["verdicts"].append(
                Verdict(
                    f"{role} memory vs baseline",
                    _within(ratio, 1 + mem_tol),
                    ratio,
                    1 + mem_tol,
                    f"{role}: peak {mem / 2**30:.3f} GiB against the baseline's {mem_before / 2**30:.3f} GiB: "
                    f"{ratio:.3f}x; must be at most {1 + mem_tol:.3f}x",
                )
            )


def conclude(doc: dict, baseline: dict | None, baseline_path: str | None, last_bit_factor: float, tps_tol, mem_tol):
    """The baseline verdicts (if any) and the summary; returns the document as strict JSON."""
    if baseline is not None:
        compare_with_baseline(doc, baseline, baseline_path, last_bit_factor, tps_tol, mem_tol)
    failed = [f"{r['config']}: {v['name']}" for r in doc["results"] for v in r["verdicts"] if v["status"] != "pass"]
    doc["summary"] = {
        "verdicts": sum(len(r["verdicts"]) for r in doc["results"]),
        "failed": len(failed),
        "status": "fail" if failed else "pass",
        "failed_verdicts": failed,
    }
    return _finite_json(doc)


# --- the command -----------------------------------------------------------------------------


def _environment() -> dict:
    import torch

    from ...adapter_import import installed_version
    from ...backends.primus_turbo.release import describe_build
    from ...device import detect_device
    from ..doctor import environment

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


def command(args, argv: list[str], out) -> int:
    import torch

    from ..report import document, load_document, prepare_output, write_document
    from .report import plot_validate_png, render_validate_markdown

    line = trainer_line()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not line.cpu_launcher.exists():
        raise ValueError(
            f"no GPU here, and the CPU launcher {line.cpu_launcher} is missing: run from a clone of titan-primus"
        )
    config_plans = plans(args, on_gpu, line)
    baseline = load_document(args.baseline) if args.baseline else None
    if baseline is not None and baseline["kind"] != "validate":
        raise ValueError(f"--baseline {args.baseline}: a {baseline['kind']} file, not a validate JSON")
    if args.seed == args.floor_seed:
        raise ValueError("--floor-seed must differ from --seed: the seed floor is bf16 at another seed")
    prepare_output(args.json)
    prepare_output(args.png)
    nproc = args.nproc or (torch.cuda.device_count() if on_gpu else 1)
    settings = {
        "command": shlex.join(["titan-primus", *argv]),
        "quick": args.quick,
        "seed": args.seed,
        "floor_seed": args.floor_seed,
        "window": args.window,
        "nproc": nproc,
        "recipe": args.recipe,
        "backend": os.environ.get("TITAN_PRIMUS_BACKEND") or "auto",
        "seed_factor": args.seed_factor,
        "last_bit_factor": args.last_bit_factor,
        "spike_factor": args.spike_factor,
        "tps_tolerance": args.tps_tolerance,
        "memory_tolerance": args.memory_tolerance,
    }
    doc = document("validate", _environment(), settings, [], {})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titan-primus-validate-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for plan in config_plans:
            seeds = {"bf16": args.seed, "fp8": args.seed, "seed_floor": args.floor_seed, "last_bit_floor": args.seed}
            runs = {role: run_trainer(line, plan, role, seeds[role], nproc, work, on_gpu) for role in ROLES}
            result = {**asdict(plan), "fp8_config": plan.fp8_config, "runs": runs, "routing": runs["fp8"]["routing"]}
            result["verdicts"] = judge(result, args.window, args.seed_factor, args.spike_factor)
            doc["results"].append(result)
    doc = conclude(doc, baseline, args.baseline, args.last_bit_factor, args.tps_tolerance, args.memory_tolerance)
    doc["summary"]["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        write_document(args.json, doc)
    out.write(render_validate_markdown(doc, args.json or "validate"))
    if args.png:
        plot_validate_png([(args.json or "validate", doc)], args.png)
        out.write(f"\nPNG written to {args.png}\n")
    return 1 if doc["summary"]["failed"] else 0
