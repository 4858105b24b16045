"""The numerics every judge of the FP8 backends shares: the SQNR bars, the fp32 references and
forward+backward runners (``titan-primus parity`` and the tests), and the one comparison of a
backend's result with the emulation of the same recipe definition (``parity``, the sentinel and
its ``replay``).

Bars, per GEMM, read off the recipe the backend runs (Primus-Turbo's own accuracy gates):
vs fp32 25 dB where the GEMM's operands are e4m3, 20 dB where one is e5m2 (tensorwise gradients),
50 dB where the GEMM stays in high precision (rowwise_with_gw_hp's wgrad); 40 dB between two runs
of one recipe definition (accumulation order and result rounding differ, the FP8 operands do not),
and the sentinel's row floor, half of it (20 dB, about 10% error: a wrong or stale row hides in a
large tensor's SQNR). FP8 attention (Primus-Turbo's blockwise-64 definition) against fp32 SDPA of
the same bf16 inputs: 20 dB for out, dq, dk and dv, Primus-Turbo's own FP8 attention gate
(``tests/pytorch/ops/test_attention.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .grouping import group_bounds
from .metrics import sqnr
from .recipes import Fp8Recipe, GemmCasts

__all__ = [
    "ATTENTION_QUANTITIES",
    "E4M3_BAR_DB",
    "FP8_ATTENTION_BAR_DB",
    "E5M2_BAR_DB",
    "HIGH_PRECISION_BAR_DB",
    "QUANTITIES",
    "SAME_DEFINITION_BAR_DB",
    "SAME_DEFINITION_ROW_BAR_DB",
    "QuantityCheck",
    "compare",
    "compare_quantities",
    "fp32_bars",
    "gemm_bar",
    "make_offsets",
    "reference_attention",
    "reference_grouped",
    "reference_linear",
    "run_attention",
    "run_grouped",
    "run_linear",
    "sdpa",
    "sqnrs",
]

QUANTITIES = ("out", "grad_input", "grad_weight")
E4M3_BAR_DB = 25.0
E5M2_BAR_DB = 20.0
HIGH_PRECISION_BAR_DB = 50.0
SAME_DEFINITION_BAR_DB = 40.0
SAME_DEFINITION_ROW_BAR_DB = SAME_DEFINITION_BAR_DB / 2
ATTENTION_QUANTITIES = ("out", "dq", "dk", "dv")
FP8_ATTENTION_BAR_DB = 20.0


# --- fp32 references and forward+backward runs --------------------------------------------


def make_offsets(counts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """int32 cumulative end offsets (TorchTitan's ``offs``) of groups with ``counts`` rows."""
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
    """fp32 reference: one matmul per group; rows past the last group stay zero."""

    def fp32(A, B_t, offs):
        out = A.new_zeros(A.shape[0], B_t.shape[2], dtype=torch.float32)
        for g, (s, e) in enumerate(group_bounds(offs)):
            out[s:e] = A[s:e].float() @ B_t[g].float()
        return out

    return run_grouped(fp32, A, W, offs, grad_out.float())


def run_attention(fn, q, k, v, grad_out):
    """(out, dq, dk, dv) of ``fn(q, k, v)`` on bshd (B, L, H, D) tensors for upstream gradient ``grad_out``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad_out.to(out.dtype))
    return out, q.grad, k.grad, v.grad


def sdpa(q, k, v, *, causal: bool):
    """torch's SDPA of bshd (B, L, H, D) tensors, bshd out: softmax scale 1/sqrt(D), kv heads
    shared by query-head groups."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).transpose(1, 2)


def reference_attention(q, k, v, grad_out, *, causal: bool):
    """fp32 :func:`sdpa` of the same (possibly bf16-rounded) bshd inputs."""
    return run_attention(
        lambda q, k, v: sdpa(q.float(), k.float(), v.float(), causal=causal), q, k, v, grad_out.float()
    )


def sqnrs(reference, actual) -> list[float]:
    """SQNR of each tensor of ``actual`` against ``reference``, skipping absent (None) ones."""
    return [sqnr(r, a) for r, a in zip(reference, actual) if r is not None]


# --- thresholds ---------------------------------------------------------------------------


def gemm_bar(casts: GemmCasts) -> float:
    """Minimum SQNR vs fp32 (dB) of one GEMM's result, from how its operands are cast."""
    formats = {casts.a.fmt, casts.b.fmt}
    if formats == {None}:
        return HIGH_PRECISION_BAR_DB
    return E5M2_BAR_DB if "e5m2" in formats else E4M3_BAR_DB


def fp32_bars(recipe: Fp8Recipe) -> tuple[float, float, float]:
    """Minimum SQNR vs fp32 (dB) of (out, grad_input, grad_weight) under ``recipe``."""
    return gemm_bar(recipe.output), gemm_bar(recipe.grad_input), gemm_bar(recipe.grad_weight)


# --- a backend against the emulation of the same definition -------------------------------------


@dataclass
class QuantityCheck:
    quantity: str
    sqnr_db: float
    bitwise_equal: bool
    finite: bool
    rows: int
    differing_rows: list[int]

    def to_json(self) -> dict:
        return {
            "quantity": self.quantity,
            "sqnr_db": self.sqnr_db if math.isfinite(self.sqnr_db) else str(self.sqnr_db),
            "bitwise_equal": self.bitwise_equal,
            "finite": self.finite,
            "rows": self.rows,
            "differing_rows": len(self.differing_rows),
            "first_differing_rows": self.differing_rows[:8],
        }


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim] in float64 (a weight gradient's rows are its output features)."""
    t = t.detach().to(torch.float64)
    return t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)


def compare(
    quantity: str, reference: torch.Tensor, actual: torch.Tensor, bitwise: bool, row_floor_db: float | None
) -> QuantityCheck:
    """``actual`` (the backend's) against ``reference`` (the emulation's, or another run of the same
    recipe definition): its SQNR, and the rows that are not finite or differ (``bitwise``: at all;
    else by more than ``row_floor_db``; None: only non-finite rows count)."""
    if reference.numel() == 0:
        return QuantityCheck(quantity, math.inf, True, True, 0, [])
    ref, act = _rows(reference), _rows(actual)
    finite_rows = torch.isfinite(act).all(-1)
    if bitwise:
        wrong = (ref != act).any(-1) | ~finite_rows
    elif row_floor_db is None:
        wrong = ~finite_rows
    else:
        noise = (ref - act).pow(2).sum(-1)
        wrong = ~finite_rows | (noise > ref.pow(2).sum(-1) * 10 ** (-row_floor_db / 10))
    return QuantityCheck(
        quantity,
        sqnr(reference, actual),
        reference.dtype == actual.dtype and torch.equal(reference, actual),
        bool(finite_rows.all()),
        ref.shape[0],
        wrong.nonzero().flatten().tolist(),
    )


def compare_quantities(
    reference: dict,
    actual: dict,
    bit_exact: bool = False,
    row_floor_db: float | None = None,
    quantities: tuple[str, ...] = QUANTITIES,
) -> list[QuantityCheck]:
    """:func:`compare` of each of ``quantities`` (a GEMM's out, grad_input, grad_weight; FP8
    attention's :data:`ATTENTION_QUANTITIES`) present in both."""
    return [
        compare(q, reference[q], actual[q], bit_exact, row_floor_db)
        for q in quantities
        if reference.get(q) is not None and actual.get(q) is not None
    ]
