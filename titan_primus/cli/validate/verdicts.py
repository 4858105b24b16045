"""The arithmetic of ``titan-primus validate``'s verdicts: loss-curve gaps, the two noise floors
measured in the same invocation, grad-norm spikes, and the comparison with a baseline.

A gap between two loss curves is computed per step as ``|a - b| / |b|`` over the steps both
have, then averaged over a sliding window of ``window`` steps: the *final* gap is the mean over
the last window, the *curve* gap the largest mean over any window. The same statistic measures
FP8 against bf16 and the floors (bf16 at another seed against bf16: the seed floor; FP8 with its
initial weights changed in the last bit against FP8: the last-bit floor), so each bound compares
like with like. A non-finite loss makes its gap NaN, and NaN passes no bound.
"""

from __future__ import annotations

import math
import statistics

__all__ = [
    "Verdict",
    "curve_gaps",
    "finite_problems",
    "grad_norm_spikes",
    "median_tps",
    "peak_memory",
]


class Verdict(dict):
    """One named verdict: ``name``, ``status`` ("pass"/"fail"), ``value``, ``bound`` and the
    sentence that states both (``text``); a dict so that it goes into JSON as it is."""

    def __init__(self, name: str, ok: bool, value: float | None, bound: float | None, text: str):
        super().__init__(name=name, status="pass" if ok else "fail", value=value, bound=bound, text=text)

    @property
    def ok(self) -> bool:
        return self["status"] == "pass"


def _by_step(steps: list[dict], key: str) -> dict[int, float]:
    return {int(s["step"]): float(s[key]) for s in steps}


def curve_gaps(a: list[dict], b: list[dict], window: int) -> dict:
    """``final`` and ``curve`` gap of loss curve ``a`` against ``b`` (fractions), the step where
    the curve gap peaks, and how many steps the two share."""
    la, lb = _by_step(a, "loss"), _by_step(b, "loss")
    common = sorted(set(la) & set(lb))
    if not common:
        return {"final": math.nan, "curve": math.nan, "curve_step": None, "steps": 0}
    rel = [abs(la[s] - lb[s]) / abs(lb[s]) if lb[s] else math.inf for s in common]
    rel = [r if math.isfinite(r) else math.nan for r in rel]  # an inf/NaN loss: no bound holds
    width = max(1, min(window, len(rel)))
    means = [sum(rel[i - width : i]) / width for i in range(width, len(rel) + 1)]
    worst = max(range(len(means)), key=lambda i: means[i] if not math.isnan(means[i]) else math.inf)
    return {
        "final": means[-1],
        "curve": means[worst] if not any(math.isnan(m) for m in means) else math.nan,
        "curve_step": common[worst + width - 1],
        "steps": len(common),
    }


def finite_problems(steps: list[dict]) -> list[str]:
    """'loss nan at step 7'-style lines for every non-finite loss or grad norm."""
    return [
        f"{key} {s[key]} at step {s['step']}"
        for s in steps
        for key in ("loss", "grad_norm")
        if not math.isfinite(float(s[key]))
    ]


def grad_norm_spikes(steps: list[dict], window: int, factor: float) -> list[int]:
    """Steps whose grad norm exceeds ``factor`` times the median of the ``window`` steps before."""
    norms = [(int(s["step"]), float(s["grad_norm"])) for s in sorted(steps, key=lambda s: s["step"])]
    spikes = []
    for i in range(window, len(norms)):
        before = statistics.median(g for _, g in norms[i - window : i])
        if norms[i][1] > factor * before:
            spikes.append(norms[i][0])
    return spikes


def median_tps(steps: list[dict]) -> float:
    """Median tokens/s, leaving out the first tenth of the steps (at least two): they include
    warm-up (allocator, compilation, caches)."""
    skip = max(2, len(steps) // 10)
    kept = [float(s["tps"]) for s in steps[skip:]] or [float(s["tps"]) for s in steps]
    return statistics.median(kept) if kept else math.nan


def peak_memory(steps: list[dict]) -> int:
    return max((int(s["memory_bytes"]) for s in steps), default=0)
