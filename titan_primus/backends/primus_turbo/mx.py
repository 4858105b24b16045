"""``mxfp8`` on Primus-Turbo (v0.3.2.dev48+, gfx950): its public ops, inside titan-primus custom ops.

Primus-Turbo's MX quantizers and dense MX GEMMs are HIP and FlyDSL kernels, and its MX autograd
Functions keep FP8 copies of the weight for backward. Here the public ops run inside custom ops
whose backward runs the forward again under autograd from the saved input and weight (four FP8
GEMMs per op, the bf16 input saved): no weight copy outlives the forward, and the ops trace into
``torch.compile(fullgraph=True)`` graphs (the public ops are ``torch._dynamo.disable``d).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from ...grouping import group_lens
from .autograd import group_offsets
from .release import PUBLIC_OPS_MODULE, TurboApi, require_api

__all__ = ["linear", "grouped_mm"]

_MX_BLOCK = 32


def _config(api: TurboApi):
    enums = api.enums
    return enums.Float8QuantConfig(
        format=enums.Format.E4M3,
        granularity=enums.ScalingGranularity.MX_BLOCKWISE,
        scale_dtype=enums.ScaleDtype.E8M0,
        block_size=_MX_BLOCK,
    )


def _ops():
    return importlib.import_module(PUBLIC_OPS_MODULE)


def _gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    api = require_api()
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    out = _ops().gemm_fp8(a=x, b=weight, trans_a=False, trans_b=True, out_dtype=out_dtype, config=_config(api))
    return out.to(x.dtype)


def _grouped(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    api = require_api()
    # MX grouped GEMMs take the NT layout only (FP8GroupedGemmMXFunc asserts trans_b).
    b = B_t.transpose(-2, -1).contiguous()
    return _ops().grouped_gemm_fp8(
        a=A,
        b=b,
        group_lens=group_lens(offs),
        group_offs=group_offsets(offs),
        trans_b=True,
        out_dtype=torch.bfloat16,
        config=_config(api),
    )


@contextlib.contextmanager
def _autograd_inside_custom_op():
    """A custom op's kernel runs with autograd dispatch excluded; re-include it so the backward
    can differentiate through Primus-Turbo's own autograd Function."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _vjp(fn, grad: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with _autograd_inside_custom_op():
        leaves = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, grad)


@torch.library.custom_op("titan_primus::primus_turbo_mx_linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _gemm(x, weight)


@linear.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("titan_primus::primus_turbo_mx_linear_backward", mutates_args=())
def _linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _vjp(_gemm, grad, x, weight)


@_linear_backward.register_fake
def _(grad, x, weight):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("titan_primus::primus_turbo_mx_grouped_mm", mutates_args=())
def grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped(A, B_t, offs)


@grouped_mm.register_fake
def _(A, B_t, offs):
    return A.new_empty((A.shape[0], B_t.shape[2]), dtype=torch.bfloat16)


@torch.library.custom_op("titan_primus::primus_turbo_mx_grouped_mm_backward", mutates_args=())
def _grouped_backward(
    grad: torch.Tensor, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _vjp(lambda a, b: _grouped(a, b, offs), grad, A, B_t)


@_grouped_backward.register_fake
def _(grad, A, B_t, offs):
    return torch.empty_like(A), torch.empty_like(B_t)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_vjp(ctx, grad):
    return _linear_backward(grad, *ctx.saved_tensors)


def _grouped_vjp(ctx, grad):
    A, B_t, offs = ctx.saved_tensors
    return (*_grouped_backward(grad, A, B_t, offs), None)


linear.register_autograd(_linear_vjp, setup_context=_save_inputs)
grouped_mm.register_autograd(_grouped_vjp, setup_context=_save_inputs)
