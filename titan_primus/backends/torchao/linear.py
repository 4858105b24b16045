"""TorchAO's tensorwise and rowwise FP8 linear as the backend runs it: its autograd function with
the forward GEMM called as what it is (``linear_function``), its configs retargeted to the
device's formats (``linear_configs``), every symbol taken by name from ``LINEAR_SYMBOLS``, and
oneDNN kept out of the CPU path (``without_onednn``)."""

from __future__ import annotations

import dataclasses
import importlib

import torch

from ...recipes import Fp8Recipe
from .symbols import absent_symbols, symbol

__all__ = [
    "LINEAR_SYMBOLS",
    "linear_configs",
    "linear_function",
    "linear_symbol",
    "missing_linear_symbols",
    "without_onednn",
]


class _OneDNNSwitch(torch.autograd.Function):
    """Identity on ``tensors`` whose backward turns oneDNN on or off.

    On a CPU, ``torch._scaled_mm`` dispatches its tensorwise kernel to oneDNN, which runs at
    ~0.05 GFLOP/s (seconds per backward GEMM); with oneDNN off the same math takes milliseconds
    and e4m3fnuz works too. The flag is read when kernels dispatch, so it must be off in the
    backward of the FP8 region as well: a switch after the region turns it off when backward
    enters the region, one before the region restores it when backward leaves. (A region that
    kept its own inner autograd graph instead would break activation checkpointing.)
    """

    @staticmethod
    def forward(ctx, enabled_in_backward: bool | None, *tensors):
        ctx.enabled_in_backward = enabled_in_backward
        out = tuple(t.view_as(t) for t in tensors)
        # A tensor that needs no gradient (a frozen weight) must come out needing none too.
        ctx.mark_non_differentiable(*(o for o, t in zip(out, tensors) if not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx, *grads):
        if ctx.enabled_in_backward is not None:
            torch._C._set_mkldnn_enabled(ctx.enabled_in_backward)
        return None, *grads


def without_onednn(fn, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    restore = torch.backends.mkldnn.enabled
    x, weight = _OneDNNSwitch.apply(restore, x, weight)
    with torch.backends.mkldnn.flags(enabled=False):
        out = fn(x, weight)
    (out,) = _OneDNNSwitch.apply(False, out)
    return out


# What the tensorwise and rowwise linears take from TorchAO, by name: the one place they get it
# (_linear_symbol), checked whole when the backend is first asked whether it can run, so a TorchAO
# that renamed one is refused with the name, never met inside a training step.
LINEAR_SYMBOLS = {
    "Float8LinearConfig": "torchao.float8.config",
    "ScalingType": "torchao.float8.config",
    "tensor_already_casted_to_fp8": "torchao.float8.distributed_utils",
    "matmul_with_hp_or_float8_args": "torchao.float8.float8_linear",
    "float8_mm": "torchao.float8.float8_ops",
    "get_maybe_axiswise_dim": "torchao.float8.float8_scaling_utils",
    "hp_tensor_to_float8_dynamic": "torchao.float8.float8_scaling_utils",
    "Float8TrainingTensor": "torchao.float8.float8_training_tensor",
    "GemmInputRole": "torchao.float8.float8_training_tensor",
    "LinearMMConfig": "torchao.float8.float8_training_tensor",
    "ScaledMMConfig": "torchao.float8.float8_training_tensor",
}
VERIFIED_TORCHAO = "0.15 to 0.18"


def linear_symbol(name: str):
    return symbol(LINEAR_SYMBOLS, name)


def missing_linear_symbols() -> str | None:
    """Which of ``LINEAR_SYMBOLS`` the installed TorchAO lacks, as the reason it cannot run; None
    when it has them all."""
    missing = absent_symbols(LINEAR_SYMBOLS)
    if not missing:
        return None
    return (
        f"TorchAO {importlib.import_module('torchao').__version__} lacks {', '.join(missing)}, which "
        f"titan-primus's TorchAO linears use (titan_primus/backends/torchao/linear.py; verified on TorchAO "
        f"{VERIFIED_TORCHAO}): install a TorchAO from {VERIFIED_TORCHAO}, or a titan-primus that supports this one"
    )


def linear_function():
    """TorchAO's linear autograd function (``matmul_with_hp_or_float8_args``), with its forward
    GEMM called as what it is. TorchAO's forward multiplies its Float8TrainingTensors with
    ``torch.mm``, so activation checkpointing's dispatch mode, which sees an op before the tensor
    subclass does, takes the FP8 GEMM for a high-precision ``aten.mm`` (TorchTitan's selective
    policy recomputes every second one; 0.2.x saves no ``_scaled_mm``). Here the forward makes
    the same casts with TorchAO's functions and calls TorchAO's ``mm`` implementation directly,
    which reaches ``torch._scaled_mm`` with the FP8 payloads: the same kernel and numerics, seen
    as ``aten._scaled_mm``.

    The backward makes TorchAO's own casts and GEMMs (``torchao/float8/float8_linear.py``,
    0.18: lines 94-204), each only where its gradient is needed: TorchAO's runs both GEMMs and
    all four casts whatever ``ctx.needs_input_grad`` says, and its forward keeps both operands
    (line 45). Here a frozen weight (LoRA, frozen layers) costs no wgrad GEMM and no cast of the
    input or of grad_output for it, and forward keeps no input; an input that needs no gradient
    costs no dgrad GEMM and no weight cast, and forward keeps no weight."""
    ScalingType, tensor_already_casted_to_fp8, matmul_with_hp_or_float8_args, float8_mm = (
        linear_symbol(n)
        for n in ("ScalingType", "tensor_already_casted_to_fp8", "matmul_with_hp_or_float8_args", "float8_mm")
    )
    get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic, GemmInputRole = (
        linear_symbol(n) for n in ("get_maybe_axiswise_dim", "hp_tensor_to_float8_dynamic", "GemmInputRole")
    )

    def cast(t, cast_config, config, mm_config, role, axiswise_dim):
        # Already FP8 (a weight FSDP2 all-gathered in FP8), or a GEMM run in high precision.
        if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
            return t
        granularity = cast_config.scaling_granularity
        return hp_tensor_to_float8_dynamic(
            t,
            cast_config.target_dtype,
            mm_config,
            gemm_input_role=role,
            scaling_granularity=granularity,
            axiswise_dim=get_maybe_axiswise_dim(axiswise_dim, granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    class Float8Matmul(matmul_with_hp_or_float8_args):
        @staticmethod
        def forward(ctx, input_hp, weight_hp_t, linear_mm_config, config):
            need_input, need_weight = ctx.needs_input_grad[:2]
            ctx.save_for_backward(input_hp if need_weight else None, weight_hp_t if need_input else None)
            ctx.linear_mm_config, ctx.config = linear_mm_config, config
            a = cast(input_hp, config.cast_config_input, config, linear_mm_config, GemmInputRole.INPUT, -1)
            b = cast(weight_hp_t, config.cast_config_weight, config, linear_mm_config, GemmInputRole.WEIGHT, 0)
            return float8_mm(torch.ops.aten.mm.default, (a, b))

        @staticmethod
        def backward(ctx, grad_output):
            input_hp, weight_hp_t = ctx.saved_tensors
            c, mm_config = ctx.config, ctx.linear_mm_config
            grad = grad_output.reshape(-1, grad_output.shape[-1])
            grad_input = grad_weight_t = None
            if ctx.needs_input_grad[0]:
                g = cast(grad, c.cast_config_grad_output, c, mm_config, GemmInputRole.GRAD_OUTPUT, -1)
                w = cast(weight_hp_t, c.cast_config_weight_for_grad_input, c, mm_config, GemmInputRole.WEIGHT, -1)
                grad_input = torch.mm(g, w.t()).reshape(*grad_output.shape[:-1], -1)
            if ctx.needs_input_grad[1]:
                x = input_hp.reshape(-1, input_hp.shape[-1])
                g = cast(grad, c.cast_config_grad_output_for_grad_weight, c, mm_config, GemmInputRole.GRAD_OUTPUT, 0)
                x = cast(x, c.cast_config_input_for_grad_weight, c, mm_config, GemmInputRole.INPUT, 0)
                grad_weight_t = torch.mm(g.t(), x).t()
            return grad_input, grad_weight_t, None, None

    return Float8Matmul


def linear_configs(recipe: Fp8Recipe):
    """TorchAO's Float8LinearConfig and LinearMMConfig for ``recipe``."""
    Float8LinearConfig, LinearMMConfig, ScaledMMConfig = (
        linear_symbol(n) for n in ("Float8LinearConfig", "LinearMMConfig", "ScaledMMConfig")
    )

    # TorchAO picks e4m3fn vs e4m3fnuz once at import from the local GPU; the recipe carries the
    # device's formats, so retarget every cast (this is also how fnuz is exercised on a CPU).
    base = Float8LinearConfig.from_recipe_name(recipe.name)
    formats = {
        torch.float8_e4m3fn: recipe.e4m3,
        torch.float8_e4m3fnuz: recipe.e4m3,
        torch.float8_e5m2: recipe.e5m2,
        torch.float8_e5m2fnuz: recipe.e5m2,
    }
    casts = {
        f.name: dataclasses.replace(getattr(base, f.name), target_dtype=formats[getattr(base, f.name).target_dtype])
        for f in dataclasses.fields(base)
        if f.name.startswith("cast_config_")
    }
    config = dataclasses.replace(base, **casts)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm_config = LinearMMConfig(
        *(ScaledMMConfig(False, gemm.use_fast_accum, False, config.pad_inner_dim) for gemm in gemms)
    )
    return config, mm_config
