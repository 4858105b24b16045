"""The numeric self-check at conversion: each op routed to a backend whose kernels come from an
upstream that can change its numbers under an unchanged signature (``Fp8Backend.checked_at_conversion``:
Primus-Turbo, TorchAO) runs once, forward and backward, on a tiny fixed input, and is judged
against the exact emulation of the same recipe definition, as the numerics sentinel judges a
training call (``sentinel.check``: the 40 dB same-definition floor, a row floor, finite values),
plus the output dtype. A kernel that disagrees stops conversion with the figures, before the first
step: a transposed scale layout or an fp32 output passes every signature check and only shows here.
Attention routed to such a backend is checked the same way (:func:`attention_self_check`): FP8
attention against the emulation of its definition at the bounds the tier measures, bf16 flash
attention against fp32 SDPA at the tier's bf16 floor.

Once per process per (backend, op, recipe, device): a second converter, or a second model, costs
nothing. The input is small (two scaling blocks per dimension: 64 to 256 rows and columns), so the check costs
milliseconds on a GPU and under a second per op under Triton's interpreter."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backends.base import Fp8Backend, Op
from .device import DeviceProfile
from .metrics import sqnr
from .numerics import reference_attention, run_attention
from .recipes import Fp8Recipe
from .registry import backends, get_backend
from .sentinel.check import GemmRecord, judge, recompute

if TYPE_CHECKING:
    from .attention import AttentionRoute

__all__ = ["FP8_ATTENTION_BOUNDS", "BF16_ATTENTION_FLOOR_DB", "Fp8SelfCheckError", "attention_self_check", "self_check"]

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
    host = _host(device)
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
        return _raised(f"{backend.name}'s {op} with {recipe.describe()} on {device.arch}", e, device, _fix(backend))
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
            f"Its kernels changed under an unchanged signature. {_fix(backend)}"
        )
    return check.figures()


# FP8 attention against its emulation, per tensor: (SQNR in dB at least, fraction of elements
# differing at most). The emulation sums exactly and rounds once where the kernel sums fp32 in its
# own order, so a rare rounding of P, dS or Delta flips and its row follows. Measured by the tier
# (tests/real_turbo/test_attention_fp8.py: 32 cases, head dims 32 to 192/128, L 128 and 192,
# causal and full, normal and heavy-tailed) at the 4 builds x 2 archs, 2026-12-05; the worst:
# out 80.9 dB with 1.8e-4 of its elements differing; dq 74.1 dB, dk 70.9 dB, 2.3e-3; dv 81.5 dB,
# 3.4e-4. Each bound about 3 dB and 2x past the worst measured.
FP8_ATTENTION_BOUNDS = {"out": (78.0, 4e-4), "dq": (68.0, 5e-3), "dk": (68.0, 5e-3), "dv": (78.0, 7e-4)}
# bf16 flash attention against fp32 SDPA of the same bf16 inputs: the tier measured 54.5 to 99 dB
# (tests/real_turbo/test_attention_route.py, AITER's kernels stood in); a wrong length, LSE or
# saved output falls below it.
BF16_ATTENTION_FLOOR_DB = 40.0
# One of the tier's cases: B 2, L 128 (two 64-blocks), 4 query heads over 2 kv heads, D 64, causal.
_ATTENTION_SHAPE = (2, 128, 4, 2, 64)


def attention_self_check(route: AttentionRoute, device: DeviceProfile) -> str:
    """Judge the kernels of an attention ``route`` (built for ``device``) on a tiny fixed input,
    forward and backward, once per process per (backend, FP8 or bf16, device); returns the figures
    (empty for a backend that is not checked) or raises :class:`Fp8SelfCheckError`."""
    if route.kernels is None or not get_backend(route.backend).checked_at_conversion:
        return ""
    key = (route.backend, "attention", route.fp8, device.arch)
    if key not in _PASSED:
        _PASSED[key] = _check_attention(route, device)
    return _PASSED[key]


def _attention_inputs(device: DeviceProfile) -> list[torch.Tensor]:
    B, L, Hq, Hkv, D = _ATTENTION_SHAPE
    host = _host(device)
    generator = torch.Generator().manual_seed(0)
    shapes = ((B, L, Hq, D), (B, L, Hkv, D), (B, L, Hkv, D), (B, L, Hq, D))
    return [torch.randn(*s, generator=generator).to(device=host, dtype=torch.bfloat16) for s in shapes]


def _check_attention(route: AttentionRoute, device: DeviceProfile) -> str:
    from .attention import AttentionRoute, attend  # attention.route imports the registry's users

    backend = get_backend(route.backend)
    q, k, v, grad_out = _attention_inputs(device)
    where = f"{route.backend}'s {'FP8' if route.fp8 else 'bf16'} attention on {device.arch}"
    try:
        actual = run_attention(lambda *t: attend(route, *t, scale=None, causal=True), q, k, v, grad_out)
    except Exception as e:
        return _raised(where, e, device, _fix(backend, "turn the attention options off"))
    names = ("out", "dq", "dk", "dv")
    problems = [
        f"{n} is {t.dtype}, the contract is torch.bfloat16" for n, t in zip(names, actual) if t.dtype != q.dtype
    ]
    figures = []
    if route.fp8:
        reference = next(b for b in backends().values() if b.reference)
        emulated = AttentionRoute("self-check", reference.name, True, "", reference.attention()(device, True))
        expected = run_attention(lambda *t: attend(emulated, *t, scale=None, causal=True), q, k, v, grad_out)
        against = f"the {reference.name} definition"
        for name, want, got in zip(names, expected, actual):
            floor, budget = FP8_ATTENTION_BOUNDS[name]
            db = sqnr(want, got)
            differing = int((want != got).sum())
            figures.append(f"{name} {db:.1f} dB, {differing} of {want.numel()} differ")
            if db < floor or differing > budget * want.numel():
                problems.append(
                    f"{name} SQNR {db:.1f} dB (floor {floor:g}), {differing} of {want.numel()} elements differ "
                    f"(at most {budget:g} of them)"
                )
    else:
        expected = reference_attention(q, k, v, grad_out, causal=True)
        against = "fp32 SDPA"
        for name, want, got in zip(names, expected, actual):
            db = sqnr(want, got)
            figures.append(f"{name} {db:.1f} dB")
            if db < BF16_ATTENTION_FLOOR_DB:
                problems.append(f"{name} SQNR {db:.1f} dB < {BF16_ATTENTION_FLOOR_DB:g} dB")
    if problems:
        raise Fp8SelfCheckError(
            f"{where} computes other numbers than it should: on a fixed {'x'.join(map(str, q.shape))} causal input "
            f"against {against}, {'; '.join(problems)}. Its kernels changed under an unchanged signature. "
            f"{_fix(backend, 'turn the attention options off')}"
        )
    return f"against {against}: {', '.join(figures)}"


def _host(device: DeviceProfile) -> torch.device:
    return torch.device("cuda" if device.detected and torch.cuda.is_available() else "cpu")


def _raised(where: str, error: Exception, device: DeviceProfile, fix: str) -> str:
    """A kernel raised on the tiny input: on the device it runs on, conversion stops. Under a named
    profile on another host (routing asked about hardware that is not here) its kernels may not
    run here at all; they are checked where they run."""
    if device.detected:
        raise Fp8SelfCheckError(
            f"{where} raised on a tiny input at conversion: {type(error).__name__}: {error}. {fix}"
        ) from error
    return f"not run on this host under the named profile {device.arch} ({type(error).__name__}: {error})"


def _fix(backend: Fp8Backend, instead: str = "name another backend") -> str:
    installed = backend.installed()
    return (
        f"Installed: {installed or 'see titan-primus doctor'}. Fix: install a version verified with this titan-primus "
        f"(docs/upgrades.md lists them), or {instead}"
    )
