"""Primus-Turbo's attention as the backend provides it: bf16 flash attention (AITER's kernels,
:mod:`.attention_bf16`) and FP8 attention (its Triton kernel, :mod:`.attention_fp8`)."""

from __future__ import annotations

import sys

import torch

from ..base import AttentionKernels
from .attention_bf16 import flash_attention, kernel_settings
from .attention_fp8 import FORWARD_OP, fp8_attention
from .release import ATTENTION_BF16_CALLER, ATTENTION_FP8_CALLER, load_api

__all__ = ["TurboAttention"]

_BF16_FORWARD_OPS = ("attention_aiter_forward_impl", "attention_aiter_varlen_forward_impl")
"""Primus-Turbo's bf16 attention forward custom ops (``kernels/attention/attention_aiter_impl.py``)."""


class TurboAttention(AttentionKernels):
    fp8 = True
    bf16 = True

    def __init__(self, device, fp8):
        super().__init__(device, fp8)
        # The bf16 kernels' settings, read once at conversion (the FP8 kernel reads none).
        self.settings = None if fp8 else kernel_settings()

    @classmethod
    def forward_ops(cls):
        ops = {FORWARD_OP}
        if "primus_turbo.pytorch" in sys.modules:  # never imported off MI300-class GPUs
            ops |= {getattr(torch.ops.primus_turbo, name).default for name in _BF16_FORWARD_OPS}
        return frozenset(ops)

    @staticmethod
    def unavailable(fp8):
        api = load_api()
        caller = ATTENTION_FP8_CALLER if fp8 else ATTENTION_BF16_CALLER
        return None if isinstance(api, str) else api.differs.get(caller)

    @staticmethod
    def bf16_refusal(head_dims):
        if head_dims and any(d % 8 for d in head_dims):
            return f"head dims {head_dims}: AITER's kernels take multiples of 8"
        return None

    def fp8_attention(self, q, k, v, *, causal, softmax_scale):
        return fp8_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)

    def flash_attention(self, q, k, v, cu_seqlens, max_seqlen, *, softmax_scale, causal, window):
        return flash_attention(
            q,
            k,
            v,
            cu_seqlens,
            max_seqlen,
            softmax_scale=softmax_scale,
            causal=causal,
            window=window,
            settings=self.settings,
        )
