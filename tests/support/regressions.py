"""A TEST PLUGIN that injects the regressions an upgrade could bring into the emulated backend, to
measure what ``titan-primus validate`` catches (tests/integrations/torchtitan/v0_3/test_validate.py, docs/validate.md's power
table made by docs/validate_power_measure.py). Loaded through titan-primus's plugin entry
points like any installed plugin (:func:`write_entry_point`); it registers no backend of its
own: on import it changes the emulation in place, so the routing (backend, definition) stays
what a healthy run reports and only the numerics move, as with a broken kernel.

``TITAN_PRIMUS_REGRESSION=KIND:SIZE`` (unset: the plugin does nothing):

- ``rounding:P``: a fraction P of the elements of every FP8 cast rounds toward zero (one code
  down where round-to-nearest went up): a biased rounding mode;
- ``mantissa:K``: every FP8 cast keeps K fewer mantissa bits (rounded to nearest): a coarser
  FP8 format;
- ``saturation:C``: every FP8 cast saturates at C times the format's largest value (C < 1):
  outliers clipped;
- ``grad_rows:P``: a fraction P of the rows of every GEMM's output gradient is dropped (zero):
  tokens whose gradient never arrives;
- ``wgrad_scale:F``: every FP8 layer's weight gradient is multiplied by F: a scale mismatch;
- ``fallen:WHAT``: FP8 falls away: ``all`` (the emulation is unavailable, every layer stays in
  high precision) or ``up`` (linears with more outputs than inputs are refused: the MLP's up
  projections and the output head stay in high precision).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import titan_primus.fp8.scaling as scaling
from titan_primus.backends.base import Verdict
from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.hookspec import hookimpl

ENV = "TITAN_PRIMUS_REGRESSION"
KINDS = ("rounding", "mantissa", "saturation", "grad_rows", "wgrad_scale", "fallen")


def _every(n: int, p: float, device) -> torch.Tensor:
    """A fixed mask of a fraction ``p`` of ``n`` positions, spread evenly (no random state used)."""
    idx = torch.arange(n, device=device, dtype=torch.float64)
    return torch.floor((idx + 1) * p) > torch.floor(idx * p)


def _magnitude_codes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign bit, magnitude code) of FP8 values: every FP8 format here is sign-magnitude, so the
    magnitude code orders the values."""
    code = q.view(torch.uint8).to(torch.int16)
    return code & 0x80, code & 0x7F


def _from_codes(sign, magnitude, fp8_dtype) -> torch.Tensor:
    return (sign | magnitude).to(torch.uint8).view(fp8_dtype)


def regressed_cast(kind: str, size: float, healthy):
    """``scaling.scaled_cast`` with the regression ``kind`` of ``size``."""
    max_code = None

    def cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        nonlocal max_code
        if kind == "saturation":
            limit = size * torch.finfo(fp8_dtype).max
            return healthy(x.to(torch.float32).clamp(-limit / scale, limit / scale), scale, fp8_dtype)
        q = healthy(x, scale, fp8_dtype)
        sign, magnitude = _magnitude_codes(q)
        if max_code is None:
            max_code = int(_magnitude_codes(torch.tensor([torch.finfo(fp8_dtype).max]).to(fp8_dtype))[1])
        if kind == "rounding":
            up = q.to(torch.float32).abs() > (x.to(torch.float32) * scale).abs()
            chosen = _every(q.numel(), size, q.device).view(q.shape) & up & (magnitude > 0)
            magnitude = torch.where(chosen, magnitude - 1, magnitude)
        elif kind == "mantissa":
            bits = int(size)  # round to nearest, ties to even, on the codes
            low, half = magnitude & ((1 << bits) - 1), 1 << (bits - 1)
            base = magnitude - low
            up = (low > half) | ((low == half) & (((base >> bits) & 1) == 1))
            magnitude = (base + up.to(base.dtype) * (1 << bits)).clamp(max=(max_code >> bits) << bits)
        return _from_codes(sign, magnitude, fp8_dtype)

    return cast


class _GradientRegression(torch.autograd.Function):
    """Identity forward; backward drops a fraction of the gradient's rows or scales it."""

    @staticmethod
    def forward(ctx, t, kind, size):
        ctx.kind, ctx.size = kind, size
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if ctx.kind == "wgrad_scale":
            return grad * ctx.size, None, None
        rows = grad.reshape(-1, grad.shape[-1])
        kept = ~_every(rows.shape[0], ctx.size, grad.device)
        return (rows * kept.unsqueeze(1).to(grad.dtype)).view_as(grad), None, None


def _install(kind: str, size_text: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{ENV}={kind}:{size_text}: unknown kind; one of {', '.join(KINDS)}")
    if kind in ("rounding", "mantissa", "saturation"):
        scaling.scaled_cast = regressed_cast(kind, float(size_text), scaling.scaled_cast)
        return
    if kind == "fallen":
        if size_text == "all":
            EmulatedBackend.availability = lambda self, device: Verdict.no("injected: the emulation fails to import")
        else:
            supports = EmulatedBackend.supports

            def refuse_up_projections(self, op, recipe, device, k=None, n=None):
                if op == "linear" and k and n and n > k:
                    return Verdict.no(f"injected: linears with N > K ({n} > {k}) refused")
                return supports(self, op, recipe, device, k=k, n=n)

            EmulatedBackend.supports = refuse_up_projections
        return
    size = float(size_text)
    linear, grouped_mm = EmulatedBackend.linear, EmulatedBackend.grouped_mm

    def regressed_linear(self, x, weight, bias, recipe, shards=None):
        if kind == "wgrad_scale":
            return linear(self, x, _GradientRegression.apply(weight, kind, size), bias, recipe, shards)
        return _GradientRegression.apply(linear(self, x, weight, bias, recipe, shards), kind, size)

    def regressed_grouped_mm(self, A, B_t, offs, recipe):
        if kind == "wgrad_scale":
            return grouped_mm(self, A, _GradientRegression.apply(B_t, kind, size), offs, recipe)
        return _GradientRegression.apply(grouped_mm(self, A, B_t, offs, recipe), kind, size)

    EmulatedBackend.linear, EmulatedBackend.grouped_mm = regressed_linear, regressed_grouped_mm


if os.environ.get(ENV):
    _install(*os.environ[ENV].split(":", 1))


@hookimpl
def titan_primus_register_backends():
    return []


def write_entry_point(directory: Path) -> Path:
    """A distribution's metadata in ``directory`` (put it on PYTHONPATH, with this module's
    folder) declaring this module a titan-primus plugin, as a pip-installed plugin would."""
    dist_info = directory / "titan_primus_regressions-0.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: titan-primus-regressions\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text("[titan_primus]\nregressions = regressions\n")
    return directory
