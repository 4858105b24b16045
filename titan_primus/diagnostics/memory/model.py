"""Memory per rank of a model under FSDP2, and what each attention path keeps per layer, MODELLED from its shapes and from the per-layer audit
(what one converted GEMM keeps from forward to backward, measured by ``bench --memory``): not a
measurement. Assumptions (stated in every output):

- FSDP2 over ``ranks`` ranks, no TP/EP/PP; fp32 master weights, fp32 gradients, AdamW: 16 bytes
  per parameter, sharded.
- Gathered weights at the peak (the start of backward): the output projection (TorchTitan keeps
  the root's parameters unsharded after its forward) and the two largest transformer blocks (the
  one computing, the one prefetched), 2 bytes per element, or 1 (+ 4 per row for rowwise scales)
  for the FP8 layers' weights where the column all-gathers them in FP8.
- Kept for backward by the GEMMs, per layer: each GEMM's input (tokens x K; routed experts:
  tokens x top-k x K) at the audited bytes per input element; GEMMs reading one input tensor
  (wq/wk/wv, w1/w3) share it when the backend keeps the input itself, and keep one copy each
  when it keeps its own (an FP8 cast); plus the audited weight-copy bytes per weight element.
  Without activation checkpointing every layer's; with full checkpointing one block's, plus each
  block's input (tokens x dim, bf16).
- Not included: attention, norm and elementwise activations, and gradients in flight: the same
  in every column.

Attention (:func:`attention_saved`, :func:`attention_rows`): the tensors each attention path saves
for backward per layer, from the layer's shapes, as its autograd function saves them (B batch, S
sequence, Hq / Hkv heads, D / Dv head dims; bf16 2 bytes, FP8 1, fp32 4):

- TorchTitan's own (SDPA's flash / memory-efficient kernels, varlen): q, k, v and out in bf16, the
  fp32 log-sum-exp (B, Hq, S); the philox seed and offset (a few bytes) left out.
- Primus-Turbo bf16 flash attention (``backends/primus_turbo/attention_bf16.py``, what
  ``AiterFlashAttnVarlenFunc`` saves): packed q, k, v and out (bf16), the fp32 LSE (Hq, B·S), the
  int32 cu_seqlens and ``rng_state`` (taken as 2 int64, as Primus-Turbo builds it on its sink path;
  AITER's own is not read here).
- Primus-Turbo FP8 attention (``TritonFlashAttnFunc``, and titan-primus's opaque op around it):
  FP8 q, k, v, bf16 out, the fp32 (B, Hq, 2S) LSE/Delta buffer, fp32 descales (B, H, S/64) of q, k, v.
- The emulated FP8 attention: the same, but its LSE is (B, Hq, S) (its backward computes Delta
  itself) and its FP8 q, k, v are heads-first; ``bench --memory`` checks this row against the
  tensors it saves on a small shape.

Selective activation checkpointing (:func:`selective_ac_rows`): the GEMM outputs (bf16, 2 bytes per
element, as every backend's GEMMs return them) each per-op policy saves in the checkpointed
blocks, and the share of the blocks' forward GEMM FLOPs it runs again in backward. The GEMMs run in
forward order (wq/wk/wv as one where the model fuses them), counted per block: TorchTitan 0.3's
SelectiveAC recomputes every second ``aten.mm`` and the router gate, saves no
``torch._grouped_mm`` (not in its save set); ``Fp8SelectiveAC`` saves every FP8 GEMM
(``fp8_gemms="save"``) or every second one, routed experts' included (``"alternate"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model_shapes import ARCHITECTURES, Architecture, AttentionHeads, Block, Gemm

__all__ = [
    "ASSUMPTIONS",
    "ATTENTION_PATHS",
    "BF16",
    "SAC_POLICIES",
    "GemmMemory",
    "SavedTensor",
    "attention_rows",
    "attention_saved",
    "estimate",
    "estimate_rows",
    "selective_ac_rows",
]

ASSUMPTIONS = (
    "MODEL, not a measurement: FSDP2 only (no TP/EP/PP), fp32 weights + grads + AdamW sharded (16 B/param), "
    "gathered at the peak: output projection + 2 largest blocks; kept for backward: the GEMMs' inputs and weight "
    "copies at the audited bytes per element; attention, norm and elementwise activations not included (the same "
    "in every column)"
)


@dataclass(frozen=True)
class GemmMemory:
    """What one converted GEMM keeps, per element, from the per-layer audit."""

    input_bytes: float
    """Bytes kept per element of the GEMM's input, beyond the input itself when that is kept."""
    input_by_reference: bool
    """The input tensor itself is kept (shared with the other GEMMs that read it)."""
    weight_copy_bytes: float
    """Bytes of weight copies kept per weight element."""
    gathered_bytes: float | None = None
    """Bytes per weight element FSDP2 all-gathers in FP8 (None: gathered in bf16)."""
    gathered_row_bytes: float = 0.0
    """Bytes per weight row gathered with it (rowwise scales)."""


BF16 = GemmMemory(input_bytes=0.0, input_by_reference=True, weight_copy_bytes=0.0)
"""F.linear and torch._grouped_mm in bf16: the input itself and the parameter."""
_BF16_BYTES = 2


