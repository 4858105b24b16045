"""What selective activation checkpointing must save for the FP8 GEMMs to run once.

TorchTitan's per-op selective activation checkpointing (0.3: ``SelectiveAC.get_save_ops``; 0.2.x:
each model's ``_op_sac_save_list``) saves the outputs of a fixed set of aten ops and recomputes
everything else in backward. The backends' FP8 GEMMs are other ops (Primus-Turbo's custom ops,
the emulation's, TorchAO's ``_scaled_mm`` on 0.2.x), so without them in that set every FP8 GEMM
runs again in backward: four GEMMs per op per step instead of three. Each backend names its GEMM
ops (``Fp8Backend.fp8_gemm_ops``); the TorchTitan adapters add them to the save set. Torch-only.
"""

from __future__ import annotations

from .registry import backends

__all__ = ["attention_save_ops", "fp8_gemm_save_ops"]


def fp8_gemm_save_ops() -> frozenset:
    """The GEMM ops of every registered backend: saving their outputs keeps each FP8 GEMM out of
    the recomputation. Ops of backends that never run cost nothing there."""
    ops: set = set()
    for backend in backends().values():
        ops |= backend.fp8_gemm_ops()
    return frozenset(ops)


def attention_save_ops() -> frozenset:
    """The forward ops of every registered backend's attention kernels (titan_primus.attention):
    saved like TorchTitan's own attention ops (flex, SDPA and varlen are in its save lists), so
    no attention runs again in backward."""
    ops: set = set()
    for backend in backends().values():
        if (kernels := backend.attention()) is not None:
            ops |= kernels.forward_ops()
    return frozenset(ops)
