"""Replaying a GEMM call the numerics sentinel saved on a breach (titan_primus.sentinel) on every
backend here that can run its recipe definition: ``titan-primus parity --replay FILE`` renders it.

The emulation of the captured recipe definition, on this machine, is the reference. Compared
with it: the outputs the backend on the training machine produced (the "captured" row: does the
breach follow from the inputs alone?), and each backend here, judged as the sentinel judges
(bit for bit where the backend is bit-exact with the emulation, else the 40 dB same-definition
floor, a 20 dB row floor, finite values).
"""

from __future__ import annotations

import torch

from .. import registry
from ..fsdp_fp8 import Fp8GatheredWeight
from ..numerics import QUANTITIES
from ..sentinel.capture import load_capture
from ..sentinel.check import GemmRecord, finite, judge, recompute
from .environment import describe_error, environment, resolve_profile, why_not
from .results import document, format_db

__all__ = ["replay", "replay_document"]


def _host_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _dims(record: GemmRecord) -> tuple[int, int]:
    """(K, N) of the call: a linear's weight is [N, K], a grouped GEMM's B_t [E, K, N]."""
    weight = record.operands[1]
    return (weight.shape[1], weight.shape[0]) if record.op == "linear" else (weight.shape[1], weight.shape[2])


def _for_backend(record: GemmRecord, backend) -> GemmRecord | str:
    """``record`` with its weight as ``backend`` takes it, or why it cannot run it."""
    weight = record.operands[1]
    if not isinstance(weight, Fp8GatheredWeight):
        return record
    taken = backend.takes_gathered_fp8_weight(record.recipe, record.op)
    if not taken:
        return f"the weight was captured as FSDP2 gathered it, in FP8, and {taken.reason}"
    rebuilt = backend.gathered_weight(
        weight.fp8_data(), weight.scale(), weight.dtype, record.recipe, weight._source_dtype
    )
    return GemmRecord(**{**record.__dict__, "operands": (record.operands[0], rebuilt, record.operands[2])})


def _row(source: str, check=None, status: str = "", reason: str = "") -> dict:
    quantities = {q.quantity: q for q in check.quantities} if check else {}
    return {
        "op": check.record.op if check else None,
        "case": "replay",
        "backend": source,
        "status": status,
        "reason": reason or ("; ".join(check.problems) if check else ""),
        "checks": [q.to_json() for q in quantities.values()],
        "sqnr_db": {q: format_db(quantities[q].sqnr_db) if q in quantities else "-" for q in QUANTITIES},
    }


def replay(path: str, device: str | None) -> tuple[list[dict], object, object]:
    """(rows, capture, profile): the captured outputs and every backend here against the emulation."""
    profile = resolve_profile(device)
    capture = load_capture(path, _host_device())
    record = capture.record
    if not all(finite(t) for t in record.operands[:2]):
        raise ValueError(f"{path}: the captured operands are not finite; there is nothing to re-compute")
    backward = finite(record.tensors["grad_output"])  # else forward only: the gradient came in non-finite
    reference = recompute(record, backward=backward)
    captured = judge(
        record, reference, record.tensors if backward else {"out": record.tensors["out"]}, record.bit_exact
    )
    rows = [
        _row(
            f"captured ({record.backend}, training machine)",
            captured,
            "reproduced" if captured.problems else "not reproduced",
        )
    ]
    k, n = _dims(record)
    for backend in registry.backends().values():
        reason = why_not(backend, record.op, record.recipe.name, profile, k=k, n=n)
        accepted = backend.accepts(record.recipe)
        reason = reason or ("" if accepted else f"does not run this definition: {accepted.reason}")
        prepared = reason or _for_backend(record, backend)
        if isinstance(prepared, str):
            rows.append(_row(backend.name, status="skipped", reason=prepared))
            continue
        try:
            outputs = recompute(prepared, backend, backward)
        except Exception as e:  # one backend breaking must not hide the others
            rows.append(_row(backend.name, status="error", reason=describe_error(e)))
            continue
        check = judge(record, reference, outputs, backend.bit_exact_with_emulation(record.op, record.recipe))
        rows.append(_row(backend.name, check, "fail" if check.problems else "pass"))
    return rows, capture, profile


def replay_document(path: str, rows: list[dict], capture, profile, seconds: float) -> dict:
    """The results document of a replay (kind "replay")."""
    record = capture.record
    failed = [r for r in rows[1:] if r["status"] in ("fail", "error")]
    settings = {
        "capture": path,
        "layer": record.layer,
        "gemm": record.gemm,
        "op": record.op,
        "step": capture.step,
        "rank": capture.rank,
        "captured_backend": record.backend,
        "recipe": record.recipe.describe(),
        "breach": capture.problems,
    }
    summary = {
        "reproduced": rows[0]["status"] == "reproduced",
        "failed": len(failed),
        "ok": not failed,
        "seconds": round(seconds, 2),
    }
    return document("replay", environment(profile), settings, rows, summary)
