"""What one layer's attention computes (:class:`AttentionSite`), and the rules of FP8 attention's
one definition (Primus-Turbo's ``flash_attn_fp8_func``, blockwise 64) on it: checked by routing at
conversion and, on shapes only, by every backend's FP8 attention on each call."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionSite", "fp8_attention_refusal"]


@dataclass(frozen=True)
class AttentionSite:
    """What one layer's attention computes, as an adapter reads it off TorchTitan's model."""

    causal: bool | None = True
    """None: each call says (SDPA's ``is_causal``; Flux passes False)."""
    documents: bool = False
    """Document masking: packed documents attend only within themselves (cu_seqlens)."""
    window: tuple[int, int] = (-1, -1)
    """Sliding window (left, right) in flash-attention's convention; (-1, -1): none."""
    head_dims: tuple[int, int] | None = None
    """(query/key, value) head dimensions, where the adapter knows them."""
    grouped: bool = False
    """Grouped-query attention: fewer key/value heads than query heads."""
    dropout: float = 0.0
    unmappable: str | None = None
    """The adapter's reason Primus-Turbo cannot compute this layer's attention as TorchTitan does
    (a BlockMask with a score_mod, an LSE epilogue, context parallelism, ...), if any."""

    def describe(self) -> str:
        if self.causal is None:
            mask = "causal or full, as each call's is_causal says"
        elif self.documents:
            mask = "document-causal" if self.causal else "document"
        else:
            mask = "causal" if self.causal else "full"
        if self.window != (-1, -1):
            mask += f", window {self.window}"
        return mask


def fp8_attention_refusal(site: AttentionSite) -> str | None:
    """Why Primus-Turbo's FP8 attention cannot compute ``site`` as defined, or None where it can.
    Each rule is read in Primus-Turbo's sources (``ops/attention/flash_attn_interface.py``,
    ``kernels/attention/attention_triton_impl.py``); the sequence length, unknown at conversion,
    is checked on each call (a multiple of 64: ``check_fp8_attention_inputs``)."""
    if site.unmappable:
        return site.unmappable
    if site.documents:
        return (
            "document masking needs varlen attention, and Primus-Turbo's FP8 attention has none "
            "(flash_attn_fp8_func takes no cu_seqlens)"
        )
    if site.window != (-1, -1):
        return f"sliding window {site.window}: Primus-Turbo's FP8 attention asserts window_size == (-1, -1)"
    if site.dropout:
        return f"dropout {site.dropout}: Primus-Turbo's FP8 backward ignores the forward's dropout"
    if site.head_dims and any(d < 32 or d % 2 for d in site.head_dims):
        return f"head dims {site.head_dims}: Primus-Turbo's FP8 backward needs even head dims of at least 32"
    if site.grouped and site.head_dims and site.head_dims[0] != site.head_dims[1]:
        return (
            f"grouped-query attention with head dims {site.head_dims}: Primus-Turbo's FP8 backward computes dK and dV "
            f"wrong there (found under the Triton interpreter at every build from v0.3.1 to v0.4.1.dev26: "
            f"tests/real_turbo/test_attention_cli.py)"
        )
    return None
