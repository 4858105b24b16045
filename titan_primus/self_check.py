"""The numeric self-check at conversion: each op routed to a backend whose kernels come from an
upstream that can change its numbers under an unchanged signature (``Fp8Backend.checked_at_conversion``:
Primus-Turbo, TorchAO) runs once, forward and backward, on a tiny fixed input, and is judged
against the exact emulation of the same recipe definition, as the numerics sentinel judges a
training call (``sentinel.check``: the 40 dB same-definition floor, a row floor, finite values),
plus the output dtype. A kernel that disagrees stops conversion with the figures, before the first
step: a transposed scale layout or an fp32 output passes every signature check and only shows here.

Once per process per (backend, op, recipe, device): a second converter, or a second model, costs
nothing. The input is small (two scaling blocks per dimension: 64 to 256 rows and columns), so the check costs
milliseconds on a GPU and under a second per op under Triton's interpreter."""

from __future__ import annotations

import torch

from .backends.base import Fp8Backend, Op
from .device import DeviceProfile
from .recipes import Fp8Recipe
from .sentinel.check import GemmRecord, judge, recompute

__all__ = ["Fp8SelfCheckError", "self_check"]

_PASSED: dict[tuple, str] = {}
_SIZES = (64, 128, 256, 512)


class Fp8SelfCheckError(RuntimeError):
    """A routed kernel computed other numbers than its recipe definition: conversion stops."""


def self_check(backend: Fp8Backend, op: Op, recipe: Fp8Recipe, device: DeviceProfile) -> str:
    """Judge ``backend``'s ``op`` with ``recipe`` against the emulation on a tiny input; returns the
    figures (empty for a backend that is not checked) or raises :class:`Fp8SelfCheckError`."""
    if not backend.checked_at_conversion:
        return ""
    key = (backend.name, op, recipe.describe(), device.arch)
    if key not in _PASSED:
        _PASSED[key] = _check(backend, op, recipe, device)
    return _PASSED[key]


def _size(backend: Fp8Backend, op: Op, recipe: Fp8Recipe, device: DeviceProfile) -> int:
    """The smallest size the backend takes that spans two scaling blocks of every block-scaled cast
    along each dimension, so that a scale read in the wrong layout (transposed, per column for per
    row) changes the result."""
    casts = [cast for gemm in (recipe.output, recipe.grad_input, recipe.grad_weight) for cast in (gemm.a, gemm.b)]
    blocks = [max(cast.block) for cast in casts if cast.block]
    least = 2 * max(blocks, default=32)
    for size in _SIZES:
        if size >= least and backend.supports(op, recipe.name, device, k=size, n=size):
            return size
    return max(least, _SIZES[-1])


def _record(backend: Fp8Backend, op: Op, recipe: Fp8Recipe, device: DeviceProfile) -> GemmRecord:
    size = _size(backend, op, recipe, device)
    host = torch.device("cuda" if device.detected and torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)

    def normal(*shape):
        # An explicit device: a converter may run under a meta-device context (a model built on meta).
        return torch.randn(*shape, generator=generator, device="cpu").to(device=host, dtype=torch.bfloat16)

    if op == "linear":
        operands = (normal(size, size), normal(size, size), None)
        grad_output = normal(size, size)
    else:  # two experts of one group of ``size`` rows each
        offs = torch.tensor([size, 2 * size], dtype=torch.int32, device=host)
        operands = (normal(2 * size, size), normal(2, size, size), offs)
        grad_output = normal(2 * size, size)
    return GemmRecord(
        layer="self-check",
        gemm=1,
        op=op,
        backend=backend.name,
        bit_exact=False,
        recipe=recipe,
        operands=operands,
        needs_grad=(True, True),
        tensors={"grad_output": grad_output},
    )


def _check(backend: Fp8Backend, op: Op, recipe: Fp8Recipe, device: DeviceProfile) -> str:
    record = _record(backend, op, recipe, device)
    try:
        actual = recompute(record, backend)
    except Exception as e:
        where = f"{backend.name}'s {op} with {recipe.describe()} on {device.arch}"
        if device.detected:
            raise Fp8SelfCheckError(f"{where} raised on a tiny input at conversion: {type(e).__name__}: {e}") from e
        # A named profile on another host (routing asked about hardware that is not here): its
        # kernels may not run here at all; they are checked where they run.
        return f"not run on this host under the named profile {device.arch} ({type(e).__name__}: {e})"
    problems = [
        f"{name} is {tensor.dtype}, the contract is {record.operands[0].dtype}"
        for name, tensor in actual.items()
        if tensor is not None and tensor.dtype != record.operands[0].dtype
    ]
    check = judge(record, recompute(record), actual, bit_exact=False)
    problems += check.problems
    if problems:
        shape = "x".join(str(d) for d in record.operands[1].shape)
        raise Fp8SelfCheckError(
            f"the {backend.name} backend's {op} with {recipe.describe()} on {device.arch} computes other numbers than "
            f"its definition: on a fixed {shape} input against the exact emulation, {'; '.join(problems)}. "
            f"Its kernels changed under an unchanged signature (installed versions: titan-primus "
            f"doctor). Fix: install a verified version (docs/upgrades.md), or name another backend"
        )
    return check.figures()
