"""Which weights FSDP2 may all-gather in FP8 and stay exact (the rules the package docstring
states), the plan of one such weight, and its forward cast."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..backends.base import Op, Verdict
from ..recipes import Fp8Recipe
from ..fp8.blocks import quantize_matrices
from ..fp8.scaling import amax_to_scale, quantize, scaled_cast

__all__ = ["Fp8AllGatherPlan", "fp8_all_gather_plan", "quantize_weight"]


@dataclass(frozen=True)
class Fp8AllGatherPlan:
    """How one weight travels: its forward FP8 cast, and the backend that consumes it."""

    recipe: Fp8Recipe
    granularity: Literal["tensorwise", "rowwise", "block"]
    backend: object
    """The layer's backend; its ``gathered_weight(data, scale, dtype, recipe, source_dtype)``
    builds the unsharded parameter from the gathered payload."""
    quantize_dtype: torch.dtype | None = None
    """The dtype the layer casts its weight to before the GEMM (TorchTitan's GroupedExperts: bf16),
    which the weight is quantized from; None: FSDP2's param_dtype, the dtype the GEMM receives."""

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.recipe.dtype(self.recipe.output.b)

    @property
    def block(self) -> int | None:
        """The side of the square scaling blocks (granularity "block"), else None."""
        return self.recipe.output.b.block[0] if self.granularity == "block" else None

    def scale_rows(self, rows: int, weight_dims: int) -> int:
        """Rows of the scale tensor that covers ``rows`` rows (a linear's) or experts (an expert
        weight's, ``weight_dims`` 3) of the weight: a block-scaled linear has one per block of rows."""
        return -(-rows // self.block) if self.block and weight_dims == 2 else rows

    def shard_refusal(self, shape: tuple[int, ...], shard_dim: int, world: int) -> str | None:
        """Why the FP8 payload and scales of a weight of ``shape``, which FSDP2 shards on
        ``shard_dim`` over ``world`` ranks, cannot be gathered exactly, if they cannot: per-row
        scales are taken over K, so shards must hold whole rows; block scales need shards of
        whole blocks along the blocked dims (a linear's rows, an expert's N; experts are never
        split by a block). Uneven and empty dim-0 shards are padded alike, payload and scales."""
        if self.granularity == "tensorwise" or world == 1:
            return None
        scales = "per-row scales" if self.granularity == "rowwise" else f"{self.block}x{self.block} block scales"
        if shard_dim == len(shape) - 1:
            return f"FSDP2 shards it along K (dim {shard_dim}), over which its {scales} are taken"
        per_rank = -(-shape[shard_dim] // world)
        if self.block and shard_dim == len(shape) - 2 and per_rank % self.block:
            return (
                f"its {scales} need shards of whole {self.block}-row blocks, and FSDP2 shards its "
                f"{shape[shard_dim]} rows (dim {shard_dim}) in {per_rank} per rank (FSDP degree {world})"
            )
        return None

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor of a whole weight of ``shape`` ([N, K] or [E, N, K])."""
        if self.granularity == "tensorwise":
            return ()
        if self.granularity == "rowwise":
            return (*shape[:-1], 1)
        return (*shape[:-2], -(-shape[-2] // self.block), -(-shape[-1] // self.block))


def _weight_casts_exact(recipe: Fp8Recipe) -> Verdict:
    """Can one FP8 copy of the weight (its forward cast) serve every GEMM that reads the weight?
    output reads it cast ``output.b`` (contracted over K); grad_input reads it cast
    ``grad_input.b`` (contracted over N); grad_weight does not read it."""
    fwd, dgrad = recipe.output.b, recipe.grad_input.b
    if fwd.fmt is None:
        return Verdict.no("the recipe keeps the weight in high precision in the forward GEMM")
    if fwd.granularity == "block":
        # Blocks are laid out [non-contracted, contracted]: forward contracts the weight's K,
        # grad_input its N, so only square blocks are the same blocks in both GEMMs.
        if fwd != dgrad or fwd.block[0] != fwd.block[1]:
            return Verdict.no(
                f"{recipe.describe()}: grad_input casts the weight in other blocks ({dgrad.block[0]}x{dgrad.block[1]} "
                f"along N, the forward {fwd.block[0]}x{fwd.block[1]} along K), so an exact FP8 all-gather would "
                f"need a second FP8 copy (no traffic saved)"
            )
        side = fwd.block[0]
        return Verdict.yes(
            f"{side}x{side} weight blocks: grad_input reads the same blocks, transposed; FSDP2 shards of whole "
            f"{side}-row blocks gather FP8 + block scales (other shards in high precision, with a warning)"
        )
    if fwd.granularity == "tensorwise" and dgrad == fwd:
        return Verdict.yes("tensorwise: forward and grad_input GEMMs read the same FP8 weight")
    if fwd.granularity == "rowwise" and recipe.backward_from_fp8:
        return Verdict.yes(
            "rowwise per output row (FSDP2 shards rows); grad_input re-quantizes the dequantized "
            "forward copy, which the gathered payload reproduces"
        )
    if dgrad.fmt is None:
        why = "grad_input reads the high-precision weight"
    elif dgrad.granularity == "rowwise":
        why = "grad_input scales the weight per column over all output rows, which span ranks"
    else:
        why = "grad_input casts the high-precision weight with one tensorwise scale"
    return Verdict.no(
        f"{recipe.describe()}: {why}, so an exact FP8 all-gather would need a second FP8 copy (no traffic saved)"
    )


def fp8_all_gather_plan(backend, recipe: Fp8Recipe, op: Op = "linear") -> tuple[Fp8AllGatherPlan | None, Verdict]:
    """The plan for ``op``'s weights (a linear's, or an MoE expert block's w1/w2/w3) on
    ``backend`` running ``recipe``, or None with the reason they are all-gathered in high
    precision. The same casts decide both: a grouped GEMM's B_t is cast like a linear's weight,
    per (expert, output column) where a linear's is per output row."""
    exact = _weight_casts_exact(recipe)
    if not exact:
        return None, exact
    takes = backend.takes_gathered_fp8_weight(recipe, op)
    if not takes:
        return None, takes
    # TorchTitan's GroupedExperts (0.2.x and 0.3) hand their weights to the grouped GEMM as bf16.
    quantize_dtype = torch.bfloat16 if op == "grouped_mm" else None
    plan = Fp8AllGatherPlan(recipe, recipe.output.b.granularity, backend, quantize_dtype)
    return plan, Verdict.yes(f"{exact.reason}; {takes.reason}")


def quantize_weight(weight: torch.Tensor, plan: Fp8AllGatherPlan, amax: torch.Tensor | None):
    """(FP8 data, float32 scale) of ``weight`` [N, K] or [E, N, K] as the forward GEMM casts
    it; ``amax``: the whole weight's amax for tensorwise scales (rowwise scales are per row,
    over K, local; block scales per block, each block's scale_inv, local to whole blocks)."""
    if plan.granularity == "block":
        return quantize_matrices(weight, plan.fp8_dtype, plan.recipe.block_scale, (plan.block, plan.block))
    if plan.granularity == "rowwise":
        return quantize(weight, plan.fp8_dtype, -1, plan.recipe.pow2_scales)
    scale = amax_to_scale(amax.to(weight.dtype), plan.fp8_dtype, plan.recipe.pow2_scales)
    return scaled_cast(weight, scale, plan.fp8_dtype), scale