def _gathered_bytes(arch: Architecture, gemms, memory: dict[bool, GemmMemory]) -> float:
    total = 0.0
    for g in gemms:
        numel = arch.weight_numel(g)
        m = memory[g.routed] if g.fp8 else BF16
        if m.gathered_bytes is None:
            total += _BF16_BYTES * numel
        else:
            total += m.gathered_bytes * numel + m.gathered_row_bytes * g.n * (arch.experts if g.routed else 1)
    return total


def _block_kept(arch: Architecture, block: Block, tokens: int, memory: dict[bool, GemmMemory]) -> tuple[float, float]:
    """(activation bytes, weight-copy bytes) one block's GEMMs keep for backward."""
    activations = copies = 0.0
    by_reference: set[str] = set()
    for g in block.gemms:
        rows = tokens * (arch.top_k if g.routed else 1)
        m = memory[g.routed] if g.fp8 else BF16
        if m.input_by_reference and g.group not in by_reference:
            by_reference.add(g.group)
            activations += _BF16_BYTES * rows * g.k
        activations += m.input_bytes * rows * g.k
        copies += m.weight_copy_bytes * arch.weight_numel(g)
    return activations, copies


def estimate(arch: Architecture, ranks: int, tokens: int, memory: dict[bool, GemmMemory]) -> dict:
    """Bytes per rank (see the module's assumptions); ``memory``: the column's GemmMemory for
    dense GEMMs (False) and routed-expert grouped GEMMs (True); ``tokens``: per rank and step."""
    state = 16 * arch.params / ranks
    largest = sorted(arch.blocks, key=arch.block_params, reverse=True)
    in_flight = [b for b in largest for _ in range(b.count)][:2]
    gathered = sum(_gathered_bytes(arch, b.gemms, memory) + _BF16_BYTES * b.norm_params for b in in_flight)
    gathered += _gathered_bytes(arch, [arch.output], memory) + _BF16_BYTES * arch.dim
    output_activations, output_copies = _block_kept(arch, Block(1, (arch.output,), 0), tokens, memory)
    per_block = [(b, *_block_kept(arch, b, tokens, memory)) for b in arch.blocks]
    kept_none = sum(b.count * (a + c) for b, a, c in per_block) + output_activations + output_copies
    block_inputs = sum(b.count for b in arch.blocks) * tokens * arch.dim * _BF16_BYTES
    kept_full = block_inputs + max(a + c for _, a, c in per_block) + output_activations + output_copies
    return {
        "state_bytes": state,
        "gathered_bytes": gathered,
        "gemm_activation_bytes": sum(b.count * a for b, a, _ in per_block) + output_activations,
        "weight_copy_bytes": sum(b.count * c for b, _, c in per_block) + output_copies,
        "total_no_ac_bytes": state + gathered + kept_none,
        "total_full_ac_bytes": state + gathered + kept_full,
    }


def estimate_rows(columns: dict[str, dict[bool, GemmMemory]], ranks: int, seq_len: int, local_batch: int) -> list[dict]:
    """One row per model and column (``columns``: name -> its GemmMemory for dense and routed
    GEMMs, or None for routed where the column has none: MoE models are left out for it)."""
    tokens = seq_len * local_batch
    rows = []
    for name, arch in ARCHITECTURES.items():
        for column, memory in columns.items():
            if arch.experts and memory.get(True) is None:
                continue
            rows.append(
                {
                    "model": name,
                    "column": column,
                    "ranks": ranks,
                    "seq_len": seq_len,
                    "local_batch": local_batch,
                    **estimate(arch, ranks, tokens, memory),
                }
            )
    return rows


SAC_POLICIES = ("bf16, TorchTitan's SelectiveAC", "FP8, fp8_gemms='save'", "FP8, fp8_gemms='alternate'")


def _forward_calls(arch: Architecture, block: Block) -> list[Gemm]:
    """The GEMMs of ``block`` as its forward runs them: wq/wk/wv as one where ``arch`` fuses them."""
    calls: list[Gemm] = []
    for g in block.gemms:
        if arch.fused_qkv and calls and g.group == calls[-1].group == "attention input":
            calls[-1] = Gemm("wqkv", g.k, calls[-1].n + g.n, g.group)
        else:
            calls.append(g)
    return calls


def _saved(policy: str, calls: list[Gemm]) -> list[bool]:
    """Whether ``policy`` saves each call's output (else it runs again in backward)."""
    saved, counted = [], 0
    for g in calls:
        if not g.fp8:  # the router gate: TorchTitan's force_recompute_mm_shapes_by_fqns default
            saved.append(False)
        elif policy == SAC_POLICIES[1]:
            saved.append(True)
        elif g.routed and policy == SAC_POLICIES[0]:
            saved.append(False)
        else:
            counted += 1
            saved.append(counted % 2 == 1)
    return saved


