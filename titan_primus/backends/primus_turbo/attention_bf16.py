"""Primus-Turbo's bf16 flash attention (AITER's kernels) on its low-level ops: one path for eager and
compiled, decided once.

Primus-Turbo's ``flash_attn_varlen_func`` (``pytorch/ops/attention/flash_attn_interface.py``)
wraps its custom ops ``primus_turbo::attention_aiter_varlen_{forward,backward}_impl`` (with fakes,
``kernels/attention/attention_aiter_impl.py``) in an autograd Function whose Python reads the
device on every call and, at v0.4.1.dev26, picks a kernel backend per call (its FlyDSL check of
varlen inputs calls ``.item()``: a host sync, which a fullgraph compile refuses). Here a
titan-primus autograd Function calls the same two ops with the arguments
``AiterFlashAttnVarlenFunc`` passes them (the same at v0.3.1, v0.3.2.dev48, v0.4.0 and
v0.4.1.dev26): ``is_v3_atomic_fp32`` read once with Primus-Turbo's own reader of
``PRIMUS_TURBO_ATTN_V3_ATOMIC_FP32`` (AMD asks for 1 on gfx942), ``how_v3_bf16_cvt`` 0 on gfx950
and 1 before, as Primus-Turbo sets them. So the kernels are AITER's at every build; v0.4.1.dev26's
FlyDSL kernels (gfx950 only) are not used.

Dense attention is varlen with one sequence per batch element (cu_seqlens 0, L, 2L, ...), so
causal, full, windowed and document-masked attention take one path. Saved for backward what
Primus-Turbo saves: q, k, v, the output, the fp32 LSE (Hq, B·L) and the RNG state.
"""

from __future__ import annotations

import importlib

import torch

from .release import require_api

__all__ = ["flash_attention", "kernel_settings"]


def kernel_settings() -> tuple[bool, int]:
    """(is_v3_atomic_fp32, how_v3_bf16_cvt) as Primus-Turbo's varlen Function sets them: read at
    conversion (the route keeps them), not per call."""
    require_api()
    utils = importlib.import_module("primus_turbo.pytorch.ops.attention.attention_utils")
    capability = importlib.import_module("primus_turbo.pytorch.core.utils").get_device_compute_capability()
    return utils._resolve_is_v3_atomic_fp32_from_env(), 0 if capability >= (9, 5) else 1


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, causal, left, right, atomic_fp32, bf16_cvt):
        out, lse, _, rng_state = torch.ops.primus_turbo.attention_aiter_varlen_forward_impl(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=left,
            window_size_right=right,
            bias=None,
            alibi_slopes=None,
            return_lse=True,
            return_softmax=False,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state)
        ctx.settings = (max_seqlen, scale, causal, left, right, atomic_fp32, bf16_cvt)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, rng_state = ctx.saved_tensors
        max_seqlen, scale, causal, left, right, atomic_fp32, bf16_cvt = ctx.settings
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.primus_turbo.attention_aiter_varlen_backward_impl(
            dout=dout.contiguous(),
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=left,
            window_size_right=right,
            alibi_slopes=None,
            deterministic=False,
            rng_state=rng_state,
            is_v3_atomic_fp32=atomic_fp32,
            how_v3_bf16_cvt=bf16_cvt,
        )
        return dq, dk, dv, *([None] * 8)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    softmax_scale: float | None,
    causal: bool,
    window: tuple[int, int],
    settings: tuple[bool, int],
) -> torch.Tensor:
    """bf16 attention of packed (T, Hq, D) ``q`` over (T, Hkv, D / Dv) ``k``/``v``, sequences at
    the int32 ``cu_seqlens``; ``window`` (left, right) in flash-attention's convention;
    ``settings``: :func:`kernel_settings`."""
    atomic_fp32, bf16_cvt = settings
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _FlashAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens,
        max_seqlen,
        scale,
        causal,
        *window,
        atomic_fp32,
        bf16_cvt,
    )
