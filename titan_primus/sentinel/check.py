"""One GEMM call of a converted layer, as the sentinel captured it, re-computed with the exact
emulation of the same recipe definition on the same device, and compared quantity by quantity.

A backend that declares itself bit-exact with the emulation (``bit_exact_with_emulation``: the
emulation itself) must match bit for bit; any other must reach the same-definition floor of
``titan-primus parity`` (40 dB, what two code paths of one definition reach: accumulation order
and result rounding differ, the FP8 operands do not) on each quantity, and no row may fall under
half of it (20 dB, about 10% error: a wrong or stale row hides in a large tensor's SQNR). Every
quantity must be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..backends.emulated import EmulatedBackend
from ..fsdp_fp8 import Fp8GatheredWeight
from ..numerics import QUANTITIES, SAME_DEFINITION_BAR_DB, SAME_DEFINITION_ROW_BAR_DB, QuantityCheck, compare_quantities
from ..recipes import Fp8Recipe

__all__ = [
    "QUANTITIES",
    "FLOOR_DB",
    "ROW_FLOOR_DB",
    "GemmCheck",
    "GemmRecord",
    "QuantityCheck",
    "check_record",
    "finite",
    "judge",
    "recompute",
    "snapshot",
]

FLOOR_DB = SAME_DEFINITION_BAR_DB
ROW_FLOOR_DB = SAME_DEFINITION_ROW_BAR_DB
_EMULATION = EmulatedBackend()


def snapshot(t, recipe: Fp8Recipe):
    """A copy of ``t`` that outlives the step (FSDP2 frees the storage of gathered weights after
    use), keeping a weight FSDP2 gathered in FP8 as its FP8 payload and scale."""
    if not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, Fp8GatheredWeight):
        return t._with(t.fp8_data().clone(), t.scale().clone())
    if _is_torchao_fp8_weight(t):
        # TorchAO's Float8TrainingTensor (its FP8-gathered weight): the same payload and scale
        # convention (data = saturate(w * scale)), which the emulation takes as ours.
        return Fp8GatheredWeight(t._data.clone(), t._scale.clone(), t._orig_dtype, recipe.reciprocal_scales)
    return t.detach().clone()


def _is_torchao_fp8_weight(t: torch.Tensor) -> bool:
    return type(t).__name__ == "Float8TrainingTensor" and hasattr(t, "_scale") and hasattr(t, "_data")


@dataclass(eq=False)
class GemmRecord:
    """One backend call of a layer: its operands (``linear``: x [M, K], weight [N, K], bias;
    ``grouped_mm``: A [R, K], B_t [E, K, N], offs), as the backend received them, and what the
    backend produced: ``out`` in forward, ``grad_output`` (the gradient it was handed), and
    ``grad_input`` / ``grad_weight`` in backward."""

    layer: str
    gemm: int
    """1-based position of this call among the layer's backend calls in one forward."""
    op: str
    backend: str
    bit_exact: bool
    recipe: Fp8Recipe
    operands: tuple
    needs_grad: tuple[bool, bool]
    shards: object = None
    tensors: dict = field(default_factory=dict)
    released: bool = False
    """Its tensors were dropped (:meth:`release`): it keeps only what describes the call."""

    @property
    def complete(self) -> bool:
        wanted = ["out", "grad_output"] + [q for q, need in zip(("grad_input", "grad_weight"), self.needs_grad) if need]
        return all(q in self.tensors for q in wanted)

    def release(self) -> None:
        """Drop the operands and tensors (once checked and, on a breach, saved): a report keeps
        figures, and a gradient hook that fires later adds nothing."""
        self.operands, self.shards, self.tensors, self.released = (), None, {}, True

    def describe(self) -> str:
        what = "linear" if self.op == "linear" else f"grouped GEMM {self.gemm}"
        return f"{self.layer} ({what}; {self.backend}, {self.recipe.describe()})"


