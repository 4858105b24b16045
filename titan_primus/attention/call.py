"""The attention call of a routed layer: bshd (B, L, H, D) tensors in, bshd out, whatever the
backend. What it runs was decided at conversion (:class:`~.route.AttentionRoute` holds the
backend's kernels); nothing here looks at the device or the backend's name."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .route import AttentionRoute

__all__ = ["Documents", "attend"]


class Documents(NamedTuple):
    """Packed documents (TorchTitan's VarlenMetadata, whose query and key offsets are the same in
    self-attention): int32 cumulative offsets over the B·L tokens, and the longest document."""

    cu_seqlens: torch.Tensor
    max_seqlen: int


def _bf16(t: torch.Tensor) -> torch.Tensor:
    # Primus-Turbo's flash attention takes bf16/fp16 only (AITER's kernels); TorchTitan's own
    # varlen path casts to bf16 the same way (models/common/attention.py).
    return t.to(torch.bfloat16)


def attend(
    route: AttentionRoute,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    causal: bool,
    window: tuple[int, int] = (-1, -1),
    documents: Documents | None = None,
) -> torch.Tensor:
    """Attention of bshd ``q`` (B, L, Hq, D) over ``k``/``v`` (B, L, Hkv, D / Dv) on ``route``'s
    backend, in ``q``'s dtype. ``scale``: the softmax scale (None: 1/sqrt(D));
    ``window``: (left, right) in flash-attention's convention; ``documents``: document masking."""
    kernels = route.kernels
    if kernels is None:
        raise ValueError(f"titan-primus: {route.fqn} has no attention backend to call: {route.describe()}")
    if route.fp8:
        return kernels.fp8_attention(_bf16(q), _bf16(k), _bf16(v), causal=causal, softmax_scale=scale).to(q.dtype)
    B, L = q.shape[:2]
    if documents is None:  # one sequence per batch element
        cu_seqlens, longest = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device), L
    else:
        cu_seqlens, longest = documents
    out = kernels.flash_attention(
        _bf16(q).flatten(0, 1),
        _bf16(k).flatten(0, 1),
        _bf16(v).flatten(0, 1),
        cu_seqlens,
        longest,
        softmax_scale=scale,
        causal=causal,
        window=window,
    )
    return out.unflatten(0, (B, L)).to(q.dtype)
