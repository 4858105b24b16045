"""The emulated FP8 grouped GEMM (MoE experts): FP8 values held in bfloat16 (exact) through
``torch._grouped_mm``, the scales taken out after, without a host sync."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...fp8.scaling import quantize, quantize_per_group, unscale
from ...fsdp_fp8.gathered import Fp8GatheredWeight
from ...grouping import group_ids, zero_trailing_rows
from ...recipes import Fp8Recipe
from ..base import kept_for_gradients
from .gemm_ops import emulated_fp8_grouped_mm
from .linear import backward_source

__all__ = ["ALIGNMENT", "EmulatedGroupedMM", "padded"]


_NO_SCALE = torch.ones(())


def _operand(x: torch.Tensor, cast, recipe: Fp8Recipe, contract_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values as bfloat16, float32 scale to divide the GEMM result by). FP8 values are exact in
    bfloat16, so a bfloat16 grouped GEMM on them followed by the scales is the FP8 GEMM. An
    expert weight FSDP2 gathered in FP8 is already cast (the all-gather plan sends it only where
    ``cast`` is the forward cast it carries)."""
    if isinstance(x, Fp8GatheredWeight):
        return x.fp8_data().to(torch.bfloat16), x.scale()
    if cast.fmt is None:
        return x.to(torch.bfloat16), _NO_SCALE.to(x.device)
    reduce_dim = contract_dim if cast.granularity == "rowwise" else None
    data, scale = quantize(x, recipe.dtype(cast), reduce_dim, recipe.pow2_scales)
    return data.to(torch.bfloat16), scale


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # Operands in bfloat16, which torch._grouped_mm takes on every device.
    return emulated_fp8_grouped_mm(a, b, offs).to(torch.float32)


def _unscaled(acc: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """A GEMM result with both operands' scales taken out, in the order the kernels apply them."""
    return unscale(unscale(acc, a_scale, recipe.reciprocal_scales), b_scale, recipe.reciprocal_scales)


def _per_row(expert_scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """An [E, 1, C] or [E, C, 1] per-expert scale, gathered for each row by its expert; rows past
    the last group borrow the last expert's (they are zeroed anyway)."""
    if expert_scale.dim() == 0:
        return expert_scale
    return expert_scale.reshape(expert_scale.shape[0], -1)[ids.clamp(max=expert_scale.shape[0] - 1)]


ALIGNMENT = 8
"""torch._grouped_mm needs every stride a multiple of 16 bytes: 8 bfloat16 elements."""


def padded(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``t`` zero-padded at the end of ``dims`` to multiples of ``ALIGNMENT`` (itself if aligned).
    Zeros change no amax and add nothing to a GEMM, and F.pad's backward slices the padding off."""
    pad = [0] * (2 * t.dim())
    for d in dims:
        pad[2 * (t.dim() - 1 - d) + 1] = -t.shape[d] % ALIGNMENT
    return F.pad(t, pad) if any(pad) else t


class EmulatedGroupedMM(torch.autograd.Function):
    """Group boundaries never leave the device (no host sync), so it compiles fullgraph. Takes K
    and N already padded to multiples of ``ALIGNMENT``. Its output is bfloat16 (the dtype
    contract in titan_primus.ops), each gradient bfloat16 cast to its input's dtype, as TorchAO's
    grouped GEMM returns them."""

    @staticmethod
    def forward(ctx, A, B_t, offs, recipe: Fp8Recipe):
        A = zero_trailing_rows(A, offs)  # trailing rows must not enter tensorwise or column amaxes
        ids = group_ids(offs, A.shape[0])
        casts = recipe.output
        a, a_scale = _operand(A, casts.a, recipe, contract_dim=1)  # rowwise: per row over K
        b, b_scale = _operand(B_t, casts.b, recipe, contract_dim=1)  # rowwise: per (expert, n) over K
        out = _unscaled(_grouped_mm(a, b, offs), a_scale, _per_row(b_scale, ids), recipe)
        ctx.save_for_backward(*kept_for_gradients(ctx, A, B_t), offs, ids)
        ctx.recipe = recipe
        return zero_trailing_rows(out, offs).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_out):
        A, B_t, offs, ids = ctx.saved_tensors
        recipe = ctx.recipe
        grad_out = zero_trailing_rows(grad_out, offs)
        grad_A = grad_B = None
        if ctx.needs_input_grad[0]:
            c = recipe.grad_input  # [rows, N] @ [N, K] per group: contract over N
            B_src = backward_source(B_t, recipe.output.b, recipe, 1)
            g, g_scale = _operand(grad_out, c.a, recipe, contract_dim=1)
            b, b_scale = _operand(B_src, c.b, recipe, contract_dim=2)  # rowwise: per (expert, k) over N
            grad_A = _unscaled(_grouped_mm(g, b.transpose(-2, -1), offs), g_scale, _per_row(b_scale, ids), recipe)
            grad_A = zero_trailing_rows(grad_A, offs).to(torch.bfloat16).to(ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            c = recipe.grad_weight  # [K, rows] @ [rows, N] per group: contract over the group's rows
            A_src = backward_source(A, recipe.output.a, recipe, 1)
            if c.a.granularity == "rowwise" and recipe.grouped_wgrad_per_group:
                g, g_scale = quantize_per_group(grad_out, recipe.dtype(c.a), ids, len(offs), recipe.pow2_scales)
                a, a_scale = quantize_per_group(A_src, recipe.dtype(c.b), ids, len(offs), recipe.pow2_scales)
                g, a = g.to(torch.bfloat16), a.to(torch.bfloat16)
                g_scale, a_scale = g_scale[:-1].unsqueeze(1), a_scale[:-1].unsqueeze(2)  # [E,1,N], [E,K,1]
            else:  # one scale per tensor, or per column over all grouped rows at once
                g, g_scale = _operand(grad_out, c.a, recipe, contract_dim=0)
                a, a_scale = _operand(A_src, c.b, recipe, contract_dim=0)
                a_scale = a_scale.t() if a_scale.dim() else a_scale  # [1, K] -> [K, 1]
            grad_B = _unscaled(_grouped_mm(a.t(), g, offs), a_scale, g_scale, recipe).to(torch.bfloat16)
            grad_B = grad_B.to(ctx.b_dtype)
        return grad_A, grad_B, None, None
