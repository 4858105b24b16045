"""The GEMMs and attention of the models the CLI models (FSDP2 all-gather traffic, memory per rank), from
TorchTitan 0.3.0's model definitions: ``models/llama3/__init__.py`` (``_8b``, ``_70b``,
``_405b``) and ``models/deepseek_v3/__init__.py`` (``_671b``: MLA attention, 3 dense + 58 MoE
layers, 256 routed experts of hidden 2048 with top-8 routing, one shared expert; MLA attention
computes 128 heads of q/k head dim 128 + 64 (nope + rope) = 192 and v head dim 128). Only
shapes: nothing here is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gemm", "Block", "Architecture", "AttentionHeads", "ARCHITECTURES"]


@dataclass(frozen=True)
class Gemm:
    name: str
    k: int
    """Input width (the contracted dimension)."""
    n: int
    """Output width."""
    group: str
    """GEMMs of a block that read the same input tensor share a group (wq/wk/wv, w1/w3)."""
    routed: bool = False
    """An MoE routed-expert GEMM: one weight per expert, rows = tokens x top-k."""
    fp8: bool = True
    """Converted by the converter's defaults (MoE router gates are kept in high precision)."""


@dataclass(frozen=True)
class AttentionHeads:
    """What one attention layer computes over, per token: its heads and head dims."""

    heads: int
    kv_heads: int
    head_dim: int
    """Query/key head dim."""
    v_head_dim: int


@dataclass(frozen=True)
class Block:
    count: int
    """Transformer blocks of this kind."""
    gemms: tuple[Gemm, ...]
    norm_params: int
    """High-precision parameters per block besides the GEMMs' (norms)."""


@dataclass(frozen=True)
class Architecture:
    name: str
    dim: int
    vocab: int
    blocks: tuple[Block, ...]
    attention: AttentionHeads
    experts: int = 0
    top_k: int = 0
    fused_qkv: bool = False
    """wq/wk/wv run as one GEMM (TorchTitan 0.3's llama3: ``wqkv``, models/common/attention.py)."""

    def weight_numel(self, gemm: Gemm) -> int:
        return gemm.k * gemm.n * (self.experts if gemm.routed else 1)

    def block_params(self, block: Block) -> int:
        return sum(self.weight_numel(g) for g in block.gemms) + block.norm_params

    @property
    def output(self) -> Gemm:
        """The output projection (converted by default), outside the blocks."""
        return Gemm("output", self.dim, self.vocab, "final")

    @property
    def params(self) -> int:
        """Token embeddings, blocks, final norm, output projection."""
        blocks = sum(b.count * self.block_params(b) for b in self.blocks)
        return self.vocab * self.dim + blocks + self.dim + self.weight_numel(self.output)


def _llama3(name: str, layers: int, dim: int, heads: int, kv_dim: int, ffn: int, vocab: int = 128256) -> Architecture:
    gemms = (
        Gemm("wq", dim, dim, "attention input"),
        Gemm("wk", dim, kv_dim, "attention input"),
        Gemm("wv", dim, kv_dim, "attention input"),
        Gemm("wo", dim, dim, "attention output"),
        Gemm("w1", dim, ffn, "ffn input"),
        Gemm("w3", dim, ffn, "ffn input"),
        Gemm("w2", ffn, dim, "ffn hidden"),
    )
    head_dim = dim // heads
    attention = AttentionHeads(heads, kv_dim // head_dim, head_dim, head_dim)
    return Architecture(name, dim, vocab, (Block(layers, gemms, 2 * dim),), attention, fused_qkv=True)


def _deepseek_v3_671b() -> Architecture:
    dim, heads, q_rank, kv_rank, nope, rope, v, hidden = 7168, 128, 1536, 512, 128, 64, 128, 2048
    attention = (
        Gemm("wq_a", dim, q_rank, "attention input"),
        Gemm("wq_b", q_rank, heads * (nope + rope), "q norm"),
        Gemm("wkv_a", dim, kv_rank + rope, "attention input"),
        Gemm("wkv_b", kv_rank, heads * (nope + v), "kv norm"),
        Gemm("wo", heads * v, dim, "attention output"),
    )
    norms = 2 * dim + q_rank + kv_rank  # attention, FFN, q and kv norms
    dense = (
        Gemm("w1", dim, 18432, "ffn input"),
        Gemm("w3", dim, 18432, "ffn input"),
        Gemm("w2", 18432, dim, "ffn hidden"),
    )
    moe = (
        Gemm("router.gate", dim, 256, "ffn input", fp8=False),
        Gemm("shared_experts.w1", dim, hidden, "ffn input"),
        Gemm("shared_experts.w3", dim, hidden, "ffn input"),
        Gemm("shared_experts.w2", hidden, dim, "shared expert hidden"),
        Gemm("experts.w1", dim, hidden, "routed tokens", routed=True),
        Gemm("experts.w3", dim, hidden, "routed tokens", routed=True),
        Gemm("experts.w2", hidden, dim, "routed hidden", routed=True),
    )
    return Architecture(
        "DeepSeek-V3-671B",
        dim,
        129280,
        (Block(3, attention + dense, norms), Block(58, attention + moe, norms)),
        AttentionHeads(heads, heads, nope + rope, v),
        experts=256,
        top_k=8,
    )


ARCHITECTURES = {
    "Llama3-8B": _llama3("Llama3-8B", 32, 4096, 32, 1024, 14336),
    "Llama3-70B": _llama3("Llama3-70B", 80, 8192, 64, 1024, 28672),
    "Llama3-405B": _llama3("Llama3-405B", 126, 16384, 128, 1024, 53248),
    "DeepSeek-V3-671B": _deepseek_v3_671b(),
}
