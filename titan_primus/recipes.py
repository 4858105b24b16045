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
Primus-Turbo has no high-precision-wgrad recipe, so rowwise_with_gw_hp has no Primus-Turbo definition.

The block-scaled recipes (``mxfp8``: blocks of 32 along the contracted dimension with E8M0
power-of-two scales; ``blockwise``: DeepSeek-V3's 1x128 activation tiles and 128x128 weight
blocks with float32 scales) carry their block shapes per operand and their scale rule
(:class:`BlockScaleRule`); ``docs/recipes-blocked.md`` cites the upstream code for each row.
Primus-Turbo's block-scaled GEMMs are the same at every build from v0.3.1 to v0.4.1.dev26 for
``blockwise``; its ``mxfp8`` row is v0.4.0's (the first tag with grouped MX GEMMs; the build
v0.3.2.dev48 runs the same MX code).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from .device import DeviceProfile

__all__ = [
    "RECIPE_NAMES",
    "DEFINITIONS",
    "OperandCast",
    "GemmCasts",
    "Fp8Recipe",
    "BlockScaleRule",
    "make_recipe",
    "check_recipe_name",
    "with_fp8_dispatch",
    "with_token_groups_padded_to",
]

RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise")
DEFINITIONS = ("torchao", "primus_turbo")

Format = Literal["e4m3", "e5m2"]
Granularity = Literal["tensorwise", "rowwise", "block"]


