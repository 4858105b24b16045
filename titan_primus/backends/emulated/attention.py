"""The emulated backend's FP8 attention: Primus-Turbo's ``flash_attn_fp8_func`` (blockwise, 64),
computed in PyTorch, forward and backward.

The definition is Primus-Turbo's Triton kernel (``triton/attention/attention_kernel.py``:
``attn_fwd`` / ``_attn_fwd_inner``, ``_bwd_preprocess_use_o``, ``_bwd_kernel_dq`` /
``_attn_bwd_dq``, ``_bwd_kernel_dkdv`` / ``_attn_bwd_dkdv``, identical at v0.3.1 .. v0.4.1.dev26
for Sq == Sk) and its quantization of Q, K and V (``pytorch/ops/attention/attention_utils.py``,
``block_scaling_node``). Every rounding of it is kept: the bf16 arithmetic of the Q/K/V block
scales, the 64-block online softmax with P quantized against the running max, the per-tile dS
scales, the fp32 order of the descale products. Where the kernel leaves the result to the
hardware, the emulation takes:

- FP8 dot products: the exact sum of the FP8 products (float64 holds it: every product of two
  e4m3 values is exact and their sum over 128 terms spans under 53 bits), rounded once to fp32.
  A GPU's MFMA chain, or the Triton interpreter's fp32 matmul, rounds partial sums on the way;
- fp32 sums of fp32 terms (softmax denominators, Delta): summed in float64, rounded once;
- ``exp2`` / ``log2``: torch's fp32 functions (within an ulp, like the GPU's);
- ``tl.fma`` (dK, dV): fused, through float64 (the product of two fp32 values is exact there;
  the sum is rounded twice, which a single rounding can differ from only within 2**-53 of an
  fp32 halfway point).

``flash_attn_fp8_func``'s backward leaves fp32 gradients, which autograd casts to the inputs'
dtype (bf16); here the backward op leaves fp32 too and the cast is explicit.

Two custom ops keep the definition out of inductor's reach (it would fuse the bf16 roundings
away): ``titan_primus::emulated_fp8_attention_forward`` (the output and what backward needs:
FP8 Q/K/V, their descales, the output and the LSE), ``titan_primus::emulated_fp8_attention_backward``
(fp32 gradients, as the kernel leaves them), wired together with ``register_autograd``.
"""

from __future__ import annotations

import math

import torch

from ...attention.site import AttentionSite, fp8_attention_refusal
from ..base import AttentionKernels

__all__ = ["ATTENTION_BLOCK", "FORWARD_OP", "EmulatedAttention", "check_fp8_attention_inputs", "fp8_attention"]

# FIXED_BLOCK_M == FIXED_BLOCK_N (attention_kernel.py): the tiles, and the Q/K/V scale blocks.
ATTENTION_BLOCK = 64
_RCP_LN2 = 1.4426950408889634  # the kernel's constants, as written there
_LN2 = 0.6931471824645996
_AMAX_EPS = 1e-7  # compute_fp8_scaling_factors: fp8_max / (amax + 1e-7)


def _fp8_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``tl.dot(a, b, out_dtype=fp32)`` of FP8 operands: the exact sum, rounded once to fp32."""
    return torch.matmul(a.double(), b.double()).float()


def _fp32_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.double().sum(dim).float()


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``tl.fma(a, b, c)`` in fp32, one rounding."""
    return (a.double() * b.double() + c.double()).float()


