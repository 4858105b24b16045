"""Routing: which backend runs an op with a recipe on a device, and why.

Decided once per (op, recipe, device, request) and cached; the converter decides at conversion
time, so nothing is routed per call in the forward pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

from .backends.base import OPS, Fp8Backend, Op
from .device import DeviceProfile, resolve_device
from .recipes import Fp8Recipe, check_recipe_name
from .registry import backends, generation, get_backend

__all__ = ["BACKEND_ENV", "RoutingDecision", "BackendUnavailableError", "preferred_backend", "select_backend"]

BACKEND_ENV = "TITAN_PRIMUS_BACKEND"


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run the op here, or no backend can."""

    def __init__(self, message: str, passed_over: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.passed_over = passed_over
        """(backend, why not) of each backend tried, for a caller that lists them itself."""


@dataclass(frozen=True)
class RoutingDecision:
    op: Op
    backend: Fp8Backend
    recipe: Fp8Recipe
    device: DeviceProfile
    requested: str
    reason: str
    passed_over: tuple[tuple[str, str], ...]
    """(backend name, why it was not chosen) for every backend ranked above the chosen one."""

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def explain(self) -> str:
        lines = [f"{self.op} / {self.recipe.name} on {self.device.arch}: {self.backend.name} ({self.reason})"]
        lines += [f"  passed over {name}: {why}" for name, why in self.passed_over]
        return "\n".join(lines)


def _check(backend: Fp8Backend, op: Op, recipe: str, device: DeviceProfile, k, n) -> str | None:
    """None when ``backend`` can run the op here, else the reason it cannot."""
    available = backend.availability(device)
    if not available:
        return available.reason
    if recipe not in backend.recipes:
        return f"the {backend.name} backend does not implement recipe {recipe!r} (it implements {', '.join(backend.recipes)})"
    supported = backend.supports(op, recipe, device, k=k, n=n)
    return None if supported else supported.reason


def preferred_backend(device: DeviceProfile) -> Fp8Backend | None:
    """The backend ``backend="auto"`` prefers on ``device`` (the highest-ranked), whether or not it
    can run a given op there; None where every backend ranks itself 0 (no FP8 here)."""
    best = max(backends().values(), key=lambda b: b.rank(device), default=None)
    return best if best is not None and best.rank(device) > 0 else None


def select_backend(
    op: Op,
    recipe: str = "rowwise",
    device: DeviceProfile | str | None = None,
    requested: str = "auto",
    *,
    k: int | None = None,
    n: int | None = None,
) -> RoutingDecision:
    """Choose the backend for ``op`` ("linear" or "grouped_mm") with ``recipe`` on ``device``.

    ``requested="auto"`` (overridden for a whole run by ``TITAN_PRIMUS_BACKEND``) takes the
    highest-ranked backend that can run it: Primus-Turbo on MI300-class devices where it imports,
    else TorchAO where the device has FP8 hardware; the emulation on a CPU (on a GPU it runs only
    when requested, never in place of missing kernels); a backend whose path for the op has not run
    on its hardware yet (``Fp8Backend.chosen_automatically``) only when requested. A backend requested by
    name must be able to run it, or this raises :class:`BackendUnavailableError` with the reason.
    ``k``/``n`` (contracted and output dims) let backends refuse shapes their kernels cannot take.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
    check_recipe_name(recipe)
    if requested == "auto":
        requested = os.environ.get(BACKEND_ENV) or "auto"
    return _select(op, recipe, resolve_device(device), requested, k, n, generation())


@cache
def _select(
    op: Op, recipe: str, device: DeviceProfile, requested: str, k, n, registry_generation: int
) -> RoutingDecision:
    # ``registry_generation`` keys the cache: a refreshed registry makes every decision anew.
    if requested != "auto":
        backend = get_backend(requested)
        why_not = _check(backend, op, recipe, device, k, n)
        if why_not is not None:
            source = f" (from {BACKEND_ENV})" if os.environ.get(BACKEND_ENV) == requested else ""
            raise BackendUnavailableError(
                f"backend {requested!r}{source} cannot run {op} with recipe {recipe!r} on "
                f"{device.describe()}: {why_not}"
            )
        return RoutingDecision(
            op, backend, backend.recipe_for(recipe, device), device, requested, "requested by name", ()
        )

    ranked = sorted(backends().values(), key=lambda b: -b.rank(device))
    # Backends that rank themselves 0 here never win, but the user still learns why.
    not_here = tuple(
        (b.name, f"not chosen automatically on {device.arch}: {b.availability(device).reason}")
        for b in ranked
        if b.rank(device) <= 0
    )
    passed_over: list[tuple[str, str]] = []
    for backend in (b for b in ranked if b.rank(device) > 0):
        why_not = _check(backend, op, recipe, device, k, n)
        if why_not is None:
            automatic = backend.chosen_automatically(op, recipe, device)
            why_not = None if automatic else automatic.reason
        if why_not is None:
            reason = "highest-ranked backend that runs it here" if passed_over else "preferred backend here"
            return RoutingDecision(
                op,
                backend,
                backend.recipe_for(recipe, device),
                device,
                "auto",
                reason,
                tuple(passed_over) + not_here,
            )
        passed_over.append((backend.name, why_not))
    reasons = "; ".join(f"{name}: {why}" for name, why in (*passed_over, *not_here))
    raise BackendUnavailableError(
        f"no backend can run {op} with recipe {recipe!r} on {device.describe()}: {reasons}", (*passed_over, *not_here)
    )
