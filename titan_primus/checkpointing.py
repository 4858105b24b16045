"""What selective activation checkpointing must save for the FP8 GEMMs to run once.

TorchTitan's per-op selective activation checkpointing (0.3: ``SelectiveAC.get_save_ops``; 0.2.x:
each model's ``_op_sac_save_list``) saves the outputs of a fixed set of aten ops and recomputes
everything else in backward. The backends' FP8 GEMMs are other ops (Primus-Turbo's custom ops,
the emulation's, TorchAO's ``_scaled_mm`` on 0.2.x), so without them in that set every FP8 GEMM
runs again in backward: four GEMMs per op per step instead of three. Each backend names its GEMM
ops (``Fp8Backend.fp8_gemm_ops``); the TorchTitan adapters add them to the save set. Torch-only.
"""

from __future__ import annotations

import sys

import torch

from .registry import backends

__all__ = ["attention_save_ops", "fp8_gemm_save_ops"]

_TURBO_ATTENTION_OPS = ("attention_aiter_forward_impl", "attention_aiter_varlen_forward_impl")
"""Primus-Turbo's bf16 attention forward custom ops (``kernels/attention/attention_aiter_impl.py``)."""


def fp8_gemm_save_ops() -> frozenset:
    """The GEMM ops of every registered backend: saving their outputs keeps each FP8 GEMM out of
    the recomputation. Ops of backends that never run cost nothing there."""
    ops: set = set()
    for backend in backends().values():
        ops |= backend.fp8_gemm_ops()
    return frozenset(ops)


def attention_save_ops() -> frozenset:
    """The forward ops of the attention routes (titan_primus.attention): saved like TorchTitan's
    own attention ops (flex, SDPA and varlen are in its save lists), so no attention runs again
    in backward. The FP8 attention ops always; Primus-Turbo's bf16 ones where it is imported
    (it is never imported off MI300-class GPUs)."""
    from .backends import emulated_attention
    from .backends.primus_turbo import attention_fp8

    ops = {emulated_attention.FORWARD_OP, attention_fp8.FORWARD_OP}
    if "primus_turbo.pytorch" in sys.modules:
        ops |= {getattr(torch.ops.primus_turbo, name).default for name in _TURBO_ATTENTION_OPS}
    return frozenset(ops)