def selective_ac_rows(seq_len: int, local_batch: int) -> list[dict]:
    """Per model and policy (:data:`SAC_POLICIES`): bytes per rank of the GEMM outputs kept in the
    checkpointed blocks, and the share of their forward GEMM FLOPs recomputed in backward."""
    tokens = seq_len * local_batch
    rows = []
    for name, arch in ARCHITECTURES.items():
        for policy in SAC_POLICIES:
            kept = flops = recomputed = 0.0
            for block in arch.blocks:
                calls = _forward_calls(arch, block)
                for g, saved in zip(calls, _saved(policy, calls)):
                    rows_in = tokens * (arch.top_k if g.routed else 1)
                    flops += block.count * rows_in * g.k * g.n
                    if saved:
                        kept += block.count * _BF16_BYTES * rows_in * g.n
                    else:
                        recomputed += block.count * rows_in * g.k * g.n
            rows.append(
                {
                    "model": name,
                    "policy": policy,
                    "seq_len": seq_len,
                    "local_batch": local_batch,
                    "kept_gemm_output_bytes": kept,
                    "forward_flops_recomputed": recomputed / flops,
                }
            )
    return rows


# --- attention: what each path keeps for backward, per layer --------------------------------

ATTENTION_PATHS = (
    "TorchTitan (SDPA / flash, bf16)",
    "Primus-Turbo flash attention (bf16)",
    "Primus-Turbo FP8 attention",
    "emulated FP8 attention",
)
_FP8_BLOCK = 64  # one scale per 64 tokens


@dataclass(frozen=True)
class SavedTensor:
    name: str
    shape: tuple[int, ...]
    element_bytes: int

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.element_bytes


def attention_saved(path: str, heads: AttentionHeads, seq: int, batch: int) -> tuple[SavedTensor, ...]:
    """The tensors ``path`` (one of :data:`ATTENTION_PATHS`) saves for backward in one layer."""
    B, S, Hq, Hkv, D, Dv = batch, seq, heads.heads, heads.kv_heads, heads.head_dim, heads.v_head_dim
    if path == ATTENTION_PATHS[0]:
        return (
            SavedTensor("q", (B, S, Hq, D), 2),
            SavedTensor("k", (B, S, Hkv, D), 2),
            SavedTensor("v", (B, S, Hkv, Dv), 2),
            SavedTensor("out", (B, S, Hq, Dv), 2),
            SavedTensor("lse", (B, Hq, S), 4),
        )
    if path == ATTENTION_PATHS[1]:  # backends/primus_turbo/attention_bf16.py: packed (T = B·S) varlen
        T = B * S
        return (
            SavedTensor("q", (T, Hq, D), 2),
            SavedTensor("k", (T, Hkv, D), 2),
            SavedTensor("v", (T, Hkv, Dv), 2),
            SavedTensor("out", (T, Hq, Dv), 2),
            SavedTensor("lse", (Hq, T), 4),
            SavedTensor("cu_seqlens", (B + 1,), 4),
            SavedTensor("rng_state", (2,), 8),
        )
    blocks = S // _FP8_BLOCK
    descales = tuple(
        SavedTensor(f"{name}_descale", (B, h, blocks), 4) for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv))
    )
    if path == ATTENTION_PATHS[2]:
        fp8 = (
            SavedTensor("q", (B, S, Hq, D), 1),
            SavedTensor("k", (B, S, Hkv, D), 1),
            SavedTensor("v", (B, S, Hkv, Dv), 1),
        )
        lse = SavedTensor("lse_delta", (B, Hq, 2 * S), 4)
    elif path == ATTENTION_PATHS[3]:
        fp8 = (
            SavedTensor("q", (B, Hq, S, D), 1),
            SavedTensor("k", (B, Hkv, S, D), 1),
            SavedTensor("v", (B, Hkv, S, Dv), 1),
        )
        lse = SavedTensor("lse", (B, Hq, S), 4)
    else:
        raise ValueError(f"unknown attention path {path!r}; known: {', '.join(ATTENTION_PATHS)}")
    return (*fp8, SavedTensor("out", (B, S, Hq, Dv), 2), lse, *descales)


def attention_rows(seq_len: int, local_batch: int) -> list[dict]:
    """Per model and attention path: bytes kept for backward per layer (q/k/v, out, the rest) and
    over all the model's layers, and the ratio to TorchTitan's own attention."""
    rows = []
    for name, arch in ARCHITECTURES.items():
        layers = sum(b.count for b in arch.blocks)
        torchtitan = None
        for path in ATTENTION_PATHS:
            saved = attention_saved(path, arch.attention, seq_len, local_batch)
            per_layer = sum(t.bytes for t in saved)
            torchtitan = torchtitan or per_layer
            rows.append(
                {
                    "model": name,
                    "path": path,
                    "seq_len": seq_len,
                    "local_batch": local_batch,
                    "qkv_bytes": sum(t.bytes for t in saved if t.name in ("q", "k", "v")),
                    "out_bytes": sum(t.bytes for t in saved if t.name == "out"),
                    "other_bytes": sum(t.bytes for t in saved if t.name not in ("q", "k", "v", "out")),
                    "per_layer_bytes": per_layer,
                    "layers": layers,
                    "all_layers_bytes": layers * per_layer,
                    "vs_torchtitan": per_layer / torchtitan,
                }
            )
    return rows
