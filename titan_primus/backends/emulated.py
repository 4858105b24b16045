"""Pure-PyTorch FP8 emulation: quantize with the real FP8 dtypes, then run the GEMM on the
quantized values and apply the scales, as FP8 kernels do.

Runs on any device and is the numerics oracle for the other backends: it reproduces every
upstream definition of a recipe (scale math, formats, power-of-2 rounding, which operand is cast
how, and the dtype each GEMM's result is rounded to). Linears dequantize and multiply in
float32, then round each GEMM's result to the dtype the kernels produce (see ``_gemm_result``).
Grouped GEMMs multiply the FP8 values held in bfloat16 (exact) with ``torch._grouped_mm`` and take
the scales out after (divide, or multiply by the float32 reciprocal where the recipe says the
kernels do), without a host sync, so they compile fullgraph; the bfloat16
rounding of the unscaled result is exact where scales are powers of two (TorchAO) and within one
bfloat16 ulp otherwise (Primus-Turbo). Every shape runs: dimensions ``torch._grouped_mm`` cannot
take (its strides must be 16-byte multiples) are zero-padded, which changes no amax and no result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import DeviceProfile
from ..fsdp_fp8.gathered import Fp8GatheredWeight
from ..grouping import group_ids, zero_trailing_rows
from ..recipes import RECIPE_NAMES, Fp8Recipe, GemmCasts, has_definition, make_recipe
from ..scaling import fake_quantize, quantize, quantize_per_group, unscale
from .base import Fp8Backend, Op, TensorParallelShards, Verdict, kept_for_gradients
from .emulated_blocked import blocked_grouped_mm, blocked_linear
from .emulated_gemm import GEMM_OPS, emulated_fp8_grouped_mm, emulated_fp8_mm

__all__ = ["EmulatedBackend"]


def _backward_source(t: torch.Tensor, forward_cast, recipe: Fp8Recipe, contract_dim: int, *shard) -> torch.Tensor:
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


class _EmulatedLinear(torch.autograd.Function):
    """Every GEMM returns x's dtype, the dtype the model computes in (the dtype contract in
    titan_primus.ops): the output and grad_input in it, grad_weight in it too before the cast
    to the weight's dtype (as autograd casts TorchAO's and nn.Linear-under-autocast's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, shards: TensorParallelShards | None):
        with _no_autocast(x):
            return _EmulatedLinear._forward(ctx, x, weight, bias, recipe, shards)

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
            return _EmulatedLinear._backward(ctx, grad_out)

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
            weight = _backward_source(weight, recipe.output.b, recipe, 1, *ws)
            grad_x = emulated_fp8_mm(fake_quantize(grad_gemm, c.a, recipe, 1, *gs), _cast(weight, c.b, recipe, 0, *ws))
            grad_x = _gemm_result(grad_x, c, recipe, ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            c = recipe.grad_weight  # [N, M] @ [M, K]: contract over M
            x = _backward_source(x, recipe.output.a, recipe, 1, *xs)
            grad_w = emulated_fp8_mm(
                fake_quantize(grad_gemm, c.a, recipe, 0, *gs).t(), fake_quantize(x, c.b, recipe, 0, *xs)
            )
            grad_w = _gemm_result(grad_w, c, recipe, ctx.a_dtype).to(ctx.b_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.to(torch.float32).sum(0).to(grad_out.dtype)
        return grad_x, grad_w, grad_b, None, None


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


_ALIGNMENT = 8
"""torch._grouped_mm needs every stride a multiple of 16 bytes: 8 bfloat16 elements."""


def _padded(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``t`` zero-padded at the end of ``dims`` to multiples of ``_ALIGNMENT`` (itself if aligned).
    Zeros change no amax and add nothing to a GEMM, and F.pad's backward slices the padding off."""
    pad = [0] * (2 * t.dim())
    for d in dims:
        pad[2 * (t.dim() - 1 - d) + 1] = -t.shape[d] % _ALIGNMENT
    return F.pad(t, pad) if any(pad) else t


class _EmulatedGroupedMM(torch.autograd.Function):
    """Group boundaries never leave the device (no host sync), so it compiles fullgraph. Takes K
    and N already padded to multiples of ``_ALIGNMENT``. Its output is bfloat16 (the dtype
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
            B_src = _backward_source(B_t, recipe.output.b, recipe, 1)
            g, g_scale = _operand(grad_out, c.a, recipe, contract_dim=1)
            b, b_scale = _operand(B_src, c.b, recipe, contract_dim=2)  # rowwise: per (expert, k) over N
            grad_A = _unscaled(_grouped_mm(g, b.transpose(-2, -1), offs), g_scale, _per_row(b_scale, ids), recipe)
            grad_A = zero_trailing_rows(grad_A, offs).to(torch.bfloat16).to(ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            c = recipe.grad_weight  # [K, rows] @ [rows, N] per group: contract over the group's rows
            A_src = _backward_source(A, recipe.output.a, recipe, 1)
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


class EmulatedBackend(Fp8Backend):
    name = "emulated"
    tensor_parallel_scales = True
    recipes = RECIPE_NAMES

    def rank(self, device: DeviceProfile) -> int:
        # Chosen automatically only on a CPU: on a GPU, FP8 layers the kernels cannot run stay
        # in high precision rather than train silently (and slowly) in emulation.
        return 100 if device.kind == "cpu" else 0

    def availability(self, device: DeviceProfile) -> Verdict:
        if device.kind != "cpu":
            return Verdict.yes(
                f"pure PyTorch: runs on every device, but on a GPU ({device.arch}) only when requested "
                f"by name (backend='emulated'), never in place of missing FP8 kernels"
            )
        return Verdict.yes("pure PyTorch: runs on every device")

    def supports(
        self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None
    ) -> Verdict:
        return Verdict.yes("every op, recipe and shape")

    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        # Reproduce the numerics the device's preferred FP8 kernels would run: Primus-Turbo's on
        # MI300-class devices (where it defines the recipe), TorchAO's everywhere else.
        # MX runs on Primus-Turbo only on gfx950.
        primus = device.mi300_class and (recipe != "mxfp8" or device.arch == "gfx950")
        definition = "primus_turbo" if primus and has_definition(recipe, "primus_turbo") else "torchao"
        return make_recipe(recipe, definition, device)

    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        return Verdict.yes("the emulation reproduces every recipe definition")

    def bit_exact_with_emulation(self, op: Op, recipe: Fp8Recipe) -> bool:
        return True  # it is the emulation

    def attention(self):
        from .emulated_attention import EmulatedAttention

        return EmulatedAttention

    def fp8_gemm_ops(self) -> frozenset:
        return GEMM_OPS

    def takes_gathered_fp8_weight(self, recipe: Fp8Recipe, op: Op = "linear") -> Verdict:
        return Verdict.yes("the emulation takes the gathered FP8 weight as it is")

    def gathered_weight(self, data, scale, dtype, recipe, source_dtype=None):
        return Fp8GatheredWeight(data, scale, dtype, recipe.reciprocal_scales, source_dtype)

    def linear(self, x, weight, bias, recipe, shards=None):
        if recipe.block_scaled:  # block scales never span a TP shard: no amax reduction (TP is refused)
            return blocked_linear(x, weight, bias, recipe)
        return _EmulatedLinear.apply(x, weight, bias, recipe, shards)

    def grouped_mm(self, A, B_t, offs, recipe):
        if recipe.block_scaled:
            return blocked_grouped_mm(A, B_t, offs, recipe)
        n = B_t.shape[2]
        out = _EmulatedGroupedMM.apply(_padded(A, (1,)), _padded(B_t, (1, 2)), offs, recipe)
        return out if out.shape[1] == n else out[:, :n]
