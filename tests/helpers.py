"""Shared test helpers: fp32 references for both ops and the SQNR bars of the issue."""

from __future__ import annotations

import torch

from titan_primus import sqnr
from titan_primus.grouping import group_bounds


def make_offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def run_linear(fn, x, weight, bias, grad_out):
    """(out, grad_x, grad_w, grad_b) of ``fn(x, weight, bias)`` for upstream gradient ``grad_out``."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    bias = None if bias is None else bias.detach().clone().requires_grad_()
    out = fn(x, weight, bias)
    out.backward(grad_out.to(out.dtype))
    return out, x.grad, weight.grad, None if bias is None else bias.grad


def reference_linear(x, weight, bias, grad_out):
    """fp32 reference computed from the same (possibly bf16-rounded) inputs."""
    def fp32(x, w, b):
        out = x.float() @ w.float().t()
        return out if b is None else out + b.float()

    return run_linear(fp32, x, weight, bias, grad_out.float())


def run_grouped(fn, A, W, offs, grad_out):
    """(out, grad_A, grad_W) of ``fn(A, W.transpose(-2, -1), offs)``; W is [E, N, K] like TorchTitan."""
    A = A.detach().clone().requires_grad_()
    W = W.detach().clone().requires_grad_()
    out = fn(A, W.transpose(-2, -1), offs)
    out.backward(grad_out.to(out.dtype))
    return out, A.grad, W.grad


def reference_grouped(A, W, offs, grad_out):
    def fp32(A, B_t, offs):
        out = torch.zeros(A.shape[0], B_t.shape[2])
        parts = [A[s:e].float() @ B_t[g].float() for g, (s, e) in enumerate(group_bounds(offs))]
        end = int(offs[-1])
        return torch.cat([*parts, out[end:]]) if parts else out

    return run_grouped(fp32, A, W, offs, grad_out.float())


def sqnrs(reference, actual) -> list[float]:
    return [sqnr(r, a) for r, a in zip(reference, actual) if r is not None]


def bars(recipe: str) -> tuple[float, float, float]:
    """Minimum SQNR (dB) vs fp32 for (out, grad_input, grad_weight), per the issue."""
    if recipe == "tensorwise":  # grads quantized to e5m2
        return 25.0, 20.0, 20.0
    if recipe == "rowwise_with_gw_hp":  # wgrad in high precision
        return 25.0, 25.0, 50.0
    return 25.0, 25.0, 25.0
