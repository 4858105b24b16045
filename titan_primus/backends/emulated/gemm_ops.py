"""The emulated backend's GEMMs, and its regular-block casts, as ops of their own.

Every emulated FP8 GEMM multiplies FP8 values (dequantized to float32, or held exactly in
bfloat16) in high precision. Run as plain ``aten.mm`` / ``aten._grouped_mm`` they would be
indistinguishable from the model's high-precision matmuls: TorchTitan's selective activation
checkpointing recomputes every second ``aten.mm`` in backward (and ``aten._grouped_mm`` always),
and a GEMM count could not tell them apart. As the ops ``titan_primus::emulated_fp8_mm`` and
``titan_primus::emulated_fp8_grouped_mm`` they are what ``EmulatedBackend.fp8_gemm_ops`` names,
as the other backends name their kernels. Inductor runs them as opaque calls of the same aten
kernels eager mode runs, so compiled results equal eager ones. Each call is a profiler event of
the op's name (ops defined in Python get none of their own), so profiles show them as they show
the other backends' kernels.
"""

from __future__ import annotations

import torch

from ...fp8.blocks import dequantize_matrices, quantize_matrices
from ...grouping import group_ids
from ...recipes import BlockScaleRule

__all__ = ["CAST_OPS", "GEMM_OPS", "emulated_block_cast", "emulated_fp8_grouped_mm", "emulated_fp8_mm"]


# flexible_layout: inductor may lay the operands out as it likes (as for aten.mm); with the
# eager strides imposed, it fuses the casts of a tensor and of its transpose into one CPU kernel
# its loop splitting cannot generate (torch 2.14: "AssertionError" in try_loop_split).
_ANY_LAYOUT = (torch.Tag.flexible_layout,)


@torch.library.custom_op("titan_primus::emulated_fp8_mm", mutates_args=(), tags=_ANY_LAYOUT)
def emulated_fp8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands of one dtype."""
    with torch.profiler.record_function("titan_primus::emulated_fp8_mm"):
        return torch.mm(a, b)


@emulated_fp8_mm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("titan_primus::emulated_fp8_grouped_mm", mutates_args=(), tags=_ANY_LAYOUT)
def emulated_fp8_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for a 2-D ``a`` and a 3-D ``b`` (groups of a's rows,
    [R, N]) or a 2-D ``b`` (groups along the contracted dim, [E, M, N]), in a's dtype. Rows past
    the last group are left unspecified (the callers zero them). Where ``torch._grouped_mm``
    cannot take the dtype (float32 off the CPU), one masked GEMM per group."""
    with torch.profiler.record_function("titan_primus::emulated_fp8_grouped_mm"):
        return _grouped_mm(a, b, offs)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu" or a.dtype == torch.bfloat16:
        return torch._grouped_mm(_aligned(a), _aligned(b), offs=offs)
    if b.dim() == 3:
        ids = group_ids(offs, a.shape[0]).unsqueeze(1)
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e in range(b.shape[0]):
            out = torch.where(ids == e, a @ b[e], out)
        return out
    ids = group_ids(offs, a.shape[1])
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.stack([torch.where(ids == e, a, zero) @ b for e in range(len(offs))])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy laid out with every non-unit stride a multiple of 16 bytes (what
    torch._grouped_mm asks; inductor lays operands out as it likes): its last two dims
    row-major, else column-major. The callers pad one of them to alignment."""

    def aligned(u):
        return all(stride * u.element_size() % 16 == 0 for stride in u.stride() if stride != 1)

    if aligned(t):
        return t
    row_major = t.contiguous()
    return row_major if aligned(row_major) else t.transpose(-2, -1).contiguous().transpose(-2, -1)


@emulated_fp8_grouped_mm.register_fake
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))


@torch.library.custom_op("titan_primus::emulated_block_cast", mutates_args=(), tags=_ANY_LAYOUT)
def emulated_block_cast(
    t: torch.Tensor,
    fp8_dtype: torch.dtype,
    block_rows: int,
    block_cols: int,
    kind: str,
    amax_eps: float,
    float64: bool,
    rounding: str,
) -> torch.Tensor:
    """``t`` [..., R, C] cast to ``fp8_dtype`` in regular ``block_rows`` x ``block_cols`` blocks (per
    matrix of the leading dims) and dequantized: the float32 values a block-scaled GEMM multiplies.
    An op of its own for torch.compile: as inductor code, a tensor's cast and its transpose's
    (the forward's input tiles and the wgrad's, both in backward under activation checkpointing)
    fuse into one CPU kernel its loop splitting cannot generate (torch 2.14: "AssertionError" in
    try_loop_split, under TorchTitan's --compile.enable); opaque, it runs eager mode's code."""
    rule = BlockScaleRule(kind, amax_eps, float64, rounding or None)
    data, scale_inv = quantize_matrices(t, fp8_dtype, rule, (block_rows, block_cols))
    return dequantize_matrices(data, scale_inv, (block_rows, block_cols)).contiguous()  # as the fake says


@emulated_block_cast.register_fake
def _(t, fp8_dtype, block_rows, block_cols, kind, amax_eps, float64, rounding):
    return t.new_empty(t.shape, dtype=torch.float32)


GEMM_OPS = frozenset(
    {torch.ops.titan_primus.emulated_fp8_mm.default, torch.ops.titan_primus.emulated_fp8_grouped_mm.default}
)
"""Every GEMM the emulated backend runs, forward and backward, on every recipe."""

CAST_OPS = frozenset({torch.ops.titan_primus.emulated_block_cast.default})
"""The emulated backend's FP8 casts that run as ops of their own: each call is one cast (its
FP8 payload never leaves the op)."""
