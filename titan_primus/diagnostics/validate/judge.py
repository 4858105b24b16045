"""The verdicts of one config's runs in ``titan-primus validate``, with and without a baseline.

Without a baseline: every run complete and finite; FP8 engaged (the layers converted on the
backend expected here, and FP8 changed the run); FP8's loss curve and grad-norm level within
``seed_factor`` times the seed floor's; no more grad-norm spikes than the seed floor has. With a
baseline (an earlier validate JSON of the same settings, checked before training by
baseline.py): every op on the baseline's backend and definition, no layer that the baseline ran
in FP8 back in high precision, each run's loss curve and grad-norm level within
``last_bit_factor`` times this invocation's last-bit floor of the baseline's, tokens/s and
memory within their tolerances.

A bound is a floor times a factor, and a floor that is zero or NaN (two runs that should differ
did not, or a run broke) is no bound at all: the verdict fails and says so.
"""

from __future__ import annotations

import math

from ... import registry
from .verdicts import Verdict, curve_gaps, finite_problems, grad_norm_spikes, identical, median_tps, peak_memory

__all__ = ["compare_with_baseline", "fp8_engaged", "judge"]

# The curves each floor and gap is measured on: (the verdict's word, the step record's key).
CURVES = (("loss curve", "loss"), ("grad-norm level", "grad_norm"))


def _pct(x: float | None) -> str:
    return "nan" if x is None or math.isnan(x) else f"{100 * x:.3g}%"


def _within(value: float, bound: float) -> bool:
    """``value <= bound`` for a usable bound: finite and above zero."""
    return math.isfinite(value) and math.isfinite(bound) and bound > 0 and value <= bound


def _degenerate(floor: float, what: str) -> str:
    if math.isnan(floor):
        return f"; the {what} is NaN: no bound"
    return f"; the {what} is zero (its two runs gave the same curve): no bound, nothing is judged" if floor <= 0 else ""


def _shown(fqns: list[str]) -> str:
    return ", ".join(fqns[:4]) + (f", ... ({len(fqns)} in all)" if len(fqns) > 4 else "")


def fp8_engaged(runs: dict, expected_backend: str | None, before: dict | None = None) -> Verdict:
    """Whether FP8 did what the routing says it should: every op on ``expected_backend`` (None:
    the device's preferred backend), no layer left in high precision for want of a backend,
    something converted, a curve that differs from bf16's; with ``before`` (the baseline's runs),
    every op on the baseline's backend and definition and every layer it ran in FP8 in FP8 still."""
    routing = runs["fp8"].get("routing_data")
    if routing is None:
        return Verdict(
            "fp8 engaged", False, None, None, "the FP8 run recorded no routing: titan-primus's converter never ran"
        )
    expected = expected_backend or routing["preferred_backend"]
    problems = []
    if expected is None:
        problems.append(f"no backend prefers {routing['device']}: this device has no FP8 to validate")
    for op, decision in routing["ops"].items():
        if expected and decision["backend"] != expected:
            why = dict(map(tuple, decision["passed_over"])).get(expected, decision["reason"])
            problems.append(f"{op} ran on {decision['backend']}, not {expected}: {why}")
    fell = [layer for layer in routing["layers"] if layer["kept"] == "no_backend"]
    if fell:
        problems.append(
            f"{len(fell)} layers stayed in high precision ({_shown([layer['fqn'] for layer in fell])}): {fell[0]['reason']}"
        )
    converted = [layer for layer in routing["layers"] if layer["backend"]]
    if not converted and not fell:
        problems.append("the converter converted no layer")
    if before is not None:
        then = before["fp8"]["routing_data"]
        for op, decision in then["ops"].items():
            now = routing["ops"].get(op)
            if now is None or (now["backend"], now["definition"]) != (decision["backend"], decision["definition"]):
                ran = f"{now['backend']} ({now['definition']})" if now else "no backend"
                problems.append(f"{op}: the baseline ran {decision['backend']} ({decision['definition']}), now {ran}")
        now_layers = {layer["fqn"]: layer for layer in routing["layers"]}
        lost = [x for x in then["layers"] if x["backend"] and not (now_layers.get(x["fqn"]) or {}).get("backend")]
        if lost:
            why = (now_layers.get(lost[0]["fqn"]) or {}).get("reason", "the model has no such layer now")
            problems.append(
                f"{len(lost)} layers the baseline ran in FP8 are in high precision now "
                f"({_shown([x['fqn'] for x in lost])}): {why}"
            )
        dispatch = routing.get("token_dispatch", {})
        undispatched = [
            f for f, d in then.get("token_dispatch", {}).items() if d["fp8"] and not dispatch.get(f, {}).get("fp8")
        ]
        if undispatched:
            why = dispatch.get(undispatched[0], {}).get("reason", "fp8_dispatch is off now")
            problems.append(
                f"{len(undispatched)} expert blocks whose tokens the baseline dispatched in FP8 dispatch in "
                f"high precision now ({_shown(undispatched)}): {why}"
            )
    problems += _attention_problems(routing, expected, before["fp8"]["routing_data"] if before is not None else None)
    if identical(runs["fp8"]["steps"], runs["bf16"]["steps"]):
        problems.append("FP8's losses and grad norms are bitwise bf16's: FP8 changed nothing")
    if problems:
        return Verdict("fp8 engaged", False, len(converted), None, "FP8 NOT ENGAGED: " + "; ".join(problems))
    kept: dict[str, int] = {}
    for layer in routing["layers"]:
        if not layer["backend"]:
            kept[layer["kept"]] = kept.get(layer["kept"], 0) + 1
    ops = ", ".join(f"{op} on {d['backend']} ({d['definition']})" for op, d in routing["ops"].items())
    text = f"{len(converted)} layers in FP8 on {routing['device']}: {ops}, the backend expected here ({expected})"
    if kept:
        text += "; kept in high precision: " + ", ".join(f"{n} by {why}" for why, n in kept.items())
    dispatched = [d for d in routing.get("token_dispatch", {}).values() if d["fp8"]]
    if routing.get("token_dispatch"):
        text += f"; {len(dispatched)} of {len(routing['token_dispatch'])} expert blocks dispatch their tokens in FP8"
    routed = [a for a in routing.get("attention", {}).values() if a["backend"]]
    if routing.get("attention"):
        text += f"; {len(routed)} of {len(routing['attention'])} attention layers on {_attention_backends(routed)}"
    if before is not None:
        text += "; the same backends, definitions and layers as the baseline"
    return Verdict("fp8 engaged", True, len(converted), None, text)


