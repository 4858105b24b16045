"""The emulated FP8 linear: the three GEMMs of ``x @ weight.T`` on fake-quantized operands
(``fake_quantize``: cast to FP8 and back), multiplied in float32 and rounded as the kernels round
each result."""

from __future__ import annotations

import torch

from ...fp8.scaling import fake_quantize
from ...fsdp_fp8.gathered import Fp8GatheredWeight
from ...recipes import Fp8Recipe, GemmCasts
from ..base import TensorParallelShards, kept_for_gradients
from .gemm_ops import emulated_fp8_mm

__all__ = ["EmulatedLinear", "backward_source"]


def backward_source(t: torch.Tensor, forward_cast, recipe: Fp8Recipe, contract_dim: int, *shard) -> torch.Tensor:
    """What backward re-quantizes ``t`` from: ``t`` itself, or (Primus-Turbo >= v0.3.1, rowwise)
    its forward FP8 copy dequantized to ``t``'s dtype."""
    if recipe.backward_from_fp8 and forward_cast.granularity == "rowwise":
        return _cast(t, forward_cast, recipe, contract_dim, *shard).to(t.dtype)
    return t


def _cast(t: torch.Tensor, cast, recipe: Fp8Recipe, contract_dim: int, *shard) -> torch.Tensor:
    """``fake_quantize``, except that a weight FSDP2 gathered in FP8 is already cast: the
    all-gather plan sends it only where ``cast`` is the forward cast it carries."""
    if isinstance(t, Fp8GatheredWeight):
        return t.dequantize()
    return fake_quantize(t, cast, recipe, contract_dim, *shard)


def _no_autocast(t: torch.Tensor):
    """The emulated GEMMs must run in float32 even where the model runs under autocast (TorchTitan
    enables bf16 autocast on a single device): a bf16 matmul would round the exact result."""
    return torch.autocast(device_type=t.device.type, enabled=False)


def _gemm_result(out: torch.Tensor, gemm: GemmCasts, recipe: Fp8Recipe, dtype: torch.dtype) -> torch.Tensor:
    """A float32 GEMM result in ``dtype``, rounded as the kernels round it. TorchAO runs an FP8
    GEMM with a rowwise-scaled operand in bfloat16 and casts float16/float32 results from there
    (torchao/float8/float8_ops.py: ``preprocess_addmm`` repeats a tensorwise scale beside a
    rowwise one, ``addmm_float8_unwrapped`` then asks torch._scaled_mm, which has no float32
    output for rowwise scales, for bfloat16), so even its float32 linears round through bfloat16;
    Primus-Turbo's GEMMs write 16-bit results only (``Fp8Recipe.sixteen_bit_gemms``)."""
    fp8 = gemm.a.fmt is not None and gemm.b.fmt is not None
    rowwise = fp8 and "rowwise" in (gemm.a.granularity, gemm.b.granularity)
    if rowwise and recipe.definition == "torchao" and dtype != torch.bfloat16:
        out = out.to(torch.bfloat16)
    return out.to(recipe.gemm_out_dtype(dtype)).to(dtype)


class EmulatedLinear(torch.autograd.Function):
    """Every GEMM returns x's dtype, the dtype the model computes in (the dtype contract in
    titan_primus.ops): the output and grad_input in it, grad_weight in it too before the cast
    to the weight's dtype (as autograd casts TorchAO's and nn.Linear-under-autocast's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, shards: TensorParallelShards | None):
        with _no_autocast(x):
            return EmulatedLinear._forward(ctx, x, weight, bias, recipe, shards)

    @staticmethod
    def _forward(ctx, x, weight, bias, recipe: Fp8Recipe, shards):
        ctx.save_for_backward(*kept_for_gradients(ctx, x, weight))
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        # (sharded dim, group) of x, weight and grad_output; () without tensor parallelism.
        ctx.x_shard, ctx.w_shard, ctx.g_shard = (
            [(d, shards.group) for d in (shards.input_dim, shards.weight_dim, shards.grad_output_dim)]
            if shards
            else [(), (), ()]
        )
        casts = recipe.output
        x_q = fake_quantize(x, casts.a, recipe, 1, *ctx.x_shard)
        out = _gemm_result(
            emulated_fp8_mm(x_q, _cast(weight, casts.b, recipe, 1, *ctx.w_shard).t()), casts, recipe, x.dtype
        )
        # Bias is added in the output's dtype, after the GEMM, as TorchAO's Float8Linear does.
        return out if bias is None else out + bias.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with _no_autocast(grad_out):
            return EmulatedLinear._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, xs, ws, gs = ctx.recipe, ctx.x_shard, ctx.w_shard, ctx.g_shard
        grad_x = grad_w = grad_b = None
        # The gradient of the GEMM's output as the kernels wrote it (16-bit for Primus-Turbo);
        # the bias, added after the GEMM, takes grad_out itself.
        grad_gemm = grad_out.to(recipe.gemm_out_dtype(grad_out.dtype))
        if ctx.needs_input_grad[0]:
            c = recipe.grad_input  # [M, N] @ [N, K]: contract over N
            weight = backward_source(weight, recipe.output.b, recipe, 1, *ws)
            grad_x = emulated_fp8_mm(fake_quantize(grad_gemm, c.a, recipe, 1, *gs), _cast(weight, c.b, recipe, 0, *ws))
            grad_x = _gemm_result(grad_x, c, recipe, ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            c = recipe.grad_weight  # [N, M] @ [M, K]: contract over M
            x = backward_source(x, recipe.output.a, recipe, 1, *xs)
            grad_w = emulated_fp8_mm(
                fake_quantize(grad_gemm, c.a, recipe, 0, *gs).t(), fake_quantize(x, c.b, recipe, 0, *xs)
            )
            grad_w = _gemm_result(grad_w, c, recipe, ctx.a_dtype).to(ctx.b_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.to(torch.float32).sum(0).to(grad_out.dtype)
        return grad_x, grad_w, grad_b, None, None
