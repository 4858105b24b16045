"""Expert-parallel all-to-all traffic per training step, with and without FP8 token dispatch,
computed from model shapes (a model, not a measurement; docs/measurements.md has the bytes
counted at the collective on gloo).

Model of a step under TorchTitan's all-to-all token dispatcher ("standard") on EP ranks: every
MoE layer sends one row per (token, chosen expert) pair, and under uniform routing (EP-1)/EP of
them leave the rank (rows for the rank's own experts do not cross a link). Four all-to-alls
move those rows: dispatch and combine in forward, their gradients in backward; selective
activation checkpointing saves the forward ones (TorchTitan's save set), so none runs twice.
bf16: 2 bytes per element. FP8 token dispatch changes the forward dispatch only: each row is
its FP8 payload (1 byte per element) plus its scales (rowwise: one float32; mxfp8: one E8M0
byte per 32 elements). Token counts (a few bytes per expert) are left out.

Shapes: :mod:`titan_primus.diagnostics.model_shapes` (TorchTitan 0.3.0's DeepSeek-V3-671B: 58 MoE
layers, dim 7168, 256 experts, top-8).
"""

from __future__ import annotations

from ..model_shapes import ARCHITECTURES

__all__ = ["ep_traffic_rows"]

MODEL = "DeepSeek-V3-671B"
DEGREES = (8, 64)
TOKENS_PER_RANK = 4096
"""One sequence of DeepSeek-V3's training length per rank and step."""


def _scale_bytes(recipe: str, dim: int) -> int:
    return 4 if recipe == "rowwise" else -(-dim // 32)


def ep_traffic_rows(tokens_per_rank: int = TOKENS_PER_RANK) -> list[dict]:
    arch = ARCHITECTURES[MODEL]
    moe_layers = sum(block.count for block in arch.blocks if any(g.routed for g in block.gemms))
    rows = []
    for degree in DEGREES:
        crossing = tokens_per_rank * arch.top_k * (degree - 1) / degree * moe_layers  # rows per step
        bf16_row = 2 * arch.dim
        row = {"model": MODEL, "ep": degree, "tokens_per_rank": tokens_per_rank, "moe_layers": moe_layers}
        row["bf16_dispatch_bytes"] = crossing * bf16_row
        row["bf16_step_bytes"] = 4 * crossing * bf16_row
        for recipe in ("rowwise", "mxfp8"):
            dispatch = crossing * (arch.dim + _scale_bytes(recipe, arch.dim))
            row[f"{recipe}_dispatch_bytes"] = dispatch
            row[f"{recipe}_dispatch_ratio"] = dispatch / row["bf16_dispatch_bytes"]
            row[f"{recipe}_step_ratio"] = (dispatch + 3 * crossing * bf16_row) / row["bf16_step_bytes"]
        rows.append(row)
    return rows