@dataclass
class GemmCheck:
    record: GemmRecord
    bit_exact: bool
    """Whether the backend judged had to match the emulation bit for bit."""
    quantities: list[QuantityCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: str = ""
    """What was not compared and why (inputs that were already non-finite), or ""."""

    @property
    def passed(self) -> bool:
        return not self.problems

    def figures(self) -> str:
        if not self.quantities:
            text = ""
        elif self.bit_exact and all(q.bitwise_equal for q in self.quantities):
            text = f"bitwise equal to the emulation ({', '.join(q.quantity for q in self.quantities)})"
        else:
            floor = "floor: bitwise equal" if self.bit_exact else f"floor {FLOOR_DB:g} dB"
            values = ", ".join(f"{q.quantity} {_db(q.sqnr_db)}" for q in self.quantities)
            text = f"SQNR vs the emulation: {values} ({floor})"
        return "; ".join(part for part in (text, self.skipped and f"not compared: {self.skipped}") if part)


def _db(value: float) -> str:
    return "bitwise" if value == math.inf else f"{value:.1f} dB"


def finite(t) -> bool:
    """No NaN or inf in ``t`` (for a weight gathered in FP8: in its scale)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return True
    if isinstance(t, Fp8GatheredWeight):
        return bool(torch.isfinite(t.scale()).all())
    return bool(torch.isfinite(t).all())


def recompute(record: GemmRecord, backend=_EMULATION, backward: bool = True) -> dict[str, torch.Tensor | None]:
    """out, grad_input and grad_weight (``backward``) of ``record``'s op on ``backend``
    (default: the emulation of ``record.recipe``, the same definition) from the captured
    operands and gradient, on their device."""
    first, second, third = record.operands
    a = first.detach().requires_grad_(backward and record.needs_grad[0])
    b = second.detach().requires_grad_(backward and record.needs_grad[1])
    with torch.enable_grad(), torch.autocast(a.device.type, enabled=False):
        if record.op == "linear":
            extra = {} if record.shards is None else {"shards": record.shards}
            out = backend.linear(a, b, third, record.recipe, **extra)
        else:
            out = backend.grouped_mm(a, b, third, record.recipe)
        wanted = [t for t in (a, b) if t.requires_grad]
        grads = list(torch.autograd.grad(out, wanted, record.tensors["grad_output"])) if wanted else []
    result = {"out": out.detach()}
    for name, need in zip(("grad_input", "grad_weight"), record.needs_grad):
        result[name] = grads.pop(0) if backward and need else None
    return result


def judge(record: GemmRecord, reference: dict, actual: dict, bit_exact: bool) -> GemmCheck:
    """``actual``'s quantities (a backend's) against ``reference`` (the emulation's)."""
    result = GemmCheck(record, bit_exact)
    for check in compare_quantities(reference, actual, bit_exact, ROW_FLOOR_DB):
        result.quantities.append(check)
        result.problems += _problems(check, record, bit_exact)
    return result


def check_record(record: GemmRecord) -> GemmCheck:
    """Re-compute ``record`` with the emulation and judge what the backend produced: forward
    from finite operands, backward too from a finite incoming gradient (non-finite inputs came
    from elsewhere; the every-step checks say from where)."""
    if not all(finite(t) for t in record.operands[:2]):
        return GemmCheck(record, record.bit_exact, skipped="its operands were already non-finite")
    backward = finite(record.tensors["grad_output"])
    actual = record.tensors if backward else {"out": record.tensors["out"]}
    result = judge(record, recompute(record, backward=backward), actual, record.bit_exact)
    if not backward:
        result.skipped = "gradients: the incoming gradient was already non-finite"
    return result


def _problems(check: QuantityCheck, record: GemmRecord, bit_exact: bool) -> list[str]:
    q = check.quantity
    if not check.finite:
        return [f"{q} has NaN/inf in {len(check.differing_rows)} of {check.rows} rows{_row_list(check)}"]
    rows = f"{len(check.differing_rows)} of {check.rows} rows differ{_row_list(check)}{_past_groups(check, record)}"
    if bit_exact and not check.bitwise_equal:
        return [f"{q} is not bit-identical to the emulation ({rows}; SQNR {_db(check.sqnr_db)})"]
    if check.sqnr_db < FLOOR_DB:
        return [f"{q} SQNR {_db(check.sqnr_db)} < {FLOOR_DB:g} dB vs the emulation ({rows})"]
    if check.differing_rows:
        return [
            f"{q}: {rows} by more than the row floor ({ROW_FLOOR_DB:g} dB), though its SQNR is {_db(check.sqnr_db)}"
        ]
    return []


def _row_list(check: QuantityCheck) -> str:
    shown = check.differing_rows[:8]
    more = ", ..." if len(check.differing_rows) > len(shown) else ""
    return f": rows {', '.join(map(str, shown))}{more}" if shown else ""


def _past_groups(check: QuantityCheck, record: GemmRecord) -> str:
    """Rows of a grouped GEMM's output or grad_input at or past offs[-1] must be exactly zero."""
    if record.op != "grouped_mm" or check.quantity == "grad_weight" or not check.differing_rows:
        return ""
    end = int(record.operands[2][-1]) if record.operands[2].numel() else 0
    past = sum(r >= end for r in check.differing_rows)
    return f" ({past} of them past offs[-1] = {end}, where it must be exactly zero)" if past else ""
