"""The scale math every backend shares: amax -> scale -> saturated cast, and back.

scale = finfo(fp8).max / max(amax, 1e-12), computed in float64 and stored as float32 (as TorchAO
does, so eager and compiled code agree); optionally floored to a power of two. Values are
clamped to +-finfo(fp8).max before the cast because an out-of-range cast to e4m3fnuz gives NaN
in eager PyTorch, while e4m3fn saturates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..recipes import Fp8Recipe, OperandCast

__all__ = [
    "AMAX_EPS",
    "amax_to_scale",
    "scaled_cast",
    "quantize",
    "unscale",
    "dequantize",
    "fake_quantize",
    "quantize_per_group",
]

AMAX_EPS = 1e-12


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    scale = (torch.finfo(fp8_dtype).max / amax.to(torch.float64).clamp(min=AMAX_EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, saturated to +-finfo(fp8_dtype).max, cast to ``fp8_dtype``."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.to(torch.float32) * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def quantize(
    x: torch.Tensor, fp8_dtype: torch.dtype, reduce_dim: int | None, pow2: bool, amax_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to ``fp8_dtype``; ``reduce_dim=None`` is one scale for the tensor, else one scale
    per slice, the amax taken over ``reduce_dim``. ``amax_group``: the process group holding the
    other shards of ``x`` along the reduced dimension(s); the amax is the maximum across it.
    Returns (fp8 data, float32 scale)."""
    magnitude = x.detach().abs()
    amax = magnitude.amax() if reduce_dim is None else magnitude.amax(dim=reduce_dim, keepdim=True)
    if amax_group is not None:
        if torch.compiler.is_compiling():  # traceable form
            amax = funcol.all_reduce(amax, "max", amax_group)
        else:
            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
    scale = amax_to_scale(amax, fp8_dtype, pow2)
    return scaled_cast(x, scale, fp8_dtype), scale


def unscale(t: torch.Tensor, scale: torch.Tensor, reciprocal: bool) -> torch.Tensor:
    """``t`` with ``scale`` taken out: divided by it, or (``reciprocal``, as the FP8 kernels of
    Primus-Turbo and TorchAO do) multiplied by its float32 reciprocal; the two differ in the last
    bit."""
    return t * torch.reciprocal(scale) if reciprocal else t / scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, reciprocal: bool = False) -> torch.Tensor:
    return unscale(data.to(torch.float32), scale, reciprocal)


def fake_quantize(
    x: torch.Tensor,
    cast: OperandCast,
    recipe: Fp8Recipe,
    contract_dim: int,
    sharded_dim: int | None = None,
    group=None,
) -> torch.Tensor:
    """``x`` as the GEMM sees it after the cast, in float32. ``contract_dim`` is the dimension of
    ``x`` the GEMM reduces over: rowwise scales take their amax over it. ``sharded_dim``: the
    dimension of ``x`` split across ``group`` (tensor parallelism), if any: an amax over it is
    reduced across the group."""
    if cast.fmt is None:
        return x.to(torch.float32)
    reduce_dim = contract_dim if cast.granularity == "rowwise" else None
    spans_shards = sharded_dim is not None and reduce_dim in (None, sharded_dim)
    data, scale = quantize(x, recipe.dtype(cast), reduce_dim, recipe.pow2_scales, group if spans_shards else None)
    return dequantize(data, scale, recipe.reciprocal_scales)


def quantize_per_group(
    x: torch.Tensor, fp8_dtype: torch.dtype, group_ids: torch.Tensor, num_groups: int, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast the rows of ``x`` [rows, C] with one scale per (group, column), the amax over that
    group's rows (``group_ids`` gives each row's group; id ``num_groups`` means none). Returns
    (fp8 data, scales [num_groups + 1, C]). No host sync, so it traces under torch.compile."""
    magnitude = x.detach().abs().to(torch.float32)
    index = group_ids.unsqueeze(-1).expand_as(magnitude)
    amax = magnitude.new_zeros(num_groups + 1, x.shape[1]).scatter_reduce(0, index, magnitude, "amax")
    scales = amax_to_scale(amax, fp8_dtype, pow2)
    return scaled_cast(x, scales[group_ids], fp8_dtype), scales
