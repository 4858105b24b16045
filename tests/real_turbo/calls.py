"""Calling Primus-Turbo's own ops from the tier: its quantization config for a recipe, group
lengths that pass its CUDA check, its own public op per recipe, a call's output with its input
gradients, the dispatchers its GEMMs run through and what a call keeps for backward."""

import torch

__all__ = ["DISPATCHERS", "CudaLooking", "SavedTensors", "grads", "turbo_config", "turbo_own"]


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


DISPATCHERS = {  # module -> the dispatcher classes its GEMM custom ops run through
    "primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl": ("GEMMFP8KernelDispatcher",),
    "primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl": (
        "GroupedGEMMFP8KernelDispatcher",
        "GroupedGEMMFP8VariableKKernelDispatcher",
    ),
}


class SavedTensors:
    """What autograd keeps from forward to backward (``saved_tensors_hooks``)."""

    def __init__(self):
        self.saved = []

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def _pack(self, t):
        self.saved.append(t)
        return t

    def copies_of(self, weight) -> int:
        """Bytes of saved tensors as large as ``weight`` (in elements) that are not its storage."""
        storage = weight.untyped_storage().data_ptr()
        return sum(
            t.numel() * t.element_size()
            for t in self.saved
            if t.numel() >= weight.numel() and t.untyped_storage().data_ptr() != storage
        )

    def fp8_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved if t.element_size() == 1)


def turbo_own(op, recipe, group_ends):
    """Primus-Turbo's own public op (``gemm_fp8``, or ``grouped_gemm_fp8`` over the groups ending
    at ``group_ends``) for ``recipe``: ``fn(x, w)`` with ``w`` as titan-primus's backends take it."""
    from real_turbo.conftest import TURBO
    from titan_primus.backends.primus_turbo.autograd import group_offsets
    from titan_primus.grouping import group_lens

    if op == "linear":
        return lambda x, w: TURBO.ops.gemm_fp8(
            x, w, trans_b=True, out_dtype=torch.bfloat16, config=turbo_config(recipe)
        )
    lens = group_lens(group_ends).as_subclass(CudaLooking)
    return lambda A, W: TURBO.ops.grouped_gemm_fp8(
        A,
        W,
        lens,
        group_offs=group_offsets(group_ends),
        trans_b=True,
        out_dtype=torch.bfloat16,
        config=turbo_config(recipe),
    )