def _attention_backends(routed: list[dict]) -> str:
    names = sorted({f"{a['backend']} ({'FP8' if a['fp8'] else 'bf16'})" for a in routed})
    return ", ".join(names) or "titan-primus's backends"


def _has_bf16_attention(backend: str | None) -> bool:
    """Whether ``backend`` (the one the run expects) provides bf16 attention, which the
    ``attention`` option routes every decoder layer to (Primus-Turbo)."""
    found = registry.backends().get(backend) if backend else None
    kernels = found.attention() if found is not None else None
    return kernels is not None and kernels.bf16


def _attention_problems(routing: dict, expected: str | None, then: dict | None) -> list[str]:
    """With the attention options on: on Primus-Turbo's device, attention that stayed TorchTitan's
    for want of it; with a baseline, every layer it routed (and FP8 where it ran FP8) routed still."""
    attention, problems = routing.get("attention", {}), []
    if attention and _has_bf16_attention(expected) and not any(a["backend"] for a in attention.values()):
        problems.append(f"no attention layer runs on {expected}: {next(iter(attention.values()))['reason']}")
    if then is not None:
        lost = [
            fqn
            for fqn, a in then.get("attention", {}).items()
            if a["backend"]
            and (attention.get(fqn, {}).get("backend"), attention.get(fqn, {}).get("fp8")) != (a["backend"], a["fp8"])
        ]
        if lost:
            why = attention.get(lost[0], {}).get("reason", "the attention options are off now")
            problems.append(f"{len(lost)} attention layers no longer run as in the baseline ({_shown(lost)}): {why}")
    return problems


