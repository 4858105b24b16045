"""``titan-primus parity --replay FILE``: a GEMM call the numerics sentinel saved on a breach, run
again here on every backend that can run its recipe definition (titan_primus.diagnostics.replay),
so a report from a cluster can be reproduced on a workstation. Exit code 1 when a backend here
fails or raises; the captured row only informs.
"""

from __future__ import annotations

import sys
import time

from ...diagnostics.replay import replay, replay_document
from ...diagnostics.results import prepare_output
from ...numerics import QUANTITIES
from ..formatting import emit, markdown_table

__all__ = ["run"]


def render(rows: list[dict], capture, path: str, seconds: float) -> str:
    record = capture.record
    lines = [
        f"titan-primus parity --replay {path}",
        f"captured by the numerics sentinel: {record.describe()}, step {capture.step}, rank {capture.rank}",
        *(f"  breach: {p}" for p in capture.problems),
        "reference: the emulation of the same recipe definition, here",
    ]
    if capture.tensor_parallel:
        lines.append(
            "note: captured under tensor parallelism: this is one rank's shard, re-computed here without "
            "the amax reductions across the TP group, so scales may differ from the training run's"
        )
    lines.append("")
    ran = [r for r in rows if r["status"] != "skipped"]
    lines.append(
        markdown_table(
            ["source", *QUANTITIES, "status"],
            [[r["backend"], *(r["sqnr_db"][q] for q in QUANTITIES), r["status"]] for r in ran],
        )
    )
    if ran[0]["status"] == "not reproduced":
        lines += [
            "",
            "the captured outputs agree with the emulation here: the breach does not follow from these inputs "
            "alone (a non-deterministic kernel, or state outside this GEMM call)",
        ]
    problems = [r for r in ran[1:] if r["reason"]]  # the captured row's are the breach, listed above
    if problems:
        lines += ["", *(f"{r['backend']}: {r['reason']}" for r in problems)]
    skipped = [r for r in rows if r["status"] == "skipped"]
    if skipped:
        lines += ["", "skipped here:", *(f"  {r['backend']}: {r['reason']}" for r in skipped)]
    lines += [
        "",
        f"{sum(r['status'] == 'pass' for r in ran)} backends agree with the emulation, "
        f"{sum(r['status'] in ('fail', 'error') for r in ran)} do not, in {seconds:.1f} s",
    ]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    """Replay ``args.replay``; 1 when a backend here differs from the emulation or raises."""
    path = args.replay
    prepare_output(args.json)
    started = time.perf_counter()
    rows, capture, profile = replay(path, args.device)
    seconds = time.perf_counter() - started
    doc = replay_document(path, rows, capture, profile, seconds)
    emit(sys.stdout, render(rows, capture, path, seconds), doc, args.json)
    return 1 if any(r["status"] in ("fail", "error") for r in rows[1:]) else 0
