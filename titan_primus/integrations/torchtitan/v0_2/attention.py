"""TorchTitan 0.2.x's inner attention on Primus-Turbo: the wrappers of ``torchtitan/models/attention.py``
swapped on the meta model, as the linears are.

- ``ScaledDotProductAttentionWrapper`` (the default of llama3, qwen3 and deepseek_v3: causal, no
  masks) -> :class:`PrimusTurboSDPAWrapper`, Primus-Turbo causal (bf16 or FP8), the model's
  ``scale`` passed through (deepseek_v3's mscale² for YaRN-extended lengths included);
- ``VarlenAttentionWrapper`` -> :class:`PrimusTurboVarlenWrapper`, Primus-Turbo varlen on the
  model's VarlenMetadata (causal within each document);
- ``FlexAttentionWrapper`` keeps TorchTitan's path: its BlockMask cannot be read back into what
  Primus-Turbo takes.

The models hand the wrappers logical (B, H, L, D) views of (B, L, H, D) memory, so
``transpose(1, 2)`` gives Primus-Turbo its bshd operands without a copy.
"""

from __future__ import annotations

from torch import nn
from torchtitan.models.attention import FlexAttentionWrapper, ScaledDotProductAttentionWrapper, VarlenAttentionWrapper

from titan_primus.attention import AttentionRoute, AttentionSite, attend
from titan_primus.attention.call import Documents

__all__ = ["PrimusTurboSDPAWrapper", "PrimusTurboVarlenWrapper", "attention_swaps"]

FLEX_KEPT = (
    "FlexAttention's BlockMask (TorchTitan 0.2.x builds it in each model) cannot be read back into the "
    "causal flag or cu_seqlens Primus-Turbo takes; set attn_type to sdpa or varlen to route it"
)


class PrimusTurboSDPAWrapper(nn.Module):
    """``ScaledDotProductAttentionWrapper``'s call on Primus-Turbo."""

    def __init__(self, route: AttentionRoute):
        super().__init__()
        self.route = route

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        out = attend(self.route, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=is_causal)
        return out.transpose(1, 2)


class PrimusTurboVarlenWrapper(nn.Module):
    """``VarlenAttentionWrapper``'s call on Primus-Turbo: causal within each document (TorchTitan
    0.2.x's varlen window is (-1, 0)); returns the packed (B·L, H, D) output, as TorchTitan's."""

    def __init__(self, route: AttentionRoute):
        super().__init__()
        self.route = route

    def forward(self, xq, xk, xv, attention_masks, scale=None):
        documents = Documents(attention_masks.cu_seq_q, attention_masks.max_q)
        out = attend(
            self.route,
            xq.transpose(1, 2),
            xk.transpose(1, 2),
            xv.transpose(1, 2),
            scale=scale,
            causal=True,
            documents=documents,
        )
        return out.flatten(0, 1)


def _head_dims(attention: nn.Module | None) -> tuple[int, int] | None:
    if attention is None:
        return None
    if hasattr(attention, "qk_head_dim"):  # deepseek_v3's MLA
        return attention.qk_head_dim, attention.v_head_dim
    head_dim = getattr(attention, "head_dim", None)
    return (head_dim, head_dim) if head_dim else None


def _grouped(attention: nn.Module | None) -> bool:
    n_kv_heads = getattr(attention, "n_kv_heads", None)
    return n_kv_heads is not None and n_kv_heads != getattr(attention, "n_heads", n_kv_heads)


CONTEXT_PARALLEL_KEPT = (
    "context parallelism shards the sequence, and TorchTitan's _ContextParallel wraps its own attention wrappers only"
)


def attention_swaps(model: nn.Module, router, *, context_parallel: bool = False) -> list[tuple[str, nn.Module]]:
    """(fqn, replacement) for every inner attention of ``model`` the router sends to a backend
    of titan-primus's (``router``: the converter's LayerRouter, which records every layer);
    none under context parallelism."""
    modules = dict(model.named_modules())
    swaps = []
    for fqn, module in modules.items():
        parent = modules.get(fqn.rpartition(".")[0])
        shape = {"head_dims": _head_dims(parent), "grouped": _grouped(parent)}
        if isinstance(module, ScaledDotProductAttentionWrapper):
            site, wrapper = AttentionSite(causal=True, **shape), PrimusTurboSDPAWrapper
        elif isinstance(module, VarlenAttentionWrapper):
            site, wrapper = AttentionSite(documents=True, **shape), PrimusTurboVarlenWrapper
        elif isinstance(module, FlexAttentionWrapper):
            site, wrapper = AttentionSite(unmappable=FLEX_KEPT), None
        else:
            continue
        if context_parallel:
            site = AttentionSite(unmappable=CONTEXT_PARALLEL_KEPT)
        route = router.attention(fqn, site)
        if route is not None and route.backend is not None:
            swaps.append((fqn, wrapper(route)))
    return swaps
