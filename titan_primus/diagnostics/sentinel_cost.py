"""The numerics sentinel's cost, for ``titan-primus bench``: per layer GEMM of each bench shape,
on the backend ``auto`` picks, one forward+backward plain, watched (what every step costs with
the sentinel on: the NaN/inf magnitudes, the taps, the step's one host sync) and checked (a
checked step: the layer captured, re-computed with the emulation and compared).

A model's cost follows: every step pays ``watched - plain`` per GEMM call of every converted
layer; a checked step pays ``checked - watched`` once, for the one layer checked (docs/sentinel.md).
"""

from __future__ import annotations

import torch

from .. import sentinel
from ..recipes import with_token_groups_padded_to
from ..routing import BackendUnavailableError, select_backend
from ..sentinel import SentinelOptions, WatchedBackend

__all__ = ["sentinel_cost"]

_NEVER = 10**9
"""An interval no step reaches: every-step checks only."""


def _forward(shape, impl, recipe):
    if shape.op == "linear":
        return lambda a, w, offs: impl.linear(a, w, None, recipe)
    recipe = with_token_groups_padded_to(recipe, impl.group_alignment(recipe))  # as the converters give it
    return lambda a, w, offs: impl.grouped_mm(a, w.transpose(-2, -1), offs, recipe)


def sentinel_cost(shapes, recipe: str, timing, profile, step_fn, time_ms) -> list[dict]:
    """One row per shape: ms plain, watched and checked; ``step_fn(shape, device, forward)`` and
    ``time_ms(step, warmup, iters, on_gpu)`` are the bench's own step builder and timer."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for shape in shapes:
        row = {
            "op": shape.op,
            "case": shape.name,
            "shape": shape.describe(),
            "recipe": recipe,
            "backend": None,
            "plain_ms": None,
            "watched_ms": None,
            "checked_ms": None,
            "status": "skipped",
            "reason": "",
        }
        rows.append(row)
        try:
            decision = select_backend(shape.op, recipe, profile, k=shape.k, n=shape.n)
        except BackendUnavailableError as e:
            row["reason"] = str(e)
            continue
        row["backend"] = decision.backend_name
        for key, interval in (("plain_ms", None), ("watched_ms", _NEVER), ("checked_ms", 1)):
            sentinel.reset()
            impl = decision.backend
            if interval is not None:
                active = sentinel.sentinel_for(SentinelOptions(interval, capture_folder=""))
                impl = WatchedBackend(active, active.register(shape.name, decision.backend))
            step = step_fn(shape, device, _forward(shape, impl, decision.recipe))

            def timed_step(step=step):
                step()
                if sentinel.active_sentinel():
                    sentinel.active_sentinel().finish_step()  # what the optimizer step pre-hook does

            row[key] = time_ms(timed_step, *timing, on_gpu=device.type == "cuda")
        sentinel.reset()
        row["status"] = "ok"
    return rows
