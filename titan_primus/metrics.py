"""Accuracy metrics shared by tests, parity runs and benchmarks."""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr"]


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20*log10(||ref|| / ||ref - actual||).

    +inf when the two are equal; NaN or inf anywhere in either gives -inf (a failed comparison,
    never a silently passing one: ``min()`` over SQNRs would skip a NaN).
    """
    ref = reference.detach().to(torch.float64)
    act = actual.detach().to(torch.float64)
    if ref.shape != act.shape:
        raise ValueError(f"sqnr: shapes differ: {tuple(ref.shape)} vs {tuple(act.shape)}")
    if not (torch.isfinite(act).all() and torch.isfinite(ref).all()):
        return -math.inf
    noise = torch.linalg.vector_norm(ref - act).item()
    signal = torch.linalg.vector_norm(ref).item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)