@dataclass(frozen=True)
class OperandCast:
    """How one GEMM operand is cast. ``fmt=None`` keeps it in high precision.

    ``block`` (granularity "block" only): the scaling block as (rows, columns) of the operand
    laid out [non-contracted, contracted]: (1, 128) is a 1x128 tile along the contracted
    dimension, (128, 128) a square block, (1, 32) an MX block. Blocks start at index 0 of each
    dimension; where the contracted dimension is a grouped GEMM's token dimension (its wgrad),
    they start at each group's first row instead (groups are padded per segment upstream)."""

    fmt: Format | None
    granularity: Granularity = "tensorwise"
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class BlockScaleRule:
    """How a block-scaled cast turns a block's amax into its scale.

    ``"fp32"``: scale = fp8_max / max(amax, amax_eps), computed in float64 then stored as float32
    (``float64=True``, TorchAO) or computed in float32 (Primus-Turbo's Triton kernels); payload =
    saturate(x * scale); the GEMM multiplies by scale_inv = float32(1 / scale).
    ``"e8m0"``: a power-of-two scale 2**e, e in [-127, 128] (E8M0 biased byte e + 127); payload =
    saturate(x / 2**e). ``rounding`` picks e: ``"rceil"`` = ceil(log2(amax / fp8_max)) (TorchAO's
    ScaleCalculationMode.RCEIL, NVIDIA's cvt.rp.ue8m0), ``"even"`` = the exponent of amax rounded
    to fp8's mantissa width, minus fp8_max's exponent (OCP "even"; Primus-Turbo's
    compute_tile_scale, TorchAO's ScaleCalculationMode.EVEN)."""

    kind: Literal["fp32", "e8m0"]
    amax_eps: float = 0.0
    float64: bool = False
    rounding: Literal["rceil", "even"] | None = None


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
    """Dequantize by multiplying with the float32 reciprocal ``fl(1 / scale)``, as the kernels do
    (Primus-Turbo's take ``scale_inv``; TorchAO hands torch._scaled_mm ``scale.reciprocal()``),
    instead of dividing by ``scale`` (TorchAO's ``emulate=True`` path). The two differ in the last
    bit only where scales are not powers of two."""
    block_scale: BlockScaleRule | None = None
    """The scale rule of the block-scaled casts (block recipes only)."""
    rank_local_expert_scales: bool = False
    """Under expert parallelism, the grouped-GEMM scales that span experts are taken over the
    rank's own experts and the tokens routed to them, as AMD Primus runs Primus-Turbo's grouped
    GEMM on the tokens each rank receives. Never coarser than one device's scales, but not
    bitwise one device's: Primus-Turbo's variable-K wgrad kernels take one scale vector per
    dimension for all groups, so per-expert scales cannot be passed to them."""
    fp8_dispatch: bool = False
    """Under expert parallelism the routed tokens cross the all-to-all as the FP8 payload and
    scales of the forward activation cast (titan_primus.token_dispatch), so the experts receive
    that FP8 copy, dequantized: their forward is unchanged (re-quantizing the copy reproduces it)
    and the weight gradient of w1/w3 casts the tokens from the copy along the token dimension,
    as DeepSeek-V3 does. Only where ``fp8_dispatch_refusal`` is None. What the tokens are sent in
    is ``titan_primus.token_dispatch.fp8_dispatch_cast`` of the recipe, which reads this field:
    the dispatchers take their cast from it, so the recipe says what they send."""
    token_groups_padded_to: int | None = None
    """The token dispatcher in front of the experts pads every group to a multiple of this many
    rows (the converters install TorchTitan's padding dispatcher where a backend's grouped GEMM
    needs aligned groups: ``Fp8Backend.group_alignment``), so the backend need not pad them
    again. None: groups of any size, empty ones included, which a backend that needs alignment
    pads itself (bitwise the same result)."""
    sixteen_bit_gemms: bool = False
    """Every FP8 GEMM writes bfloat16 or float16 only (Primus-Turbo: no backend of
    ``kernels/gemm/gemm_fp8_impl.py`` lists float32 output in its SUPPORTED_DTYPES), so a
    float32 linear gets a bfloat16 result upcast, and its backward quantizes the gradient of that
    result: the float32 gradient rounded to bfloat16."""

    def __post_init__(self):
        if self.fp8_dispatch and self.fp8_dispatch_refusal is not None:
            raise ValueError(
                f"titan-primus: no FP8 token dispatch for {self.name} ({self.definition} definition): "
                f"{self.fp8_dispatch_refusal}"
            )

    @property
    def block_scaled(self) -> bool:
        return self.block_scale is not None

    @property
    def grouped_scales_per_expert(self) -> bool:
        """Every scale of a grouped GEMM covers one expert's data only (rowwise casts, per-group
        wgrad), so expert parallelism, where a rank holds some experts and their tokens,
        computes the same scales as one device does."""
        if self.block_scaled:  # per-expert weight blocks, per-token tiles, per-group token blocks
            return True
        casts = [c for gemm in (self.output, self.grad_input, self.grad_weight) for c in (gemm.a, gemm.b)]
        if any(c.fmt is not None and c.granularity != "rowwise" for c in casts):
            return False
        return self.grouped_wgrad_per_group or all(c.fmt is None for c in (self.grad_weight.a, self.grad_weight.b))

    def _casts_spanning_experts(self) -> list[str]:
        """The grouped-GEMM casts whose scales cover more than one expert's data on one device:
        tensorwise ones, and rowwise wgrad ones taken over all groups' rows at once."""
        return [
            f"{gemm}.{operand}"
            for gemm, operands in _OPERANDS.items()
            for operand, cast in zip(operands, (getattr(self, gemm).a, getattr(self, gemm).b))
            if cast.granularity == "tensorwise"
            and cast.fmt is not None
            or (cast.granularity == "rowwise" and gemm == "grad_weight" and not self.grouped_wgrad_per_group)
        ]

    @property
    def expert_parallel_scales(self) -> str | None:
        """What this recipe's grouped-GEMM scales cover under expert parallelism, in words; None
        where expert parallelism is refused (scales that span experts, and no definition of them
        over a rank's experts)."""
        if self.grouped_scales_per_expert:
            return "every scale covers one expert's data, as on one device"
        if not self.rank_local_expert_scales:
            return None
        spanning = self._casts_spanning_experts()
        which = "all of them" if len(spanning) == 6 else ", ".join(spanning)
        return (
            f"scales spanning experts ({which}) are taken over the rank's own experts and the tokens routed "
            f"to them, as AMD Primus runs (on one device: over all experts)"
        )

    def expert_parallel_scope(self) -> str:
        """What the grouped-GEMM scales cover under expert parallelism, or why it is refused."""
        return self.expert_parallel_scales or "refused: its scales span all experts, with no definition over a rank's"

    @property
    def fp8_dispatch_refusal(self) -> str | None:
        """Why routed tokens cross the EP all-to-all in the activations' dtype for this recipe,
        or None where they may cross it in FP8 (``fp8_dispatch``)."""
        return _FP8_DISPATCH_REFUSALS.get((self.name, self.definition))

    def dtype(self, cast: OperandCast) -> torch.dtype:
        return self.e4m3 if cast.fmt == "e4m3" else self.e5m2

    def gemm_out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the kernels write a GEMM result in when the layer computes in ``dtype``."""
        return sixteen_bit(dtype) if self.sixteen_bit_gemms else dtype

    def describe(self) -> str:
        fmt = str(self.e4m3).removeprefix("torch.float8_")
        dispatch = ", FP8 token dispatch" if self.fp8_dispatch else ""
        return f"{self.name} ({self.definition} definition, {fmt}{dispatch})"


def sixteen_bit(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` where it is bfloat16 or float16, else bfloat16: what a GEMM that writes 16-bit
    results only writes for a layer computing in ``dtype``."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _gemms(
    fwd: tuple[OperandCast, OperandCast],
    dgrad: tuple[OperandCast, OperandCast],
    wgrad: tuple[OperandCast, OperandCast],
) -> tuple[GemmCasts, GemmCasts, GemmCasts]:
    return GemmCasts(*fwd), GemmCasts(*dgrad), GemmCasts(*wgrad)


# The operands (a, b) of each GEMM, as GemmCasts names them.
_OPERANDS = {
    "output": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("grad_output", "input"),
}
_T4 = OperandCast("e4m3", "tensorwise")
_T5 = OperandCast("e5m2", "tensorwise")
_R4 = OperandCast("e4m3", "rowwise")
_HP = HIGH_PRECISION
_TILE128 = OperandCast("e4m3", "block", (1, 128))
_BLOCK128 = OperandCast("e4m3", "block", (128, 128))
_MX = OperandCast("e4m3", "block", (1, 32))
_MX_2D = OperandCast("e4m3", "block", (32, 32))

_TORCHAO = {"pow2_scales": True}
_PRIMUS = {
    "pow2_scales": False,
    "grouped_wgrad_per_group": False,
    "backward_from_fp8": True,
    "reciprocal_scales": True,
    "sixteen_bit_gemms": True,
    "rank_local_expert_scales": True,
}

# (recipe, definition) -> (output, grad_input, grad_weight casts), options
_TABLE: dict[tuple[str, str], tuple[tuple[GemmCasts, GemmCasts, GemmCasts], dict]] = {
    # Its scales are not powers of two: dequantizing by the reciprocal, as torch._scaled_mm
    # applies them, makes the emulation bit-identical to TorchAO's real path.
    ("tensorwise", "torchao"): (
        _gemms((_T4, _T4), (_T5, _T4), (_T5, _T4)),
        {"pow2_scales": False, "reciprocal_scales": True},
    ),
    ("rowwise", "torchao"): (_gemms((_R4, _R4), (_R4, _R4), (_R4, _R4)), _TORCHAO),
    ("rowwise_with_gw_hp", "torchao"): (_gemms((_R4, _R4), (_R4, _T4), (_HP, _HP)), _TORCHAO),
    # Format.HYBRID: e4m3 for input and weight, e5m2 for grad_output.
    ("tensorwise", "primus_turbo"): (_gemms((_T4, _T4), (_T5, _T4), (_T5, _T4)), _PRIMUS),
    ("rowwise", "primus_turbo"): (_gemms((_R4, _R4), (_R4, _R4), (_R4, _R4)), _PRIMUS),
    # MXFP8TrainingOpConfig / MXFP8Linear defaults: e4m3fn everywhere (grads too), RCEIL.
    ("mxfp8", "torchao"): (
        _gemms((_MX, _MX), (_MX, _MX), (_MX, _MX)),
        {"pow2_scales": False, "block_scale": BlockScaleRule("e8m0", rounding="rceil")},
    ),
    # Float8BlockwiseLinear / _Float8BlockwiseGroupedMM: e4m3 everywhere, EPS 1e-12, float64.
    ("blockwise", "torchao"): (
        _gemms((_TILE128, _BLOCK128), (_TILE128, _BLOCK128), (_TILE128, _TILE128)),
        {"pow2_scales": False, "block_scale": BlockScaleRule("fp32", amax_eps=1e-12, float64=True)},
    ),
    # Float8QuantConfig(format=E4M3, granularity=MX_BLOCKWISE, scale_dtype=E8M0, block_size=32),
    # v0.4.0: weights in 32x32 blocks (ScalingRecipe(use_2d_block=True)), everything from the
    # high-precision tensors, "even" E8M0 rounding.
    ("mxfp8", "primus_turbo"): (
        _gemms((_MX, _MX_2D), (_MX, _MX_2D), (_MX, _MX)),
        {"pow2_scales": False, "block_scale": BlockScaleRule("e8m0", rounding="even"), "sixteen_bit_gemms": True},
    ),
    # Float8QuantConfig(format=E4M3, granularity=BLOCKWISE, block_size=128): Triton quantizers with
    # amax floored at 1e-4, float32 math; weights in 128x128 blocks, reused by dgrad.
    ("blockwise", "primus_turbo"): (
        _gemms((_TILE128, _BLOCK128), (_TILE128, _BLOCK128), (_TILE128, _TILE128)),
        {"pow2_scales": False, "block_scale": BlockScaleRule("fp32", amax_eps=1e-4), "sixteen_bit_gemms": True},
    ),
}
# Why a recipe's routed tokens stay in the activations' dtype across the EP all-to-all. The
# others send their forward activation cast: row-local, and its dequantized copy re-quantizes to
# the same values (power-of-two scales; Primus-Turbo's rowwise: the copy's row maximum is the
# row's bfloat16 amax, so its scale is the same), so the forward is unchanged, and the w1/w3
# wgrad cast from the copy is TorchAO's up to FP8-subnormal elements, Primus-Turbo's rowwise
# exactly (its backward already starts from the copy). docs/token-dispatch.md has the figures.
_NOT_ROW_LOCAL = "its activation scale spans every routed token, so it cannot be taken before the all-to-all"
_FP32_TILES = (
    "its tile scales are not powers of two: the w1/w3 weight gradient cast from the FP8 copy loses up to "
    "2.3 dB against fp32 (measured on 6 distributions)"
)
_FP8_DISPATCH_REFUSALS = {
    ("tensorwise", "torchao"): _NOT_ROW_LOCAL,
    ("tensorwise", "primus_turbo"): _NOT_ROW_LOCAL,
    ("rowwise_with_gw_hp", "torchao"): (
        "its weight gradient runs in high precision; from an FP8 copy of the tokens it would not"
    ),
    ("blockwise", "torchao"): _FP32_TILES,
    ("blockwise", "primus_turbo"): _FP32_TILES,
    ("mxfp8", "primus_turbo"): (
        "its E8M0 'even' rounding saturates: the w1/w3 weight gradient cast from the FP8 copy loses up to "
        "0.12 dB against fp32 (measured on 6 distributions), and its MX kernels do not run here to verify it"
    ),
}

# MX is defined on OCP e4m3fn (E8M0 rounding assumes fp8_max 448), on every device.
_OCP_ONLY = {"mxfp8"}


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
            f"wgrad recipe and no MX GEMMs before v0.4.0; use the torchao definition"
        )
    gemms, options = _TABLE[name, definition]
    formats = (torch.float8_e4m3fn, torch.float8_e5m2) if name in _OCP_ONLY else (device.e4m3, device.e5m2)
    return Fp8Recipe(name, definition, *gemms, e4m3=formats[0], e5m2=formats[1], **options)


def with_token_groups_padded_to(recipe: Fp8Recipe, alignment: int | None) -> Fp8Recipe:
    """``recipe`` for experts behind a dispatcher that pads each token group to ``alignment``
    rows (a backend's ``group_alignment``: the converters install such a dispatcher); None:
    ``recipe`` as it is."""
    return recipe if alignment is None else replace(recipe, token_groups_padded_to=alignment)


def with_fp8_dispatch(recipe: Fp8Recipe) -> Fp8Recipe:
    """``recipe`` with FP8 token dispatch (see ``Fp8Recipe.fp8_dispatch``); a ValueError naming
    the reason where the recipe does not qualify."""
    return replace(recipe, fp8_dispatch=True)
