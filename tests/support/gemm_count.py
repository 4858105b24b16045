"""Count the FP8 GEMMs a training step runs: what actually executes, not what is dispatched.

Eager: a dispatch mode outside everything else. Activation checkpointing's own mode sees an op
first; an output it hands back from its cache never reaches this mode, so a GEMM is counted
when it runs. TorchAO multiplies its Float8TrainingTensors with ``aten.mm`` (its backward): an
``aten.mm`` with an FP8 operand counts as the FP8 GEMM it is.
Compiled: the profiler's events of the ops' names (aten ops; the emulated backend's ops record
one per execution). Primus-Turbo's are counted at its kernel dispatchers (tests/real_turbo).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_primus.backends.emulated.gemm_ops import CAST_OPS

__all__ = ["count_gemms", "count_gemms_and_casts"]

_FP8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}


def _fp8_operand(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(getattr(t, "_data", None), "dtype", None) in _FP8


class _Executions(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.calls = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops or (func is torch.ops.aten.mm.default and any(map(_fp8_operand, args))):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def count_gemms(fn, ops, compiled: bool = False):
    """(``fn()``, how many of ``ops`` it ran)."""
    if not compiled:
        with _Executions(ops) as mode:
            result = fn()
        return result, mode.calls
    names = {op._schema.name for op in ops}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = fn()
    return result, sum(event.name in names for event in profile.events())


class _GemmsAndCasts(_Executions):
    """Also counts the FP8 casts: ops that make an FP8 tensor from tensors none of which is FP8
    (views, transposes and copies of FP8 tensors are not casts), and the emulated backend's cast
    ops (``CAST_OPS``: the FP8 payload stays inside them)."""

    def __init__(self, ops):
        super().__init__(ops)
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in CAST_OPS:
            self.casts += 1
            return out
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.dtype in _FP8 for t in made) and not any(t.dtype in _FP8 or _fp8_operand(t) for t in inputs):
            self.casts += 1
        return out


def count_gemms_and_casts(fn, ops):
    """(``fn()``, how many of ``ops`` it ran, how many FP8 casts it ran), eager."""
    with _GemmsAndCasts(ops) as mode:
        result = fn()
    return result, mode.calls, mode.casts
