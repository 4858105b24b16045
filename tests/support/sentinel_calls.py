"""A layer checked by the numerics sentinel: its inputs and one watched call
(tests/unit/test_sentinel.py, and on Primus-Turbo's own code tests/real_turbo/test_failure_classes.py)."""

import torch

from titan_primus import sentinel

__all__ = ["checked_call", "sentinel_inputs"]


def sentinel_inputs(op, generator):
    """A linear's (x, weight, bias, grad) or a grouped GEMM's (A, W [E, N, K], offs with an empty
    expert and 16 rows past the last group, grad), bf16."""
    if op == "linear":
        x = torch.randn(64, 256, generator=generator).bfloat16()
        weight = (torch.randn(128, 256, generator=generator) * 0.05).bfloat16()
        return (
            x,
            weight,
            torch.randn(128, generator=generator).bfloat16(),
            torch.randn(64, 128, generator=generator).bfloat16(),
        )
    A = torch.randn(112, 256, generator=generator).bfloat16()  # 16 rows past offs[-1]
    W = (torch.randn(3, 256, 256, generator=generator) * 0.05).bfloat16()
    offs = torch.tensor([40, 40, 96], dtype=torch.int32)  # an empty expert
    return A, W, offs, torch.randn(112, 256, generator=generator).bfloat16()


def checked_call(watched, op, recipe, inputs, weight=None):
    """One forward and backward of ``op`` through ``watched`` (a ``WatchedBackend``): the active
    sentinel's report of the step."""
    first, W, third, grad = inputs
    first = first.clone().requires_grad_()
    weight = (W.clone() if weight is None else weight).requires_grad_()
    if op == "linear":
        out = watched.linear(first, weight, third, recipe)
    else:
        out = watched.grouped_mm(first, weight.transpose(-2, -1), third, recipe)
    out.backward(grad)
    return sentinel.active_sentinel().finish_step()
