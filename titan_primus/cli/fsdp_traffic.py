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
stay bf16. Expert weights sharded on dim 0 (TorchTitan's choice while the FSDP degree is at
most the number of experts; beyond it, rowwise expert weights are gathered in bf16).

Shapes: TorchTitan 0.3.0 ``models/llama3/__init__.py`` (``_8b``, ``_70b``) and
``models/deepseek_v3/__init__.py`` (``_671b``: MLA attention, 3 dense + 58 MoE layers, 256
routed experts of hidden 2048, one shared expert).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Weight", "MODELS", "MEASURED_ON_GLOO", "step_bytes", "traffic_rows", "render_traffic"]


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


def _llama3(layers: int, dim: int, kv_dim: int, ffn: int, vocab: int) -> list[Weight]:
    linears = [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return [
        *(Weight(r, c, layers, fp8=True) for r, c in linears),
        Weight(2, dim, layers),  # attention and FFN norms
        Weight(vocab, dim),  # token embeddings
        Weight(1, dim, gathers=1),  # final norm
        Weight(vocab, dim, fp8=True, gathers=1),  # output projection
    ]


def _deepseek_v3_671b() -> list[Weight]:
    dim, layers, dense, heads, q_rank, kv_rank, nope, rope, v = 7168, 61, 3, 128, 1536, 512, 128, 64, 128
    moe = layers - dense
    attention = [(q_rank, dim), (heads * (nope + rope), q_rank), (kv_rank + rope, dim),
                 (heads * (nope + v), kv_rank), (dim, heads * v)]
    return [
        *(Weight(r, c, layers, fp8=True) for r, c in attention),
        Weight(1, 2 * dim + q_rank + kv_rank, layers),  # attention, FFN, q and kv norms
        *(Weight(r, c, dense, fp8=True) for r, c in [(18432, dim), (18432, dim), (dim, 18432)]),
        *(Weight(r, c, moe, fp8=True) for r, c in [(2048, dim), (2048, dim), (dim, 2048)]),  # shared expert
        Weight(256, dim, moe),  # router gate (high precision)
        *(Weight(r, c, moe * 256, fp8=True) for r, c in [(2048, dim), (2048, dim), (dim, 2048)]),  # routed experts
        Weight(129280, dim),
        Weight(1, dim, gathers=1),
        Weight(129280, dim, fp8=True, gathers=1),
    ]


MODELS = {
    "Llama3-8B": _llama3(32, 4096, 1024, 14336, 128256),
    "Llama3-70B": _llama3(80, 8192, 1024, 28672, 128256),
    "DeepSeek-V3-671B": _deepseek_v3_671b(),
}


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


MEASURED_ON_GLOO = (
    "Measured on gloo, 2 ranks, 2026-11-30 (docs/measurements.md; tests/fsdp_fp8_all_gather.py): the FP8-gathered "
    "weights moved 0.5000x their bf16 bytes (tensorwise) and 0.5055-0.5067x (rowwise, fp32 row scales); a whole step "
    "0.5235x (llama3 debug) and 0.5043x (deepseek_v3 debug, expert weights included)."
)


def render_traffic(ranks: int) -> str:
    from .report import markdown_table

    gib = 2**30
    table = [
        [r["model"], f"{100 * r['fp8_gathered_share']:.1f}%", f"{r['bf16_bytes'] / gib:.1f}",
         f"{r['tensorwise_bytes'] / gib:.1f} ({r['tensorwise_ratio']:.3f}x)",
         f"{r['rowwise_bytes'] / gib:.1f} ({r['rowwise_ratio']:.3f}x)"]
        for r in traffic_rows(ranks)
    ]
    return "\n".join([
        f"FSDP2 all-gather traffic per step and rank on {ranks} ranks (MODEL, computed from shapes; "
        f"see titan_primus/cli/fsdp_traffic.py), GiB:",
        "rowwise applies to the Primus-Turbo v0.3.1+ definition only; other rowwise definitions gather in bf16",
        markdown_table(["model", "params FP8-gathered", "bf16", "FP8 tensorwise", "FP8 rowwise"], table),
        MEASURED_ON_GLOO,
    ]) + "\n"
