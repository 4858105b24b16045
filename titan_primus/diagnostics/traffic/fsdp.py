"""FSDP2 all-gather traffic per training step, with and without FP8 weight all-gather, computed
from model shapes (a model, not a measurement; docs/measurements.md has what was measured on gloo).

Model of a step under TorchTitan 0.3's FSDP2 layout on N ranks (no TP/EP/PP): every transformer
block and the token embeddings are all-gathered twice (forward, and again for backward:
``reshard_after_forward``), the final norm and output projection once (TorchTitan keeps them
unsharded after forward). Each rank receives (N-1)/N of every gathered tensor. bf16: 2 bytes
per element. FP8-gathered weights of linears and MoE experts (enable_fsdp_float8_all_gather):
1 byte per element, plus the scales their recipe's FP8 all-gather plan gathers as float32
(``Fp8AllGatherPlan.scale_shape``): one per output row (per expert) for rowwise, one per
128x128 block for blockwise; tensorwise scales travel as metadata (each rank computes the same
scale from the step's amax all-reduce). A weight whose FSDP2 shards cannot carry its scales
(``Fp8AllGatherPlan.shard_refusal``: blockwise shards of other than whole 128-row blocks) is
gathered in bf16, as in training. Which layers are converted follows the converter's defaults
(every linear and expert block, router gates kept in high precision); embeddings, norms and
router gates stay bf16. Expert weights are sharded where TorchTitan 0.3 shards them (by expert,
or on dim 1 beyond one rank per expert: ``fsdp_shards``).

Shapes: :mod:`titan_primus.diagnostics.model_shapes` (TorchTitan 0.3.0's Llama3-8B/70B/405B and
DeepSeek-V3-671B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from ...device import device_profile
from ...fsdp_fp8 import Fp8AllGatherPlan, fp8_all_gather_plan
from ...integrations.torchtitan.common.fsdp_shards import fsdp_shards
from ...registry import get_backend
from ..model_shapes import ARCHITECTURES, Architecture

__all__ = ["FP8_RECIPES", "Weight", "MODELS", "step_bytes", "traffic_rows"]

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
"""The recipes the model prices: rowwise as Primus-Turbo defines it (its FP8 all-gather carries
per-row scales; TorchAO's rowwise gathers bf16), blockwise in either definition (the same blocks)."""


@dataclass(frozen=True)
class Weight:
    shape: tuple[int, ...]
    """[N, K] of a linear, [E, N, K] of an MoE layer's expert weights."""
    count: int = 1
    """How many such tensors (e.g. per layer times layers)."""
    fp8: bool = False
    """An FP8 GEMM's weight (a converted linear's, or expert weights)."""
    gathers: int = 2

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count


def _weights(arch: Architecture) -> list[Weight]:
    weights = [Weight((arch.vocab, arch.dim))]  # token embeddings
    for block in arch.blocks:
        for g in block.gemms:
            shape = (arch.experts, g.n, g.k) if g.routed else (g.n, g.k)
            weights.append(Weight(shape, block.count, fp8=g.fp8))
        weights.append(Weight((1, block.norm_params), block.count))
    out = arch.output
    return weights + [
        Weight((1, arch.dim), gathers=1),
        Weight((out.n, out.k), fp8=True, gathers=1),
    ]  # final norm, output


MODELS = {name: _weights(arch) for name, arch in ARCHITECTURES.items()}


@cache
def _plan(recipe: str, op: str) -> Fp8AllGatherPlan:
    """The FP8 all-gather plan of ``recipe``'s weights, on the emulation of Primus-Turbo's
    definitions (the one that gathers all three recipes; the plan's rules do not depend on the
    backend that runs it)."""
    emulated = get_backend("emulated")
    plan, verdict = fp8_all_gather_plan(emulated, emulated.recipe_for(recipe, device_profile("gfx942")), op)
    assert plan is not None, verdict.reason
    return plan


def _gathered_bytes(w: Weight, ranks: int, fp8: str | None) -> int:
    """Bytes of one all-gather of ``w`` (every rank's shard), ``fp8`` its recipe or None (bf16)."""
    if not (fp8 and w.fp8):
        return 2 * w.numel
    experts = len(w.shape) == 3
    plan = _plan(fp8, "grouped_mm" if experts else "linear")
    shape, dim, world = fsdp_shards(w.shape, experts=experts, fsdp=ranks, dim1_without_ep=True)
    if plan.shard_refusal(shape, dim, world):
        return 2 * w.numel
    scales = 0 if plan.granularity == "tensorwise" else 4 * math.prod(plan.scale_shape(w.shape)) * w.count
    return w.numel + scales


def step_bytes(weights: list[Weight], ranks: int, fp8: str | None) -> float:
    """Bytes each rank receives from FSDP2 all-gathers in one step; ``fp8``: None (bf16) or one
    of :data:`FP8_RECIPES` for the FP8-gathered weights."""
    return sum(w.gathers * _gathered_bytes(w, ranks, fp8) for w in weights) * (ranks - 1) / ranks


def traffic_rows(ranks: int) -> list[dict]:
    rows = []
    for name, weights in MODELS.items():
        bf16 = step_bytes(weights, ranks, None)
        row = {"model": name, "ranks": ranks, "bf16_bytes": bf16}
        for fp8 in FP8_RECIPES:
            row[f"{fp8}_bytes"] = step_bytes(weights, ranks, fp8)
            row[f"{fp8}_ratio"] = row[f"{fp8}_bytes"] / bf16
        row["fp8_gathered_share"] = sum(w.numel for w in weights if w.fp8) / sum(w.numel for w in weights)
        rows.append(row)
    return rows
