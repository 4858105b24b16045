"""The emulated backend's block-scaled GEMMs (recipes ``mxfp8`` and ``blockwise``).

Each operand is cast in its recipe's blocks (:mod:`titan_primus.fp8.blocks`), the payload
times its cell's scale_inv is multiplied in float32, as the block-scaled kernels multiply FP8
partial products by both operands' scales in float32. Every GEMM re-quantizes from the
high-precision tensors (both upstreams do so for these recipes).

Grouped GEMMs multiply the dequantized operands in float32 (``emulated_fp8_grouped_mm``:
``torch._grouped_mm`` on a CPU, one masked GEMM per expert on GPUs). 1x128-tile scales are not
powers of two, so a bfloat16 product of dequantized values would not be exact.
"""

from __future__ import annotations

import torch

from ...fp8.blocks import cells_of, dequantize, quantize_blocks
from ...fsdp_fp8.gathered import Fp8GatheredWeight
from ...grouping import zero_trailing_rows
from ...recipes import Fp8Recipe, OperandCast
from ..base import kept_for_gradients
from .gemm_ops import emulated_block_cast, emulated_fp8_grouped_mm, emulated_fp8_mm

__all__ = ["blocked_linear", "blocked_grouped_mm"]


def _cast(t: torch.Tensor, cast: OperandCast, recipe: Fp8Recipe, segments: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` [rows, contracted] (or [E, rows, contracted], blocks per expert) as the GEMM sees it
    after the cast, float32. ``segments``: group end offsets along the contracted dimension. A
    weight FSDP2 gathered in FP8 is already cast: the all-gather plan sends it only where its
    square blocks are this cast's."""
    if isinstance(t, Fp8GatheredWeight):
        return t.dequantize()
    if cast.fmt is None:
        return t.to(torch.float32)
    if segments is None:
        rule = recipe.block_scale
        return emulated_block_cast(
            t, recipe.dtype(cast), *cast.block, rule.kind, rule.amax_eps, rule.float64, rule.rounding or ""
        )
    cells = cells_of(tuple(t.shape), cast.block, t.device, segments)
    data, scale_inv = quantize_blocks(t, recipe.dtype(cast), recipe.block_scale, cells)
    return dequantize(data, scale_inv, cells)


def _cast_transposed(t: torch.Tensor, cast: OperandCast, recipe: Fp8Recipe) -> torch.Tensor:
    """``_cast(t.transpose(-2, -1), cast).transpose(-2, -1)``: the weight as grad_input reads it
    (blocks laid out along N). Where ``cast`` is the forward's and its blocks are square, those
    are the forward's blocks, so this is the forward cast itself, bit for bit (one cast of the
    weight in backward, not two)."""
    if cast == recipe.output.b and cast.block[0] == cast.block[1]:
        return _cast(t, cast, recipe)
    return _cast(t.transpose(-2, -1), cast, recipe).transpose(-2, -1)


def _no_autocast(t: torch.Tensor):
    return torch.autocast(device_type=t.device.type, enabled=False)


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on (what F.linear would return), else ``t``'s."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


class _BlockedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe):
        out_dtype = _out_dtype(x)
        with _no_autocast(x):
            ctx.save_for_backward(*kept_for_gradients(ctx, x, weight))
            ctx.recipe, ctx.has_bias = recipe, bias is not None
            c = recipe.output  # [M, K] @ [N, K]^T
            out = emulated_fp8_mm(_cast(x, c.a, recipe), _cast(weight, c.b, recipe).t())
            out = out.to(recipe.gemm_out_dtype(out_dtype)).to(out_dtype)
            # Bias is added in the output's dtype, after the GEMM, as the backends add it.
            return out if bias is None else out + bias.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad_out):
            # The gradient of the GEMM's output as the kernels wrote it (16-bit for Primus-Turbo).
            gemm_dtype = recipe.gemm_out_dtype(grad_out.dtype)
            grad_gemm = grad_out.to(gemm_dtype)
            if ctx.needs_input_grad[0]:
                c = recipe.grad_input  # [M, N] @ [K, N]^T: contract over N
                grad_x = emulated_fp8_mm(_cast(grad_gemm, c.a, recipe), _cast_transposed(weight, c.b, recipe))
                grad_x = grad_x.to(gemm_dtype).to(ctx.a_dtype)
            if ctx.needs_input_grad[1]:
                c = recipe.grad_weight  # [N, M] @ [K, M]^T: contract over M
                grad_w = emulated_fp8_mm(_cast(grad_gemm.t(), c.a, recipe), _cast(x.t(), c.b, recipe).t())
                grad_w = grad_w.to(gemm_dtype).to(ctx.b_dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = grad_out.to(torch.float32).sum(0).to(grad_out.dtype)
        return grad_x, grad_w, grad_b, None


def _per_expert(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row r of the result is a[r] @ b[expert of r].T: a [R, C], b [E, N, C]; rows of no expert are 0."""
    return zero_trailing_rows(emulated_fp8_grouped_mm(a, b.transpose(-2, -1), offs), offs)


def _per_group_outer(g: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[E, N, K]: entry e is g[:, rows of e] @ a[:, rows of e].T, for g [N, R] and a [K, R]."""
    return emulated_fp8_grouped_mm(g, a.t(), offs)


class _BlockedGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B_t, offs, recipe: Fp8Recipe):
        with _no_autocast(A):
            A = zero_trailing_rows(A, offs)
            c = recipe.output  # per expert: [rows, K] @ [N, K]^T
            out = _per_expert(_cast(A, c.a, recipe), _cast(B_t.transpose(-2, -1), c.b, recipe), offs)
            ctx.save_for_backward(*kept_for_gradients(ctx, A, B_t), offs)
            ctx.recipe = recipe
            return out.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_out):
        A, B_t, offs = ctx.saved_tensors
        recipe = ctx.recipe
        grad_A = grad_B = None
        with _no_autocast(grad_out):
            grad_out = zero_trailing_rows(grad_out, offs)
            if ctx.needs_input_grad[0]:
                c = recipe.grad_input  # per expert: [rows, N] @ [K, N]^T, B_t cast with its blocks along N
                b = _cast_transposed(B_t.transpose(-2, -1), c.b, recipe).transpose(-2, -1)
                grad_A = _per_expert(_cast(grad_out, c.a, recipe), b, offs).to(ctx.a_dtype)
            if ctx.needs_input_grad[1]:
                c = recipe.grad_weight  # per expert: [N, rows] @ [K, rows]^T, token blocks per group
                g = _cast(grad_out.t(), c.a, recipe, segments=offs)
                a = _cast(A.t(), c.b, recipe, segments=offs)
                grad_B = _per_group_outer(g, a, offs).transpose(-2, -1).to(ctx.b_dtype)
        return grad_A, grad_B, None, None


def blocked_linear(x, weight, bias, recipe: Fp8Recipe) -> torch.Tensor:
    return _BlockedLinear.apply(x, weight, bias, recipe)


def blocked_grouped_mm(A, B_t, offs, recipe: Fp8Recipe) -> torch.Tensor:
    return _BlockedGroupedMM.apply(A, B_t, offs, recipe)
