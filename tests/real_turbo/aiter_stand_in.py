"""A stand-in for AITER's flash-attention kernels (``aiter.ops.mha``), the only part of Primus-Turbo's
bf16 attention that cannot run here: they are CK/ASM kernels for ROCm GPUs, pinned by
Primus-Turbo to ``amd-aiter==0.1.14.post1``, which is on no registry. Everything above them
(Primus-Turbo's ``flash_attn_func`` / ``flash_attn_varlen_func``, its autograd Functions, its
``primus_turbo::attention_aiter_*`` custom ops and their fakes, its head-dim padding) is
Primus-Turbo's own code.

Written from the semantics those kernels implement, flash-attention's (the docstring of
``flash_attn_varlen_func`` in Primus-Turbo's ``ops/attention/flash_attn_interface.py``; the call
sites in ``kernels/attention/attention_aiter_impl.py`` give the argument lists, identical at
v0.3.1, v0.3.2.dev48, v0.4.0 and v0.4.1.dev26):

- query i of a sequence of Sq queries over Sk keys may attend key j iff, with the bottom-right
  offset ``o = Sk - Sq``: ``j <= i + o`` when causal; ``j >= i + o - left`` when ``left >= 0``;
  ``j <= i + o + right`` when ``right >= 0`` (``window_size = (left, right)``);
- varlen: tokens are packed (THD); sequence b is ``cu_seqlens[b]:cu_seqlens[b+1]``, and no
  token attends across sequences;
- GQA: query head h reads key/value head ``h // (Hq // Hkv)``;
- the softmax in fp32 of ``scale · q·kᵀ``, its output rounded to q's dtype once; the LSE is
  fp32, (Hq, total); gradients computed in fp32 and rounded once,
  written into the ``dq``/``dk``/``dv`` buffers (the forward writes ``out=`` where given);
- the grid is sized by ``max_seqlen_q`` (forward; and ``max_seqlen_k`` for the backward's
  key blocks): queries (keys) of a sequence past it are not computed, their rows left as they
  were, here NaN, so a caller passing too short a length fails any closeness check;
- the backward recomputes P from the saved LSE (``exp(scale·q·kᵀ - lse)``) and Delta from the
  saved output (``rowsum(dO ∘ out)``), as flash-attention's backward does, so a caller handing it
  a wrong LSE or output gets wrong gradients, as from the real kernel.

Dropout, bias, ALiBi and sinks are refused (nothing titan-primus routes uses them). The numbers
differ from AITER's in rounding only (its fp32 accumulation order): the bound the tests take
from this stand-in is that of two correct fp32-accumulating implementations.
"""

from __future__ import annotations

import sys
import types

import torch

from .stand_ins import StandInError

__all__ = ["install"]


def _refuse(what: str, value) -> None:
    if value:
        raise StandInError(f"AITER stand-in: {what} is not stood in (got {value!r})")


def _allowed(sq: int, sk: int, causal: bool, left: int, right: int, device) -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _scores(q, k, allowed, scale):
    """q (H, Sq, D), k (Hkv, Sk, D) fp32 -> masked scaled scores (H, Sq, Sk)."""
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    return ((q @ k.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))


def _probabilities(q, k, allowed, scale):
    """q (H, Sq, D), k (Hkv, Sk, D) fp32 -> softmax probabilities (H, Sq, Sk) and LSE (H, Sq)."""
    s = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0), lse


def _heads_first(t, start, end):
    return t[start:end].float().transpose(0, 1)


