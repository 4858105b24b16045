"""Primus-Turbo's FP8 attention (``flash_attn_fp8_func``, blockwise 64) as one opaque op.

``flash_attn_fp8_func`` (``pytorch/ops/attention/flash_attn_interface.py``) quantizes Q, K and V
in plain torch (``block_scaling_node``, ``attention_utils.py``) inside an autograd Function:
traced by torch.compile, inductor fuses that quantization without its bf16 roundings and the FP8
codes differ from eager; and it permutes its inputs by the memory layout it infers, which
attends over the wrong axis (or crashes) for logical bshd tensors with bhsd or sbhd memory.

Here the same calls, in the same order, run inside ``titan_primus::primus_turbo_fp8_attention_forward``
(with a fake): Primus-Turbo's ``block_scaling_node`` on contiguous bshd Q, K and V, then its
``primus_turbo::attention_triton_forward_impl``. Backward calls Primus-Turbo's own
``primus_turbo::attention_triton_backward_impl`` with the arguments ``TritonFlashAttnFunc.backward``
passes, so compiled graphs hold one opaque forward op and Primus-Turbo's backward op, and eager
results equal ``flash_attn_fp8_func``'s bit for bit.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..emulated.attention import ATTENTION_BLOCK, check_fp8_attention_inputs
from .release import require_api

__all__ = ["FORWARD_OP", "fp8_attention"]

_UTILS_MODULE = "primus_turbo.pytorch.ops.attention.attention_utils"
_NO_WINDOW = -1  # window_size (-1, -1): the Triton kernel asserts it


def _utils():
    require_api()
    return importlib.import_module(_UTILS_MODULE)


def _turbo_ops():
    return torch.ops.primus_turbo


@functools.cache
def _cu_seqlens_not_given():
    """What ``TritonFlashAttnFunc`` passes as cu_seqlens_q/k for dense inputs: 0 where the
    backward op's schema types them ``int`` (v0.3.1), None where ``Optional[Tensor]`` (later)."""
    schema = _turbo_ops().attention_triton_backward_impl.default._schema
    cu_seqlens = next(arg for arg in schema.arguments if arg.name == "cu_seqlens_q")
    return 0 if str(cu_seqlens.type) == "int" else None


@torch.library.custom_op("titan_primus::primus_turbo_fp8_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(out, then what backward needs: FP8 q, k, v (B, L, H, D), their descales (B, H, L/64), the
    LSE/Delta buffer (B, Hq, 2L)), as ``TritonFlashAttnFunc.forward`` computes and saves them."""
    utils = _utils()
    q8, q_descale = utils.block_scaling_node(q.contiguous(), True)
    k8, k_descale = utils.block_scaling_node(k.contiguous(), True)
    v8, v_descale = utils.block_scaling_node(v.contiguous(), True)
    out, lse, _ = _turbo_ops().attention_triton_forward_impl(
        q=q8,
        k=k8,
        v=v8,
        p_scale=utils.get_p_scale(True),
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size_left=_NO_WINDOW,
        window_size_right=_NO_WINDOW,
        bias=None,
        alibi_slopes=None,
        return_softmax=False,
        use_fp8=True,
    )
    # Primus-Turbo allocates its output with requires_grad=True (attention_triton_impl.py, every
    # build here); an op's autograd is this op's registration, and its fake says so.
    return out.detach(), q8, k8, v8, q_descale, k_descale, v_descale, lse


@_forward_op.register_fake
def _(q, k, v, causal, softmax_scale):
    fp8_dtype = _utils().get_f8_fwd_dtype()
    B, L, Hq, _ = q.shape
    Hkv, blocks = k.shape[2], L // ATTENTION_BLOCK
    fp8 = [t.new_empty(t.shape, dtype=fp8_dtype) for t in (q, k, v)]
    descales = [q.new_empty((B, heads, blocks), dtype=torch.float32) for heads in (Hq, Hkv, Hkv)]
    out = q.new_empty((B, L, Hq, v.shape[3]), dtype=torch.bfloat16)
    return out, *fp8, *descales, q.new_empty((B, Hq, 2 * L), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.dtypes = (q.dtype, k.dtype, v.dtype)
    out, *saved = output
    ctx.save_for_backward(out, *saved)


def _backward(ctx, dout, *unused_grads):
    out, q8, k8, v8, q_descale, k_descale, v_descale, lse = ctx.saved_tensors
    cu_seqlens = _cu_seqlens_not_given()
    dq, dk, dv = _turbo_ops().attention_triton_backward_impl(
        do=dout,
        q=q8,
        k=k8,
        v=v8,
        o=out,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        p_scale=_utils().get_p_scale(True),
        softmax_lse_delta=lse,
        dq=None,  # dq, dk, dv: allocated by the op (fp32)
        dk=None,
        dv=None,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=q8.shape[1],
        max_seqlen_k=k8.shape[1],
        softmax_scale=ctx.softmax_scale,
        causal=ctx.causal,
        window_size_left=_NO_WINDOW,
        window_size_right=_NO_WINDOW,
        alibi_slopes=None,
        use_fp8=True,
    )
    # fp32 out of the kernel; autograd casts them to the inputs' dtypes after flash_attn_fp8_func too.
    dq, dk, dv = (g.to(dtype) for g, dtype in zip((dq, dk, dv), ctx.dtypes))
    return dq, dk, dv, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
FORWARD_OP = torch.ops.titan_primus.primus_turbo_fp8_attention_forward.default
"""The forward op, whose outputs selective activation checkpointing saves (titan_primus.checkpointing)."""


def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float | None
) -> torch.Tensor:
    """``flash_attn_fp8_func(q, k, v, softmax_scale=..., causal=...)`` of logical bshd bf16 q
    (B, L, Hq, D), k and v (B, L, Hkv, D), whatever their memory layout: (B, L, Hq, Dv) bf16."""
    check_fp8_attention_inputs(q, k, v)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    return _forward_op(q, k, v, causal, float(softmax_scale))[0]
