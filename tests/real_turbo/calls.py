"""Calling Primus-Turbo's own ops from the tier: its quantization config for a recipe, group
lengths that pass its CUDA check, and a call's output with its input gradients."""

import torch

__all__ = ["CudaLooking", "grads", "turbo_config"]


def turbo_config(recipe):
    """Primus-Turbo's ``Float8QuantConfig`` of ``recipe`` (tensorwise, rowwise, blockwise)."""
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity

    granularity = {"tensorwise": "TENSORWISE", "rowwise": "ROWWISE", "blockwise": "BLOCKWISE"}[recipe]
    return Float8QuantConfig(
        format=Format.HYBRID if recipe == "tensorwise" else Format.E4M3,
        granularity=getattr(ScalingGranularity, granularity),
        block_size=128 if recipe == "blockwise" else None,
    )


class CudaLooking(torch.Tensor):
    """Primus-Turbo's grouped quantization asserts ``group_lens.is_cuda`` (a CPU-only artefact)."""

    @property
    def is_cuda(self):
        return True


def grads(fn, *inputs):
    """``fn(*inputs)`` and the gradient of each input, for a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(grad)
    return out.detach(), *(leaf.grad for leaf in leaves)
