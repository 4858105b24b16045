"""``titan-primus bench``, run and rendered (measured by :mod:`titan_primus.diagnostics.bench`; the
sentinel's cost by :mod:`titan_primus.diagnostics.sentinel_cost`; the traffic tables modelled by
:mod:`titan_primus.diagnostics.traffic`)."""

from __future__ import annotations

import sys
import time
from collections import Counter

from ...device import DeviceProfile, detect_device
from ...diagnostics.bench import (
    ATTENTION_FLOPS,
    ATTENTION_SHAPES,
    CPU_DIVISOR,
    GROUPED_SHAPES,
    LINEAR_SHAPES,
    QUICK_CPU_DIVISOR,
    cpu_note,
    peak_for,
    run_attention_bench,
    run_bench,
    gemm_step,
    time_ms,
)
from ...diagnostics.environment import environment
from ...diagnostics.results import document, prepare_output, write_document
from ...diagnostics.sentinel_cost import sentinel_cost
from ...diagnostics.traffic.ep import ep_traffic_rows
from ...diagnostics.traffic.fsdp import traffic_rows
from ..progress import progress
from ..report import markdown_table, skip_lines
from .traffic import render_ep_traffic, render_traffic

__all__ = ["command", "render", "render_sentinel_cost"]


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def render(
    rows: list[dict], profile: DeviceProfile, timing: tuple[int, int], mode: str, note: str, seconds: float
) -> str:
    found = peak_for(profile.name)
    lines = [
        (
            f"titan-primus bench on {profile.describe()}: forward+backward ({mode}), "
            f"{timing[0]} warm-up + {timing[1]} timed iterations"
        )
    ]
    if found:
        lines.append(
            f"datasheet peak ({found[0]}, dense): FP8 {found[1].fp8:g} TFLOP/s, BF16 {found[1].bf16:g} TFLOP/s"
        )
    else:
        lines.append(f"no datasheet peak known for {profile.name!r}: fraction of peak not reported")
    if note:
        lines.append(note)
    if any(r["op"] == "attention" for r in rows):
        lines.append(ATTENTION_FLOPS)
    lines.append("")
    table = [
        [
            r["op"],
            r["case"],
            r["shape"],
            r["backend"],
            r["recipe"] or "-",
            _fmt(r["ms"], ".3g"),
            _fmt(r["tflops"], ".3g"),
            _fmt(r["speedup_vs_bf16"], ".2f"),
            _fmt(r["fraction_of_peak"] and 100 * r["fraction_of_peak"], ".1f"),
            r["status"],
        ]
        for r in rows
        if r["status"] != "skipped"
    ]
    lines.append(
        markdown_table(
            ["op", "case", "shape", "backend", "recipe", "ms", "TFLOP/s", "x bf16", "% peak", "status"], table
        )
    )
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        lines += ["", "errors:"] + [f"  {r['case']} {r['backend']} {r['recipe']}: {r['reason']}" for r in errors]
    skipped = [(r["backend"], r["reason"]) for r in rows if r["status"] == "skipped"]
    if skipped:
        lines += ["", f"skipped ({len(skipped)} measurements):", *skip_lines(skipped)]
    lines += ["", f"{len(rows) - len(skipped) - len(errors)} measured, {len(errors)} errors in {seconds:.1f} s"]
    return "\n".join(lines) + "\n"


def command(
    recipes: list[str],
    quick: bool,
    compile: bool,
    iters: int | None,
    warmup: int | None,
    json_path: str | None,
    out,
    fsdp_ranks: int = 8,
    err=None,
) -> int:
    """Measure, print, write ``json_path``; 1 when a backend raised. Also prints the modelled
    FSDP2 all-gather traffic on ``fsdp_ranks`` ranks with and without FP8 all-gather, and the
    modelled expert-parallel all-to-all traffic with and without FP8 token dispatch."""
    profile = detect_device()
    prepare_output(json_path)
    shapes = (LINEAR_SHAPES[0], GROUPED_SHAPES[0]) if quick else (*LINEAR_SHAPES, *GROUPED_SHAPES)
    on_gpu = profile.kind != "cpu"
    divisor = 1 if on_gpu else QUICK_CPU_DIVISOR if quick else CPU_DIVISOR
    shapes = [s.scaled(divisor) for s in shapes]
    attention_shapes = [s.scaled(divisor) for s in ATTENTION_SHAPES]
    note = "" if on_gpu else cpu_note(divisor)
    timing = (warmup or (1 if quick or not on_gpu else 5), iters or (1 if quick else 20 if on_gpu else 3))
    started = time.perf_counter()
    with progress("bench", len(shapes) + len(attention_shapes), err or sys.stderr) as reporter:
        rows = run_bench(shapes, recipes, timing, profile, compile, reporter)
        rows += run_attention_bench(attention_shapes, timing, profile, compile, reporter)
    seconds = time.perf_counter() - started
    mode = "torch.compile" if compile else "eager"
    out.write(render(rows, profile, timing, mode, note, seconds))
    # The sentinel runs eager only (compile refuses it): its cost is measured eager.
    cost = sentinel_cost(shapes, recipes[0], timing, profile, gemm_step, time_ms)
    out.write("\n" + render_sentinel_cost(cost))
    out.write("\n" + render_traffic(fsdp_ranks))
    out.write("\n" + render_ep_traffic())
    counts = Counter(r["status"] for r in rows)
    if json_path:
        found = peak_for(profile.name)
        settings = {
            "recipes": recipes,
            "quick": quick,
            "mode": mode,
            "warmup": timing[0],
            "iters": timing[1],
            "shape_divisor": divisor,
            "peak": {"device": found[0], "fp8_tflops": found[1].fp8, "bf16_tflops": found[1].bf16} if found else None,
            "note": note,
            "attention_flops": ATTENTION_FLOPS,
            "fsdp_all_gather_model": traffic_rows(fsdp_ranks),
            "ep_all_to_all_model": ep_traffic_rows(),
            "sentinel_cost": cost,
        }
        summary = {status: counts[status] for status in ("ok", "error", "skipped")}
        summary["seconds"] = round(seconds, 2)
        write_document(json_path, document("bench", environment(profile), settings, rows, summary))
        out.write(f"JSON written to {json_path}\n")
    return 1 if counts["error"] else 0


def render_sentinel_cost(rows: list[dict]) -> str:
    lines = [
        "numerics sentinel cost per layer GEMM (forward+backward, ms): every step pays watched - plain per GEMM "
        "call of each converted layer; a checked step pays checked - watched once (docs/sentinel.md)"
    ]
    table = []
    for r in rows:
        if r["status"] != "ok":
            continue
        table.append(
            [
                r["op"],
                r["case"],
                r["shape"],
                r["backend"],
                r["recipe"],
                f"{r['plain_ms']:.3g}",
                f"{r['watched_ms']:.3g}",
                f"{r['checked_ms']:.3g}",
                f"{r['watched_ms'] - r['plain_ms']:+.3g}",
                f"{r['checked_ms'] - r['watched_ms']:+.3g}",
            ]
        )
    lines.append(
        markdown_table(
            ["op", "case", "shape", "backend", "recipe", "plain", "watched", "checked", "every step", "checked step"],
            table,
        )
    )
    return "\n".join(lines) + "\n"
