"""FP8 training recipes as data: which operand of which GEMM is cast to which format, how.

A linear layer runs three GEMMs (output, grad_input, grad_weight); a grouped GEMM runs the same
three per group. Each GEMM has two operands, and a recipe says for each operand whether it is
cast to FP8 (e4m3 or e5m2) or kept in high precision, and whether its scale is one per tensor
("tensorwise") or one per slice along the GEMM's non-contracted dimension, reduced over the
contracted one ("rowwise"; for grouped GEMMs the reduction stays inside each group).

Two upstream projects define the named recipes differently, and both definitions live here so
the emulated backend can reproduce either exactly:

- ``"torchao"``: TorchAO 0.18 ``Float8LinearConfig.from_recipe_name`` (power-of-2 scales for the
  rowwise recipes, e5m2 grad_output for tensorwise, high-precision wgrad for rowwise_with_gw_hp)
  and ``_to_fp8_rowwise_then_scaled_grouped_mm`` for grouped GEMMs.
- ``"primus_turbo"``: Primus-Turbo >= v0.3.1 ``Float8QuantConfig`` (scale = fp8_max / amax, no
  rounding; tensorwise -> Format.HYBRID, rowwise -> Format.E4M3 with ScalingGranularity.ROWWISE).
  Its kernels apply scales by multiplying with ``scale_inv = fl(1 / scale)``, dequantization and
  GEMM epilogues alike (``csrc/pytorch/quantization/quantization.cpp``); the emulation does too.
  Rowwise backward re-quantizes input and weight from their dequantized forward FP8 copies, and a
  grouped GEMM's wgrad takes its column scales over all rows of all groups at once.
- ``"primus_turbo_v0.2"``: Primus-Turbo v0.2.0-v0.3.0, where those backward copies are quantized
  from the high-precision tensors instead.
Primus-Turbo has no high-precision-wgrad recipe, so rowwise_with_gw_hp has no Primus-Turbo definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .device import DeviceProfile

__all__ = [
    "RECIPE_NAMES",
    "DEFINITIONS",
    "OperandCast",
    "GemmCasts",
    "Fp8Recipe",
    "make_recipe",
    "check_recipe_name",
]

RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DEFINITIONS = ("torchao", "primus_turbo", "primus_turbo_v0.2")

Format = Literal["e4m3", "e5m2"]
Granularity = Literal["tensorwise", "rowwise"]


@dataclass(frozen=True)
class OperandCast:
    """How one GEMM operand is cast. ``fmt=None`` keeps it in high precision."""

    fmt: Format | None
    granularity: Granularity = "tensorwise"


HIGH_PRECISION = OperandCast(None)


@dataclass(frozen=True)
class GemmCasts:
    """Casts of one GEMM's operands: ``a`` is the left operand, ``b`` the right one.

    output:      a = input,       b = weight
    grad_input:  a = grad_output, b = weight
    grad_weight: a = grad_output, b = input
    """

    a: OperandCast
    b: OperandCast


@dataclass(frozen=True)
class Fp8Recipe:
    name: str
    definition: str
    output: GemmCasts
    grad_input: GemmCasts
    grad_weight: GemmCasts
    pow2_scales: bool
    e4m3: torch.dtype
    e5m2: torch.dtype
    backward_from_fp8: bool = False
    """Rowwise backward casts of input and weight start from the forward FP8 copy, dequantized to
    the tensor's dtype, instead of from the tensor itself (Primus-Turbo >= v0.3.1)."""
    grouped_wgrad_per_group: bool = True
    """A grouped GEMM's rowwise wgrad scales are taken per group (TorchAO), or over all rows of all
    groups at once (Primus-Turbo)."""
    reciprocal_scales: bool = False
    """Dequantize by multiplying with the float32 reciprocal ``fl(1 / scale)`` (Primus-Turbo's
    kernels take ``scale_inv``), instead of dividing by ``scale`` (TorchAO)."""

    @property
    def grouped_scales_per_expert(self) -> bool:
        """Every scale of a grouped GEMM covers one expert's data only (rowwise casts, per-group
        wgrad), so expert parallelism, where a rank holds some experts and their tokens,
        computes the same scales as one device does."""
        casts = [c for gemm in (self.output, self.grad_input, self.grad_weight) for c in (gemm.a, gemm.b)]
        if any(c.fmt is not None and c.granularity != "rowwise" for c in casts):
            return False
        return self.grouped_wgrad_per_group or all(c.fmt is None for c in (self.grad_weight.a, self.grad_weight.b))

    def dtype(self, cast: OperandCast) -> torch.dtype:
        return self.e4m3 if cast.fmt == "e4m3" else self.e5m2

    def describe(self) -> str:
        fmt = str(self.e4m3).removeprefix("torch.float8_")
        return f"{self.name} ({self.definition} definition, {fmt})"


