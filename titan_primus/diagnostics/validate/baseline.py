"""A ``titan-primus validate`` baseline: checked whole before any training, and compared like
with like.

A baseline (an earlier validate JSON) that lacks a run, a step figure or a setting the verdicts
read is refused at once (exit 2), naming what is missing. Its settings (config, steps, sequence
length, batch, seeds, window, ranks, recipe, trainer arguments, FP8-only options) must equal this
invocation's, or validate fails before training, naming each field that differs, unless
``--allow-mismatch FIELD`` names it; the fields allowed to differ are listed in the report.
The backend and definition of each op are compared once the FP8 run has been routed (the FP8
engaged verdict, judge.py).
"""

from __future__ import annotations

__all__ = [
    "COMPARED_FIELDS",
    "BaselineMismatch",
    "check_baseline",
    "mismatches",
    "pair",
    "refuse_mismatches",
    "settings_view",
]

# Per config (ConfigPlan fields) and per invocation (settings): what must be equal.
PLAN_FIELDS = ("module", "config", "steps", "seq_len", "batch", "recipe", "overrides", "fp8_options")
INVOCATION_FIELDS = ("seed", "floor_seed", "window", "nproc")
COMPARED_FIELDS = PLAN_FIELDS + INVOCATION_FIELDS
_STEP_KEYS = ("step", "loss", "grad_norm", "tps", "memory_bytes")


class BaselineMismatch(ValueError):
    """The baseline was measured with other settings: a failed verdict before any training."""


def check_baseline(doc: dict, path: str) -> None:
    """Raise ValueError (exit 2) naming what ``doc`` lacks for the baseline verdicts."""
    if doc.get("kind") != "validate":
        raise ValueError(f"--baseline {path}: a {doc.get('kind')} file, not a validate JSON")
    missing = [f"settings.{k}" for k in INVOCATION_FIELDS if k not in doc.get("settings", {})]
    results = doc.get("results") or []
    if not results:
        missing.append("results (no config was run)")
    for i, result in enumerate(results):
        where = f"results[{i}] ({result.get('config', '?')})"
        missing += [f"{where}.{k}" for k in PLAN_FIELDS if k not in result]
        runs = result.get("runs", {})
        for role in ("bf16", "fp8"):
            run = runs.get(role)
            if run is None:
                missing.append(f"{where}: the {role} run")
                continue
            if not run.get("steps"):
                missing.append(f"{where}: the {role} run's steps")
                continue
            lacking = sorted({k for s in run["steps"] for k in _STEP_KEYS if k not in s})
            if lacking:
                missing.append(f"{where}: the {role} run's per-step {', '.join(lacking)}")
        if "fp8" in runs and not runs["fp8"].get("routing_data"):
            missing.append(f"{where}: the fp8 run's routing_data")
    if missing:
        raise ValueError(
            f"--baseline {path} lacks {'; '.join(missing[:8])}"
            + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            + ": it was not written by this titan-primus validate; run validate on the old stack again"
        )


def settings_view(plan: dict, settings: dict) -> dict:
    """What a run's like-with-like comparison reads: its config's plan and the invocation's."""
    return {**{k: plan.get(k) for k in PLAN_FIELDS}, **{k: settings.get(k) for k in INVOCATION_FIELDS}}


def pair(plans: list[dict], baseline: dict) -> list[tuple[dict, dict | None]]:
    """Each plan with the baseline's result of the same config; a lone unmatched config on each
    side is paired anyway (the config then differs, named by :func:`mismatches`)."""
    by_name = {b["config"]: b for b in baseline["results"]}
    pairs = [(p, by_name.get(p["config"])) for p in plans]
    lone_now = [p for p, b in pairs if b is None]
    lone_before = [b for b in baseline["results"] if b["config"] not in {p["config"] for p in plans}]
    if len(lone_now) == 1 and len(lone_before) == 1:
        pairs = [(p, lone_before[0] if b is None else b) for p, b in pairs]
    return pairs


def mismatches(plans: list[dict], settings: dict, baseline: dict) -> list[dict]:
    """Every compared field that differs from the baseline: field, config, baseline, now."""
    found = []
    for plan, before in pair(plans, baseline):
        if before is None:
            found.append({"field": "config", "config": plan["config"], "baseline": None, "now": plan["config"]})
            continue
        then, now = settings_view(before, baseline["settings"]), settings_view(plan, settings)
        found += [
            {"field": k, "config": plan["config"], "baseline": then[k], "now": now[k]}
            for k in COMPARED_FIELDS
            if then[k] != now[k]
        ]
    return found


def refuse_mismatches(found: list[dict], allowed: set[str], path: str) -> None:
    """Raise :class:`BaselineMismatch` naming every differing field not in ``allowed``."""
    refused = [m for m in found if m["field"] not in allowed]
    if refused:
        listed = "; ".join(f"{m['field']} (baseline {m['baseline']!r}, now {m['now']!r})" for m in refused)
        fields = " ".join(f"--allow-mismatch {f}" for f in dict.fromkeys(m["field"] for m in refused))
        raise BaselineMismatch(
            f"--baseline {path} was measured with other settings: {listed}. A baseline compares like with "
            f"like: rerun it with these settings, drop the options that differ (validate --baseline alone "
            f"reruns the baseline's own settings), or accept the difference with {fields}"
        )
