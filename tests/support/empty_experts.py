"""A grouped GEMM on a rank whose experts receive no token: the step, what it may run, and what it
must give (tests/unit/test_empty_experts.py, and on Primus-Turbo's own code tests/real_turbo's)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ALLOCATION_OPS", "EXPERTS", "K", "N", "assert_zero", "no_token_step"]

K, N, EXPERTS = 256, 256, 4  # Primus-Turbo's grouped kernels take contractions (K, N) >= 256

# What a grouped GEMM without rows may run: allocations of its empty output and zero gradients,
# and autograd's accumulation of them. Anything else (an amax, a cast, a GEMM) fails the test.
ALLOCATION_OPS = {
    "aten.zeros.default",
    "aten.new_zeros.default",
    "aten.empty.memory_format",
    "aten.new_empty_strided.default",
    "aten.copy_.default",
    "aten.detach.default",
    "aten.transpose.int",
    "aten.ones_like.default",
}


class OpsRun(TorchDispatchMode):
    """The names of the aten ops that ran inside it."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def no_token_step(gemm, rows: int):
    """Forward and backward of ``gemm`` on ``rows`` rows none of which is in a group (offs all
    0): (out, grad_A, grad_B_t, ops that ran)."""
    g = torch.Generator().manual_seed(rows)
    A = torch.randn(rows, K, generator=g).bfloat16().requires_grad_()
    W = (torch.randn(EXPERTS, N, K, generator=g) * 0.05).bfloat16().requires_grad_()  # [E, N, K]
    offs = torch.zeros(EXPERTS, dtype=torch.int32)
    with OpsRun() as seen:
        out = gemm(A, W.transpose(-2, -1), offs)
        out.backward(torch.ones_like(out))
    return out, A.grad, W.grad.transpose(-2, -1), seen.ops


def assert_zero(out, grad_A, grad_B_t, rows):
    """Output and gradients of a grouped GEMM with no row in a group: the right dtypes and
    shapes, and zero."""
    assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
    assert grad_A.dtype == torch.bfloat16 and grad_A.shape == (rows, K)
    assert grad_B_t.shape == (EXPERTS, K, N)
    for t in (out, grad_A, grad_B_t):
        assert torch.equal(t, torch.zeros_like(t))  # NaN is never equal to 0
