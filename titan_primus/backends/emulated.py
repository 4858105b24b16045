"""Pure-PyTorch FP8 emulation: quantize, dequantize, matmul in float32, cast out.

Runs on any device and is the numerics oracle for the other backends: it reproduces either
upstream definition of a recipe exactly (scale math, formats, power-of-2 rounding, which operand
is cast how), only the matmul itself runs in float32 instead of FP8 tensor cores.
"""

from __future__ import annotations

import torch

from ..device import DeviceProfile
from ..grouping import group_bounds
from ..recipes import Fp8Recipe, has_definition, make_recipe
from ..scaling import fake_quantize
from .base import Fp8Backend, Op, Verdict

__all__ = ["EmulatedBackend"]


def _backward_source(t: torch.Tensor, forward_cast, recipe: Fp8Recipe, contract_dim: int) -> torch.Tensor:
    """What backward re-quantizes ``t`` from: ``t`` itself, or (Primus-Turbo >= v0.3.1, rowwise)
    its forward FP8 copy dequantized to ``t``'s dtype."""
    if recipe.backward_from_fp8 and forward_cast.granularity == "rowwise":
        return fake_quantize(t, forward_cast, recipe, contract_dim).to(t.dtype)
    return t


class _EmulatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe):
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        casts = recipe.output
        out = fake_quantize(x, casts.a, recipe, contract_dim=1) @ fake_quantize(weight, casts.b, recipe, 1).t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        x = _backward_source(x, recipe.output.a, recipe, 1)
        weight = _backward_source(weight, recipe.output.b, recipe, 1)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            c = recipe.grad_input  # [M, N] @ [N, K]: contract over N
            grad_x = fake_quantize(grad_out, c.a, recipe, 1) @ fake_quantize(weight, c.b, recipe, 0)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            c = recipe.grad_weight  # [N, M] @ [M, K]: contract over M
            grad_w = fake_quantize(grad_out, c.a, recipe, 0).t() @ fake_quantize(x, c.b, recipe, 0)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.to(torch.float32).sum(0).to(grad_out.dtype)
        return grad_x, grad_w, grad_b, None


class _EmulatedGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B_t, offs, recipe: Fp8Recipe):
        bounds = group_bounds(offs)
        end = bounds[-1][1]
        ctx.save_for_backward(A, B_t)
        ctx.recipe, ctx.bounds = recipe, bounds
        casts = recipe.output
        out = A.new_zeros(A.shape[0], B_t.shape[2], dtype=torch.float32)
        if end > 0:
            a = fake_quantize(A[:end], casts.a, recipe, contract_dim=1)
            b = fake_quantize(B_t, casts.b, recipe, contract_dim=1)  # rowwise: per (expert, n) over K
            for g, (s, e) in enumerate(bounds):
                if e > s:
                    out[s:e] = a[s:e] @ b[g]
        return out.to(A.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        A, B_t = ctx.saved_tensors
        recipe, bounds = ctx.recipe, ctx.bounds
        end = bounds[-1][1]
        A = _backward_source(A, recipe.output.a, recipe, 1)
        B_t = _backward_source(B_t, recipe.output.b, recipe, 1)
        grad_A = grad_B = None
        if ctx.needs_input_grad[0]:
            grad_A = torch.zeros(A.shape, dtype=torch.float32, device=A.device)
            if end > 0:
                c = recipe.grad_input  # [rows, N] @ [N, K] per group: contract over N
                g = fake_quantize(grad_out[:end], c.a, recipe, contract_dim=1)
                b = fake_quantize(B_t, c.b, recipe, contract_dim=2)
                for i, (s, e) in enumerate(bounds):
                    if e > s:
                        grad_A[s:e] = g[s:e] @ b[i].t()
            grad_A = grad_A.to(A.dtype)
        if ctx.needs_input_grad[1]:
            grad_B = torch.zeros(B_t.shape, dtype=torch.float32, device=B_t.device)
            c = recipe.grad_weight  # [K, rows] @ [rows, N] per group: contract over the group's rows
            per_group = c.a.granularity == "rowwise" and recipe.grouped_wgrad_per_group
            if end > 0 and not per_group:
                # Scales over all grouped rows at once (or no cast): cast once, outside the loop.
                g_all = fake_quantize(grad_out[:end], c.a, recipe, contract_dim=0)
                a_all = fake_quantize(A[:end], c.b, recipe, contract_dim=0)
            for i, (s, e) in enumerate(bounds):
                if e <= s:
                    continue
                if per_group:
                    g_i = fake_quantize(grad_out[s:e], c.a, recipe, contract_dim=0)
                    a_i = fake_quantize(A[s:e], c.b, recipe, contract_dim=0)
                else:
                    g_i, a_i = g_all[s:e], a_all[s:e]
                grad_B[i] = a_i.t() @ g_i
            grad_B = grad_B.to(B_t.dtype)
        return grad_A, grad_B, None, None


class EmulatedBackend(Fp8Backend):
    name = "emulated"

    def rank(self, device: DeviceProfile) -> int:
        return 100

    def availability(self, device: DeviceProfile) -> Verdict:
        return Verdict.yes("pure PyTorch: runs on every device")

    def supports(self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None) -> Verdict:
        return Verdict.yes("every op, recipe and shape")

    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        # Reproduce the numerics the device's preferred FP8 kernels would run: Primus-Turbo's on
        # MI300-class devices (where it defines the recipe), TorchAO's everywhere else.
        definition = "primus_turbo" if device.mi300_class and has_definition(recipe, "primus_turbo") else "torchao"
        return make_recipe(recipe, definition, device)

    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        return Verdict.yes("the emulation reproduces every recipe definition")

    def linear(self, x, weight, bias, recipe):
        return _EmulatedLinear.apply(x, weight, bias, recipe)

    def grouped_mm(self, A, B_t, offs, recipe):
        return _EmulatedGroupedMM.apply(A, B_t, offs, recipe)