def judge(result: dict, settings: dict, expected_backend: str | None, before: dict | None = None) -> list[Verdict]:
    """The verdicts of one config's four runs (``result["runs"]``); fills ``result["floors"]`` and
    ``result["gaps"]``. ``before``: the baseline's runs of this config, for FP8 engaged."""
    runs, window, factor = result["runs"], settings["window"], settings["seed_factor"]
    verdicts = []
    problems = []
    for role, run in runs.items():
        if run["status"] != "ok":
            problems.append(f"{role}: {run['reason']}")
        elif result["steps"] and len(run["steps"]) < result["steps"]:
            problems.append(f"{role}: {len(run['steps'])} of {result['steps']} steps logged")
    verdicts.append(
        Verdict(
            "runs complete", not problems, None, None, "; ".join(problems) or f"all {len(runs)} runs logged every step"
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
    verdicts.append(fp8_engaged(runs, expected_backend, before))
    result["floors"] = {"seed": {}, "last_bit": {}}
    result["gaps"] = {"fp8_vs_bf16": {}}
    for word, key in CURVES:
        seed = curve_gaps(runs["seed_floor"]["steps"], runs["bf16"]["steps"], window, key)
        result["floors"]["seed"][key] = seed
        result["floors"]["last_bit"][key] = curve_gaps(
            runs["last_bit_floor"]["steps"], runs["fp8"]["steps"], window, key
        )
        gap = result["gaps"]["fp8_vs_bf16"][key] = curve_gaps(runs["fp8"]["steps"], runs["bf16"]["steps"], window, key)
        bound = factor * seed["curve"]
        verdicts.append(
            Verdict(
                f"fp8 {word} vs bf16",
                _within(gap["curve"], bound),
                gap["curve"],
                bound,
                f"FP8's {key} lies at most {_pct(gap['curve'])} from bf16's, windowed means over {window} steps "
                f"(worst window ending at step {gap['curve_step']}; last window {_pct(gap['final'])}); bound "
                f"{factor:g} x seed floor {_pct(seed['curve'])} = {_pct(bound)}"
                + _degenerate(seed["curve"], "seed floor"),
            )
        )
    verdicts.append(_spikes(runs, window, settings["spike_factor"]))
    return verdicts


def _spikes(runs: dict, window: int, spike_factor: float) -> Verdict:
    # Spikes bf16 lacks, judged against the seed floor: an equally good bf16 run at another seed
    # has spikes bf16 lacks too (deepseek_v3's debug model, 50 steps on a CPU: 5 of them).
    spikes = {
        role: grad_norm_spikes(runs[role]["steps"], window, spike_factor) for role in ("fp8", "bf16", "seed_floor")
    }

    def lacked_by_bf16(role: str) -> list[int]:
        return [s for s in spikes[role] if not any(abs(s - b) <= 2 for b in spikes["bf16"])]

    own, floor = lacked_by_bf16("fp8"), lacked_by_bf16("seed_floor")
    return Verdict(
        "no more grad-norm spikes bf16 lacks than the seed floor",
        len(own) <= len(floor),
        len(own),
        len(floor),
        f"grad-norm spikes (> {spike_factor:g} x the median of the {window} steps before) bf16 lacks "
        f"(within 2 steps): FP8 {own or 'none'}, the seed floor {floor or 'none'}; "
        f"FP8's spikes {spikes['fp8'] or 'none'}, bf16's {spikes['bf16'] or 'none'}",
    )


def compare_with_baseline(result: dict, before: dict, settings: dict) -> list[Verdict]:
    """The verdicts of this config's bf16 and FP8 runs against the baseline's (``before``)."""
    window, factor = settings["window"], settings["last_bit_factor"]
    tps_tol, mem_tol = settings["tps_tolerance"], settings["memory_tolerance"]
    verdicts = []
    for role in ("fp8", "bf16"):
        now_steps, before_steps = result["runs"][role]["steps"], before["runs"][role]["steps"]
        for word, key in CURVES:
            floor = float(result["floors"]["last_bit"][key]["curve"])
            gap = curve_gaps(now_steps, before_steps, window, key)
            bound = factor * floor
            verdicts.append(
                Verdict(
                    f"{role} {word} vs baseline",
                    _within(gap["curve"], bound),
                    gap["curve"],
                    bound,
                    f"{role}'s {key} lies at most {_pct(gap['curve'])} from the baseline's, windowed means "
                    f"(last window {_pct(gap['final'])}; {gap['steps']} steps compared); bound {factor:g} x "
                    f"last-bit floor {_pct(floor)} = {_pct(bound)}" + _degenerate(floor, "last-bit floor"),
                )
            )
        tps, tps_before = median_tps(now_steps), median_tps(before_steps)
        ratio = tps / tps_before if tps_before else math.nan
        verdicts.append(
            Verdict(
                f"{role} tokens/s vs baseline",
                math.isfinite(ratio) and ratio >= 1 - tps_tol,
                ratio,
                1 - tps_tol,
                f"{role}: {tps:,.0f} tokens/s (median) against the baseline's {tps_before:,.0f}: "
                f"{ratio:.3f}x; must be at least {1 - tps_tol:.3f}x",
            )
        )
        mem, mem_before = peak_memory(now_steps), peak_memory(before_steps)
        ratio = mem / mem_before if mem_before else math.nan
        verdicts.append(
            Verdict(
                f"{role} memory vs baseline",
                _within(ratio, 1 + mem_tol),
                ratio,
                1 + mem_tol,
                f"{role}: peak {mem / 2**30:.3f} GiB against the baseline's {mem_before / 2**30:.3f} GiB: "
                f"{ratio:.3f}x; must be at most {1 + mem_tol:.3f}x",
            )
        )
    return verdicts
