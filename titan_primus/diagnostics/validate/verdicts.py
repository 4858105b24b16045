"""The arithmetic of ``titan-primus validate``'s verdicts: the gap between two curves, the noise
floors measured in the same invocation, grad-norm spikes, tokens/s and memory.

The gap between two curves (loss, or grad norm) is the gap between their windowed means: over
each window of ``window`` consecutive steps both have, ``|mean(a) - mean(b)| / |mean(b)|``. Per-step
noise of either run averages out inside a window before the two are compared, so what remains is
a difference in level: a run that learns slower, a gradient off in scale. The *final* gap is the
last window's, the *curve* gap the largest over all windows. The same statistic measures FP8
against bf16 and the floors (bf16 at another seed against bf16: the seed floor; FP8 with its
initial weights changed in the last bit against FP8: the last-bit floor), so each bound compares
like with like. A non-finite value makes its gap NaN, and NaN passes no bound.
"""

from __future__ import annotations

import math
import statistics

__all__ = [
    "Verdict",
    "curve_gaps",
    "identical",
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


def curve_gaps(a: list[dict], b: list[dict], window: int, key: str = "loss") -> dict:
    """``final`` and ``curve`` gap (fractions) of curve ``key`` of run ``a`` against run ``b``, the
    step where the curve gap peaks, and how many steps the two share."""
    va, vb = _by_step(a, key), _by_step(b, key)
    common = sorted(set(va) & set(vb))
    if not common:
        return {"final": math.nan, "curve": math.nan, "curve_step": None, "steps": 0}
    width = max(1, min(window, len(common)))
    gaps = []
    for end in range(width, len(common) + 1):
        steps = common[end - width : end]
        mean_a, mean_b = (sum(v[s] for s in steps) / width for v in (va, vb))
        gap = abs(mean_a - mean_b) / abs(mean_b) if mean_b else math.inf
        gaps.append(gap if math.isfinite(gap) else math.nan)  # an inf/NaN value: no bound holds
    nan = any(math.isnan(g) for g in gaps)
    worst = max(range(len(gaps)), key=lambda i: math.inf if math.isnan(gaps[i]) else gaps[i])
    return {
        "final": gaps[-1],
        "curve": math.nan if nan else gaps[worst],
        "curve_step": common[worst + width - 1],
        "steps": len(common),
    }


def identical(a: list[dict], b: list[dict]) -> bool:
    """Whether two runs logged bitwise the same losses and grad norms at the same steps."""
    return bool(a) and [(s["step"], s["loss"], s["grad_norm"]) for s in a] == [
        (s["step"], s["loss"], s["grad_norm"]) for s in b
    ]


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