def _rdiv(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """``numerator / t`` as the kernel divides (fp32, correctly rounded); torch's ``float / tensor``
    is a reciprocal times the float instead."""
    return torch.full_like(t, numerator) / t


def _block_scaling(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_scaling_node`` (attention_utils.py): ``x`` (B, H, L, D) bf16 -> FP8 (B, H, L, D) and
    fp32 descales (B, H, L/64), one scale per (b, head, 64 tokens). In x's dtype throughout, as
    there: amax (0 -> FMAX), ``FMAX / amax``, ``x * scale`` rounded, clamped, then cast."""
    fmax = torch.finfo(fp8_dtype).max
    B, H, L, D = x.shape
    blocks = x.reshape(B, H, L // ATTENTION_BLOCK, ATTENTION_BLOCK * D)
    amax = blocks.abs().amax(dim=-1)
    amax = torch.where(amax == 0, fmax, amax)
    scale = fmax / amax  # a reciprocal times FMAX in x's dtype, as Primus-Turbo's torch computes it
    scaled = (blocks * scale.unsqueeze(-1)).clamp(-fmax, fmax)
    return scaled.to(fp8_dtype).reshape(B, H, L, D), 1.0 / scale.float()


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, L/64, 64, D)."""
    B, H, L, D = x.shape
    return x.reshape(B, H, L // ATTENTION_BLOCK, ATTENTION_BLOCK, D)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hkv, G, ...): query head h reads kv head h // G (GROUP_SIZE)."""
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _causal_tile_mask(device: torch.device) -> torch.Tensor:
    """Where a diagonal tile is masked: ``OFFS_M >= offs_n`` keeps row >= column."""
    rows = torch.arange(ATTENTION_BLOCK, device=device)
    return rows[:, None] < rows[None, :]


def _forward(q8, k8, v8, q_descale, k_descale, v_descale, causal: bool, softmax_scale: float, fp8_dtype):
    """``attn_fwd``: per (b, q head, 64-row block), KV blocks ascending (causal: to the diagonal)."""
    fmax = torch.finfo(fp8_dtype).max
    kv_heads = k8.shape[1]
    q = _grouped(_blocks(q8), kv_heads).float()  # (B, Hkv, G, nb, 64, D); FP8 values exact in fp32
    k, v = _blocks(k8).unsqueeze(2).float(), _blocks(v8).unsqueeze(2).float()  # (B, Hkv, 1, nb, 64, D)
    qd = _grouped(q_descale, kv_heads)  # (B, Hkv, G, nb)
    kd, vd = k_descale.unsqueeze(2), v_descale.unsqueeze(2)
    nb = q.shape[3]
    row_shape = q.shape[:5]
    m = torch.full(row_shape, -math.inf, device=q.device)
    row_sum = torch.ones(row_shape, device=q.device)  # l_i starts at 1.0 (times alpha = 0 at the first block)
    acc = torch.zeros(*row_shape, v.shape[-1], device=q.device)
    diagonal_mask = _causal_tile_mask(q.device)
    for j in range(nb):
        # Causal: the q blocks i >= j see block j, block i == j (the first of them) masked.
        first = j if causal else 0
        s = _fp8_dot(q[:, :, :, first:], k[:, :, :, j, None].transpose(-2, -1))
        s = s * ((qd[..., first:] * kd[..., j, None]) * softmax_scale)[..., None, None]
        if causal:
            s[:, :, :, 0] = s[:, :, :, 0].masked_fill(diagonal_mask, -math.inf)
        m_old = m[:, :, :, first:]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        p = torch.exp2((s - m_new.unsqueeze(-1)) * _RCP_LN2)
        alpha = torch.exp2((m_old - m_new) * _RCP_LN2)
        row_sum[:, :, :, first:] = row_sum[:, :, :, first:] * alpha + _fp32_sum(p, -1)
        m[:, :, :, first:] = m_new
        # P against the running max, at the static scale FMAX (p *= p_scale; p.to(v.dtype)).
        p8 = (p * fmax).to(fp8_dtype).float()
        pv = _fp8_dot(p8, v[:, :, :, j, None]) * vd[..., j, None, None, None]
        acc[:, :, :, first:] = acc[:, :, :, first:] * alpha.unsqueeze(-1) + pv
    acc = acc * (1.0 / fmax)
    acc = acc * _rdiv(1.0, row_sum).unsqueeze(-1)  # l_recip = 1 / l_i, then a product
    lse = (m * _RCP_LN2 + torch.log2(row_sum)) * _LN2
    B, Hq, L = q8.shape[:3]
    out = acc.to(torch.bfloat16).reshape(B, Hq, L, -1)
    return out, lse.reshape(B, Hq, L)


def _backward(dout, q8, k8, v8, q_descale, k_descale, v_descale, out, lse, causal: bool, softmax_scale: float):
    """``_bwd_preprocess_use_o``, then ``_bwd_kernel_dq`` and ``_bwd_kernel_dkdv``; every 64x64
    tile at once (a masked tile holds exact zeros, so the tiles the kernels skip add nothing),
    the accumulations in the kernels' order."""
    fp8_dtype = q8.dtype  # USE_FP8E5M2_BWD = False: dO and dS are e4m3 too
    fmax = torch.finfo(fp8_dtype).max
    kv_heads = k8.shape[1]
    # Delta and dO per (b, h, 64 rows), dO's scale FMAX / (amax + 1e-7), no clamp.
    o, do = _blocks(out.float()), _blocks(dout.float())  # (B, Hq, nb, 64, D)
    delta = _fp32_sum(o * do, -1)
    do_scale = _rdiv(fmax, do.abs().amax(dim=(-2, -1)) + _AMAX_EPS)
    do8 = (do * do_scale[..., None, None]).to(fp8_dtype).float()
    do_descale = _rdiv(1.0, do_scale)

    q = _grouped(_blocks(q8), kv_heads).float().unsqueeze(4)  # (B, Hkv, G, nb_i, 1, 64, D)
    k, v = (_blocks(t).float()[:, :, None, None] for t in (k8, v8))  # (B, Hkv, 1, 1, nb_j, 64, D)
    qd = _grouped(q_descale, kv_heads)[..., None]  # (B, Hkv, G, nb_i, 1)
    kd, vd = k_descale[:, :, None, None], v_descale[:, :, None, None]  # (B, Hkv, 1, 1, nb_j)
    do8, dod = _grouped(do8, kv_heads).unsqueeze(4), _grouped(do_descale, kv_heads)[..., None]
    lse2 = _grouped(_blocks(lse.unsqueeze(-1)), kv_heads).squeeze(-1).unsqueeze(4) * _RCP_LN2
    delta = _grouped(delta, kv_heads).unsqueeze(4)

    # P~ = FMAX * P from the saved LSE: exp2(s * sm * log2e - lse * log2e + log(FMAX) * log2e).
    s = _fp8_dot(q, k.transpose(-2, -1)) * (qd * kd)[..., None, None]  # (B, Hkv, G, nb_i, nb_j, 64, 64)
    if causal:
        positions = torch.arange(s.shape[3] * ATTENTION_BLOCK, device=s.device).reshape(-1, ATTENTION_BLOCK)
        rows, cols = positions[:, None, :, None], positions[None, :, None, :]  # (nb_i, 1, 64, 1), (1, nb_j, 1, 64)
        s = s.masked_fill(rows < cols, -math.inf)
    p = torch.exp2(s * (softmax_scale * _RCP_LN2) - lse2.unsqueeze(-1) + math.log(fmax) * _RCP_LN2)
    dp = _fp8_dot(do8, v.transpose(-2, -1)) * (dod * vd)[..., None, None]
    ds = p * (dp - delta.unsqueeze(-1))
    ds_scale = _rdiv(fmax, ds.abs().amax(dim=(-2, -1)) + _AMAX_EPS)  # per tile
    ds8 = (ds * ds_scale[..., None, None]).to(fp8_dtype).float()
    p8 = p.to(fp8_dtype).float()

    # dQ: KV blocks ascending, dq += dot(dS, K) * (kd / ds_scale).
    dq_terms = _fp8_dot(ds8, k) * (kd / ds_scale)[..., None, None]
    dq = torch.zeros_like(dq_terms[:, :, :, :, 0])
    for j in range(dq_terms.shape[4]):
        dq = dq + dq_terms[:, :, :, :, j]
    # dK, dV: the group's q heads ascending, each over its q blocks ascending, fused multiply-adds.
    dk_terms = _fp8_dot(ds8.transpose(-2, -1), q)
    dk_descale = qd / ds_scale
    dv_terms = _fp8_dot(p8.transpose(-2, -1), do8)
    dk = torch.zeros_like(dk_terms[:, :, 0, 0])
    dv = torch.zeros_like(dv_terms[:, :, 0, 0])
    for g in range(dk_terms.shape[2]):
        for i in range(dk_terms.shape[3]):
            dk = _fma(dk_terms[:, :, g, i], dk_descale[:, :, g, i, :, None, None], dk)
            dv = _fma(dv_terms[:, :, g, i], dod[:, :, g, i, :, None, None], dv)
    dq = dq * (softmax_scale / fmax)
    dk = dk * (softmax_scale / fmax)
    dv = dv * (1.0 / fmax)
    B, Hq, L = q8.shape[:3]
    return dq.reshape(B, Hq, L, -1), dk.reshape(B, kv_heads, L, -1), dv.reshape(B, kv_heads, L, -1)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 1, 3)


@torch.library.custom_op("titan_primus::emulated_fp8_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, fp8_dtype: torch.dtype
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(out (B, L, Hq, Dv) bf16, then for backward: FP8 q, k, v (B, H, L, D), their descales
    (B, H, L/64) and the LSE (B, Hq, L)) of logical bshd bf16 inputs."""
    with torch.profiler.record_function("titan_primus::emulated_fp8_attention_forward"):
        q8, qd = _block_scaling(_bhsd(q), fp8_dtype)
        k8, kd = _block_scaling(_bhsd(k), fp8_dtype)
        v8, vd = _block_scaling(_bhsd(v), fp8_dtype)
        out, lse = _forward(q8, k8, v8, qd, kd, vd, causal, softmax_scale, fp8_dtype)
        return _bhsd(out).contiguous(), q8, k8, v8, qd, kd, vd, lse


@_forward_op.register_fake
def _(q, k, v, causal, softmax_scale, fp8_dtype):
    B, L, Hq, _ = q.shape
    Hkv, nb = k.shape[2], L // ATTENTION_BLOCK
    fp8 = [t.new_empty((B, t.shape[2], L, t.shape[3]), dtype=fp8_dtype) for t in (q, k, v)]
    descales = [q.new_empty((B, heads, nb), dtype=torch.float32) for heads in (Hq, Hkv, Hkv)]
    out = q.new_empty((B, L, Hq, v.shape[3]), dtype=torch.bfloat16)
    return out, *fp8, *descales, q.new_empty((B, Hq, L), dtype=torch.float32)


@torch.library.custom_op("titan_primus::emulated_fp8_attention_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq, dk, dv), logical bshd, of the output gradient ``dout`` (B, L, Hq, Dv)."""
    with torch.profiler.record_function("titan_primus::emulated_fp8_attention_backward"):
        grads = _backward(
            _bhsd(dout).to(torch.bfloat16),
            q8,
            k8,
            v8,
            q_descale,
            k_descale,
            v_descale,
            _bhsd(out),
            lse,
            causal,
            softmax_scale,
        )
        return tuple(_bhsd(g).contiguous() for g in grads)


@_backward_op.register_fake
def _(dout, q8, k8, v8, q_descale, k_descale, v_descale, out, lse, causal, softmax_scale):
    return tuple(_bhsd(t).new_empty(_bhsd(t).shape, dtype=torch.float32) for t in (q8, k8, v8))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, _ = inputs
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.dtypes = (q.dtype, k.dtype, v.dtype)
    out, *saved = output
    ctx.save_for_backward(*saved, out)


def _backward_autograd(ctx, dout, *unused_grads):
    q8, k8, v8, qd, kd, vd, lse, out = ctx.saved_tensors
    grads = _backward_op(dout, q8, k8, v8, qd, kd, vd, out, lse, ctx.causal, ctx.softmax_scale)
    # The kernel leaves fp32; autograd would cast them to the inputs' dtypes anyway.
    dq, dk, dv = (g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_backward_autograd, setup_context=_setup_context)
FORWARD_OP = torch.ops.titan_primus.emulated_fp8_attention_forward.default
"""The forward op, whose outputs selective activation checkpointing saves (titan_primus.checkpointing)."""


def check_fp8_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What Primus-Turbo's FP8 attention takes: logical (B, L, H, D) bf16, L a multiple of 64
    (``block_scaling_node`` reshapes L into 64-token blocks), Sq == Sk, Hq a multiple of Hkv, and
    the head dims ``fp8_attention_refusal`` allows."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"FP8 attention takes 4-D (B, L, H, D) q, k, v; got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
        raise ValueError(f"FP8 attention takes bf16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"FP8 attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"FP8 attention needs as many queries as keys; got {q.shape[1]} and {k.shape[1]}")
    if q.shape[1] % ATTENTION_BLOCK:
        raise ValueError(
            f"FP8 attention needs a sequence length that is a multiple of {ATTENTION_BLOCK} "
            f"(one scale per {ATTENTION_BLOCK}-token block); got {q.shape[1]}: set training.seq_len to a "
            f"multiple of {ATTENTION_BLOCK}, or turn fp8_attention off"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"FP8 attention needs query heads a multiple of kv heads; got {q.shape[2]} and {k.shape[2]}")
    # The head-dim rules routing applies where an adapter reads them off the config, checked here
    # for every call (shapes only), so no layer reaches Primus-Turbo's asserts or its GQA bug.
    site = AttentionSite(head_dims=(q.shape[3], v.shape[3]), grouped=q.shape[2] != k.shape[2])
    refused = fp8_attention_refusal(site)
    if refused:
        raise ValueError(f"FP8 attention refused: {refused}; turn fp8_attention off for this model")


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    fp8_dtype: torch.dtype,
) -> torch.Tensor:
    """Primus-Turbo's FP8 attention (``flash_attn_fp8_func``, blockwise 64) of logical bshd bf16
    q (B, L, Hq, D), k and v (B, L, Hkv, D): (B, L, Hq, Dv) bf16, differentiable. ``fp8_dtype``:
    float8_e4m3fnuz (gfx942) or float8_e4m3fn (gfx950); ``softmax_scale`` None is D ** -0.5."""
    check_fp8_attention_inputs(q, k, v)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    return _forward_op(q, k, v, causal, float(softmax_scale), fp8_dtype)[0]


class EmulatedAttention(AttentionKernels):
    """The emulated backend's attention: Primus-Turbo's FP8 attention in the device's format;
    bf16 attention stays TorchTitan's own (there is nothing to emulate)."""

    fp8 = True
    performance_path = False  # float64 dot products and a Python loop over 64-token blocks

    @classmethod
    def forward_ops(cls):
        return frozenset({FORWARD_OP})

    def fp8_attention(self, q, k, v, *, causal, softmax_scale):
        return fp8_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, fp8_dtype=self.fp8_format)
