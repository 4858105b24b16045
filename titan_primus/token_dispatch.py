"""FP8 token dispatch for expert parallelism: routed tokens cross the EP all-to-all as the FP8
payload and scales of the recipe's forward activation cast, packed into one byte tensor.

A recipe qualifies when that cast is row-local (one scale per row, or per 1x32 MX tile along
the hidden dimension) and re-quantizing its dequantized copy reproduces the same values:
then quantizing before the all-to-all gives the expert GEMMs' forward exactly what quantizing
the received rows would. The receiving rank dequantizes the rows and the grouped GEMMs cast them
as always, so every backend runs unchanged. What changes is the weight gradient of w1/w3: its
token-dimension cast starts from the dispatched FP8 copy, as DeepSeek-V3 and Primus-Turbo's
rowwise backward do (``Fp8Recipe.fp8_dispatch``; which recipes qualify, and why the others do
not, is recipe data: ``Fp8Recipe.fp8_dispatch_refusal``). Combine, and every gradient's
all-to-all, stay in the activations' dtype.

:func:`fp8_copy` is that definition without the transport (expert parallelism of degree 1);
:func:`fp8_all_to_all` is the transport. Nothing here synchronises with the host, so both trace
under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol

from .fp8 import blocks
from .grouping import rows_known
from .recipes import BlockScaleRule, Fp8Recipe
from .fp8.scaling import dequantize, quantize

__all__ = ["DispatchCast", "fp8_dispatch_cast", "fp8_copy", "fp8_all_to_all", "packed_row_bytes"]


@dataclass(frozen=True)
class DispatchCast:
    """The forward activation cast of a recipe's grouped GEMMs, applied to [rows, hidden] tokens
    before they leave the rank: one float32 scale per row (``mx_rule`` None), or one E8M0 scale
    per 1x32 tile (``mx_rule``: the recipe's rounding)."""

    fp8_dtype: torch.dtype
    pow2: bool = False
    reciprocal: bool = False
    mx_rule: BlockScaleRule | None = None

    def scale_bytes(self, hidden: int) -> int:
        """Bytes of scales per row: a float32 per row, or one E8M0 byte per 1x32 tile."""
        return -(-hidden // _MX_TILE) if self.mx_rule else 4

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 payload [R, D], scales [R, S]): float32 row scales, or E8M0 bytes (uint8). No
        rows (an empty split of the all-to-all): empty tensors, no quantizer run on them."""
        if rows_known(x) is False:
            scale_dtype, scale_width = (
                (torch.uint8, self.scale_bytes(x.shape[1])) if self.mx_rule else (torch.float32, 1)
            )
            return x.new_empty(x.shape, dtype=self.fp8_dtype), x.new_empty((0, scale_width), dtype=scale_dtype)
        if self.mx_rule is None:
            return quantize(x, self.fp8_dtype, 1, self.pow2)
        data, scale_inv = blocks.quantize_blocks(x, self.fp8_dtype, self.mx_rule, self._tiles(x))
        return data, (torch.frexp(scale_inv)[1] + (_E8M0_BIAS - 1)).to(torch.uint8)

    def dequantize(self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows as the grouped GEMMs' cast sees them (payload and scales, as the emulation
        applies them), in ``dtype``."""
        if rows_known(data) is False:
            return data.new_empty(data.shape, dtype=dtype)
        if self.mx_rule is None:
            return dequantize(data, scales, self.reciprocal).to(dtype)
        scale_inv = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - _E8M0_BIAS)
        return blocks.dequantize(data, scale_inv, self._tiles(data)).to(dtype)

    def _tiles(self, x: torch.Tensor) -> blocks.BlockCells:
        return blocks.cells_of(tuple(x.shape), (1, _MX_TILE), x.device)


_MX_TILE = 32
_E8M0_BIAS = 127


def fp8_dispatch_cast(recipe: Fp8Recipe) -> DispatchCast | None:
    """The cast ``recipe``'s routed tokens cross the EP all-to-all in (:func:`fp8_all_to_all`),
    where the recipe has FP8 token dispatch (``recipe.fp8_dispatch``, see ``with_fp8_dispatch``);
    None where they cross it in the activations' dtype. The dispatchers take their cast from here,
    so what they send is what the recipe (and its ``describe()``) says."""
    if not recipe.fp8_dispatch:
        return None
    cast = recipe.output.a
    mx_rule = recipe.block_scale if cast.granularity == "block" else None
    return DispatchCast(recipe.dtype(cast), recipe.pow2_scales, recipe.reciprocal_scales, mx_rule)


def _copy(x: torch.Tensor, cast: DispatchCast) -> tuple[torch.Tensor, torch.Tensor]:
    # The experts cast their input to bfloat16 before the grouped GEMMs (TorchTitan's
    # GroupedExperts.forward), so the copy is that of the bfloat16 rows.
    return cast.quantize(x.detach().to(torch.bfloat16))


def fp8_copy(x: torch.Tensor, cast: DispatchCast) -> torch.Tensor:
    """``x`` [R, D] as FP8 dispatch delivers it, without moving it: the forward FP8 copy,
    dequantized to ``x``'s dtype. Gradients pass straight through, as through the transport
    (adding ``x - x``, exactly zero for finite ``x``, leaves the copy's values as they are)."""
    return cast.dequantize(*_copy(x, cast), x.dtype) + (x - x.detach())


def packed_row_bytes(hidden: int, cast: DispatchCast) -> int:
    """Bytes one routed token costs on the wire: FP8 payload plus its scales."""
    return hidden + cast.scale_bytes(hidden)


def _pack(x: torch.Tensor, cast: DispatchCast) -> torch.Tensor:
    data, scales = _copy(x, cast)
    return torch.cat([data.view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)


def _unpack(packed: torch.Tensor, cast: DispatchCast, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    data = packed[:, :hidden].view(cast.fp8_dtype)
    scales = packed[:, hidden:].contiguous()
    if cast.mx_rule is None:
        scales = scales.view(torch.float32)
    return cast.dequantize(data, scales, dtype)


class _Unpacked(torch.autograd.Function):
    """The received rows, dequantized; their gradient goes back through the reverse all-to-all.
    The forward all-to-all runs outside, on bytes that need no gradient: traced inside an
    autograd.Function whose output feeds the grouped GEMM's Function, it failed to compile
    (Dynamo's "lift_tracked_freevar_to_input should not be called on root SubgraphTracer",
    torch 2.14.1)."""

    @staticmethod
    def forward(ctx, x, packed, cast: DispatchCast, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _unpack(packed, cast, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad = funcol.all_to_all_single(grad.contiguous(), input_splits, output_splits, ctx.group)
        return funcol.wait_tensor(grad), None, None, None, None, None


def fp8_all_to_all(
    x: torch.Tensor, cast: DispatchCast, output_splits: list[int], input_splits: list[int], group
) -> torch.Tensor:
    """The EP all-to-all of routed tokens ``x`` [N, D] (rows split by ``input_splits`` among the
    ranks of ``group``) in FP8: one packed uint8 all-to-all of payload and scales; what each rank
    receives [R, D] is :func:`fp8_copy` of the rows sent to it. The gradient's all-to-all runs
    in ``x``'s dtype."""
    packed = funcol.all_to_all_single(_pack(x, cast), output_splits, input_splits, group)
    return _Unpacked.apply(x, funcol.wait_tensor(packed), cast, output_splits, input_splits, group)