def _forward_thd(q, k, v, segments, scale, causal, left, right, max_seqlen_q):
    """THD q (T, H, D): out (T, H, Dv) fp32 and lse (H, T) fp32, sequence by sequence; the
    queries of a sequence past ``max_seqlen_q`` are not computed (NaN)."""
    out = q.new_full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=torch.float32)
    lse = q.new_full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    for (q0, q1), (k0, k1) in segments:
        computed = min(q1, q0 + max_seqlen_q)
        allowed = _allowed(q1 - q0, k1 - k0, causal, left, right, q.device)[: computed - q0]
        p, lse[:, q0:computed] = _probabilities(_heads_first(q, q0, computed), _heads_first(k, k0, k1), allowed, scale)
        vh = _heads_first(v, k0, k1)
        out[q0:computed] = (p @ vh.repeat_interleave(q.shape[1] // v.shape[1], 0)).transpose(0, 1)
    return out, lse


def _per_kv_head(grad, group):
    """(H, Sk, D) per query head -> (Sk, Hkv, D), summed over each key/value head's group."""
    return grad.unflatten(0, (-1, group)).sum(1).transpose(0, 1)


def _backward_thd(dout, q, k, v, out, lse, segments, scale, causal, left, right, max_seqlen_q, max_seqlen_k):
    """The softmax-attention gradients in fp32 from the saved output and LSE: P = exp(S - lse),
    dV = Pᵀ·dO, dS = P∘(dO·Vᵀ - rowsum(dO∘out)), dQ = scale·dS·K, dK = scale·dSᵀ·Q, summed over
    each key/value head's query group; queries (keys) of a sequence past ``max_seqlen_q``
    (``max_seqlen_k``) not computed (NaN)."""
    dq, dk, dv = (torch.full_like(t, float("nan"), dtype=torch.float32) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    for (q0, q1), (k0, k1) in segments:
        allowed = _allowed(q1 - q0, k1 - k0, causal, left, right, q.device)
        qh, kh, vh, doh, oh = (
            _heads_first(t, *r)
            for t, r in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)), (dout, (q0, q1)), (out, (q0, q1)))
        )
        p = torch.exp(_scores(qh, kh, allowed, scale) - lse[:, q0:q1, None].float()).nan_to_num(0.0)
        kg, vg = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        ds = p * (doh @ vg.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True))
        q_end, k_end = min(q1, q0 + max_seqlen_q), min(k1, k0 + max_seqlen_k)
        dq[q0:q_end] = (scale * ds @ kg).transpose(0, 1)[: q_end - q0]
        dk[k0:k_end] = _per_kv_head(scale * ds.transpose(-1, -2) @ qh, group)[: k_end - k0]
        dv[k0:k_end] = _per_kv_head(p.transpose(-1, -2) @ doh, group)[: k_end - k0]
    return dq, dk, dv


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    return list(zip(zip(bounds_q[:-1], bounds_q[1:]), zip(bounds_k[:-1], bounds_k[1:])))


def _flash_attn_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded, max_seqlen_q, max_seqlen_k,
    min_seqlen_q, dropout_p, softmax_scale, *, causal, logits_soft_cap, window_size_left, window_size_right,
    sink_size, bias, alibi_slopes, return_lse, return_softmax, out=None, **kwargs,
):  # fmt: skip
    _refuse("dropout", dropout_p)
    _refuse("bias", bias is not None)
    _refuse("alibi_slopes", alibi_slopes is not None)
    _refuse("sink_size", sink_size)
    _refuse("logits_soft_cap", logits_soft_cap)
    _refuse("padded cu_seqlens", cu_seqlens_q_padded is not None or cu_seqlens_k_padded is not None)
    segments = _segments(cu_seqlens_q, cu_seqlens_k)
    o, lse = _forward_thd(q, k, v, segments, softmax_scale, causal, window_size_left, window_size_right, max_seqlen_q)
    o = o.to(q.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    softmax_scale, causal, window_size_left, window_size_right, alibi_slopes, deterministic, **kwargs,
):  # fmt: skip
    _refuse("dropout", dropout_p)
    _refuse("alibi_slopes", alibi_slopes is not None)
    segments = _segments(cu_seqlens_q, cu_seqlens_k)
    grads = _backward_thd(
        dout, q, k, v, out, softmax_lse, segments, softmax_scale, causal, window_size_left, window_size_right,
        max_seqlen_q, max_seqlen_k,
    )  # fmt: skip
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)
    return dq, dk, dv, None


def _not_stood_in(*args, **kwargs):
    raise StandInError(
        "AITER stand-in: only the varlen kernels titan-primus calls are stood in (not the dense ones, nor the "
        "Triton sink kernels of aiter.ops.triton.attention)"
    )


def install() -> None:
    """Put ``aiter.ops.mha`` (and the modules Primus-Turbo imports beside it) in ``sys.modules``:
    Primus-Turbo imports them together, lazily, on its first attention call. titan-primus's route
    calls the varlen kernels only (dense attention is varlen with one sequence per batch element:
    backends/primus_turbo/attention_bf16.py)."""
    modules = {
        name: types.ModuleType(name)
        for name in (
            "aiter",
            "aiter.ops",
            "aiter.ops.mha",
            "aiter.ops.triton",
            "aiter.ops.triton.attention",
            "aiter.ops.triton.attention.mha",
            "aiter.ops.triton.attention.mha_onekernel_bwd",
        )
    }
    for name, module in modules.items():
        module.__path__ = []
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    mha = modules["aiter.ops.mha"]
    mha._flash_attn_forward = mha._flash_attn_backward = _not_stood_in
    mha._flash_attn_varlen_forward = _flash_attn_varlen_forward
    mha._flash_attn_varlen_backward = _flash_attn_varlen_backward
    modules["aiter.ops.triton.attention.mha"]._flash_attn_forward = _not_stood_in
    modules["aiter.ops.triton.attention.mha_onekernel_bwd"].flash_attn_onekernel_backward = _not_stood_in
    sys.modules.update(modules)