def _gemms(
    fwd: tuple[OperandCast, OperandCast],
    dgrad: tuple[OperandCast, OperandCast],
    wgrad: tuple[OperandCast, OperandCast],
) -> tuple[GemmCasts, GemmCasts, GemmCasts]:
    return GemmCasts(*fwd), GemmCasts(*dgrad), GemmCasts(*wgrad)


_T4 = OperandCast("e4m3", "tensorwise")
_T5 = OperandCast("e5m2", "tensorwise")
_R4 = OperandCast("e4m3", "rowwise")
_HP = HIGH_PRECISION

_TORCHAO = {"pow2_scales": True}
_PRIMUS = {"pow2_scales": False, "grouped_wgrad_per_group": False, "backward_from_fp8": True, "reciprocal_scales": True}
_PRIMUS_V02 = {**_PRIMUS, "backward_from_fp8": False}

# (recipe, definition) -> (output, grad_input, grad_weight casts), options
_TABLE: dict[tuple[str, str], tuple[tuple[GemmCasts, GemmCasts, GemmCasts], dict]] = {
    ("tensorwise", "torchao"): (_gemms((_T4, _T4), (_T5, _T4), (_T5, _T4)), {"pow2_scales": False}),
    ("rowwise", "torchao"): (_gemms((_R4, _R4), (_R4, _R4), (_R4, _R4)), _TORCHAO),
    ("rowwise_with_gw_hp", "torchao"): (_gemms((_R4, _R4), (_R4, _T4), (_HP, _HP)), _TORCHAO),
    # Format.HYBRID: e4m3 for input and weight, e5m2 for grad_output.
    ("tensorwise", "primus_turbo"): (_gemms((_T4, _T4), (_T5, _T4), (_T5, _T4)), _PRIMUS),
    ("rowwise", "primus_turbo"): (_gemms((_R4, _R4), (_R4, _R4), (_R4, _R4)), _PRIMUS),
    ("tensorwise", "primus_turbo_v0.2"): (_gemms((_T4, _T4), (_T5, _T4), (_T5, _T4)), _PRIMUS_V02),
    ("rowwise", "primus_turbo_v0.2"): (_gemms((_R4, _R4), (_R4, _R4), (_R4, _R4)), _PRIMUS_V02),
}


def check_recipe_name(name: str) -> str:
    if name not in RECIPE_NAMES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {', '.join(RECIPE_NAMES)}")
    return name


def has_definition(name: str, definition: str) -> bool:
    return (name, definition) in _TABLE


def make_recipe(name: str, definition: str, device: DeviceProfile) -> Fp8Recipe:
    """The recipe ``name`` as ``definition`` defines it, in ``device``'s FP8 formats."""
    check_recipe_name(name)
    if definition not in DEFINITIONS:
        raise ValueError(f"unknown recipe definition {definition!r}; choose one of {', '.join(DEFINITIONS)}")
    if (name, definition) not in _TABLE:
        raise ValueError(
            f"recipe {name!r} has no {definition} definition: Primus-Turbo has no high-precision "
            f"wgrad recipe; use 'rowwise' on Primus-Turbo or the torchao definition"
        )
    gemms, options = _TABLE[name, definition]
    return Fp8Recipe(name, definition, *gemms, e4m3=device.e4m3, e5m2=device.e5m2, **options)
