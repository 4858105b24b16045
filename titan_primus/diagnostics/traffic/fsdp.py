"""FSDP2 all-gather traffic per training step, with and without FP8 weight all-gather, computed
from model shapes (a model, not a measurement; docs/measurements.md has what was measured on gloo).

Model of a step under TorchTitan 0.3's FSDP2 layout on N ranks (no TP/EP/PP): every transformer
block and the token embeddings are all-gathered twice (forward, and again for backward:
``reshard_after_forward``), the final norm and output projection once (TorchTitan keeps them
unsharded after forward). Each rank receives (N-1)/N of every gathered tensor. bf16: 2 bytes
per element. FP8-gathered weights of linears and MoE experts (enable_fsdp_float8_all_gather):
1 byte per element, plus 4 bytes per output row (per expert) for rowwise scales; tensorwise
scales travel as metadata (each rank computes the same scale from the step's amax all-reduce,
4 bytes per weight). Which layers are converted follows the converter's defaults (every linear
and expert block, router gates kept in high precision); embeddings, norms and router gates
stay bf16. Expert weights gather the same bytes whether TorchTitan shards them on dim 0 (an
FSDP degree at most the number of experts) or on dim 1 (beyond it). Block-scaled recipes are
not modelled (docs/parallelism.md has their measured ratios).

Shapes: :mod:`titan_primus.diagnostics.model_shapes` (TorchTitan 0.3.0's Llama3-8B/70B/405B and
DeepSeek-V3-671B).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model_shapes import ARCHITECTURES, Architecture

__all__ = ["Weight", "MODELS", "step_bytes", "traffic_rows"]


@dataclass(frozen=True)
class Weight:
    rows: int
    cols: int
    count: int = 1
    """How many such tensors (e.g. per layer times layers, or experts)."""
    fp8: bool = False
    """An FP8 GEMM's weight (a converted linear's, or expert weights)."""
    gathers: int = 2

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


def _weights(arch: Architecture) -> list[Weight]:
    weights = [Weight(arch.vocab, arch.dim)]  # token embeddings
    for block in arch.blocks:
        weights += [Weight(g.n, g.k, block.count * (arch.experts if g.routed else 1), fp8=g.fp8) for g in block.gemms]
        weights.append(Weight(1, block.norm_params, block.count))
    out = arch.output
    return weights + [Weight(1, arch.dim, gathers=1), Weight(out.n, out.k, fp8=True, gathers=1)]  # final norm, output


MODELS = {name: _weights(arch) for name, arch in ARCHITECTURES.items()}


def step_bytes(weights: list[Weight], ranks: int, fp8: str | None) -> float:
    """Bytes each rank receives from FSDP2 all-gathers in one step; ``fp8``: None (bf16),
    "tensorwise" or "rowwise" for the FP8-gathered weights."""
    total = 0.0
    for w in weights:
        if fp8 and w.fp8:
            per_gather = w.numel + (4 * w.rows * w.count if fp8 == "rowwise" else 0)
        else:
            per_gather = 2 * w.numel
        total += w.gathers * per_gather
    return total * (ranks - 1) / ranks


def traffic_rows(ranks: int) -> list[dict]:
    rows = []
    for name, weights in MODELS.items():
        bf16 = step_bytes(weights, ranks, None)
        row = {"model": name, "ranks": ranks, "bf16_bytes": bf16}
        for fp8 in ("tensorwise", "rowwise"):
            row[f"{fp8}_bytes"] = step_bytes(weights, ranks, fp8)
            row[f"{fp8}_ratio"] = row[f"{fp8}_bytes"] / bf16
        row["fp8_gathered_share"] = sum(w.numel for w in weights if w.fp8) / sum(w.numel for w in weights)
        rows.append(row)
    return rows
