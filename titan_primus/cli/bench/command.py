"""``titan-primus bench``, rendered: the document :func:`titan_primus.diagnostics.bench.bench_document`
measures (the timings, the sentinel's cost by :mod:`titan_primus.diagnostics.sentinel_cost`, the
traffic modelled by :mod:`titan_primus.diagnostics.traffic`)."""

from __future__ import annotations

import sys
from functools import partial

from ...device import DeviceProfile, detect_device
from ...diagnostics.bench import bench_document, peak_for
from ...diagnostics.results import prepare_output
from ...recipes import RECIPE_NAMES
from ..arguments import add_count, add_profile, add_switch
from ..formatting import column_table, emit, fields, number, outcome_lines
from ..progress import progress
from .traffic import render_ep_traffic, render_traffic

__all__ = ["register", "render", "render_sentinel_cost", "run"]

_TIMING_COLUMNS = (
    *fields("op", "case", "shape", "backend"),
    ("recipe", lambda r: r["recipe"] or "-"),
    ("ms", lambda r: number(r["ms"], ".3g")),
    ("TFLOP/s", lambda r: number(r["tflops"], ".3g")),
    ("x bf16", lambda r: number(r["speedup_vs_bf16"], ".2f")),
    ("% peak", lambda r: number(r["fraction_of_peak"] and 100 * r["fraction_of_peak"], ".1f")),
    *fields("status"),
)
_STOCK_COLUMNS = (
    ("tp/stock", lambda r: number(r.get("titan_primus_vs_stock"), ".2f") if "stock_of" in r else ""),
    ("same bits", lambda r: {True: "yes", False: "no"}.get(r.get("bitwise_equal_to_titan_primus"), "")),
)
_SENTINEL_COLUMNS = (
    *_TIMING_COLUMNS[:5],
    ("plain", lambda r: f"{r['plain_ms']:.3g}"),
    ("watched", lambda r: f"{r['watched_ms']:.3g}"),
    ("checked", lambda r: f"{r['checked_ms']:.3g}"),
    ("every step", lambda r: f"{r['watched_ms'] - r['plain_ms']:+.3g}"),
    ("checked step", lambda r: f"{r['checked_ms'] - r['watched_ms']:+.3g}"),
)


def render(doc: dict, profile: DeviceProfile) -> str:
    """The console report of a bench document: the timings, the sentinel's cost, the traffic models."""
    rows, settings, summary = doc["results"], doc["settings"], doc["summary"]
    found = peak_for(profile.name)
    lines = [
        f"titan-primus bench on {profile.describe()}: forward+backward ({settings['mode']}), "
        f"{settings['warmup']} warm-up + {settings['iters']} timed iterations",
        f"datasheet peak ({found[0]}, dense): FP8 {found[1].fp8:g} TFLOP/s, BF16 {found[1].bf16:g} TFLOP/s"
        if found
        else f"no datasheet peak known for {profile.name!r}: fraction of peak not reported",
        *([settings["note"]] if settings["note"] else []),
        *([settings["attention_flops"]] if any(r["op"] == "attention" for r in rows) else []),
        "",
        column_table(
            # Beside a stock upstream row: titan-primus's time over its, and whether the bits agree.
            (*_TIMING_COLUMNS, *(_STOCK_COLUMNS if any("stock_of" in r for r in rows) else ())),
            [r for r in rows if r["status"] != "skipped"],
        ),
        *[f"{r['backend']}: {r['stock_path']}" for r in {r["backend"]: r for r in rows if "stock_of" in r}.values()],
        *outcome_lines(rows, "measurements", lambda r: f"{r['case']} {r['backend']} {r['recipe']}"),
        "",
        f"{summary['ok']} measured, {summary['error']} errors in {summary['seconds']:.1f} s",
    ]
    return "\n".join(
        [
            *lines,
            "",
            render_sentinel_cost(settings["sentinel_cost"]),
            render_traffic(settings["fsdp_all_gather_model"]),
            render_ep_traffic(settings["ep_all_to_all_model"]),
        ]
    )


def render_sentinel_cost(rows: list[dict]) -> str:
    return (
        "numerics sentinel cost per layer GEMM (forward+backward, ms): every step pays watched - plain per GEMM "
        "call of each converted layer; a checked step pays checked - watched once (docs/sentinel.md)\n"
        f"{column_table(_SENTINEL_COLUMNS, [r for r in rows if r['status'] == 'ok'])}\n"
    )


def register(commands) -> None:
    """Adds the command's parser to ``commands`` (the subparsers of ``titan-primus``)."""
    bench = commands.add_parser(
        "bench",
        help="FP8 vs bf16 forward+backward throughput of linears and grouped GEMMs (--memory: memory)",
        description="Time FP8 linear and grouped GEMM forward+backward per available backend against bf16; "
        "with --memory, audit what each converted layer keeps for backward and model memory per rank.",
    )
    bench.add_argument("--json", metavar="PATH", help="write the results to PATH (docs/json-schema.md)")
    bench.add_argument(
        "--recipe",
        action="append",
        choices=RECIPE_NAMES,
        metavar="RECIPE",
        help=f"recipe to time (repeatable; default: all of {', '.join(RECIPE_NAMES)})",
    )
    add_count(bench, "--iters", "timed iterations per measurement")
    add_count(bench, "--warmup", "untimed iterations first")
    add_switch(
        bench,
        "--compile",
        "torch.compile each forward, as TorchTitan compiles its blocks (TorchAO fuses its casts only then)",
    )
    add_switch(bench, "--quick", "one GEMM shape per op, both attention shapes, one iteration (for tests)")
    add_count(
        bench,
        "--fsdp-ranks",
        "FSDP degree of the modelled all-gather traffic and memory per rank (default 8)",
        default=8,
    )
    add_profile(bench, "with --memory: the device profile to audit under (default: detected)")
    add_switch(
        bench,
        "--memory",
        "instead of timing: the bytes each backend's converted layer keeps from forward to "
        "backward, and modelled memory per rank of Llama3-8B/70B/405B and DeepSeek-V3-671B "
        "(on a GPU also the measured peak of converted blocks under FSDP2)",
    )
    add_count(bench, "--seq-len", "sequence length of the --memory model (default 8192)", default=8192)
    add_count(bench, "--local-batch", "sequences per rank and step of the --memory model (default 1)", default=1)
    bench.set_defaults(run=run)


def run(args) -> int:
    """Measure, print, write --json; 1 when a backend raised."""
    recipes = args.recipe or list(RECIPE_NAMES)
    if args.memory:
        from . import memory_audit

        return memory_audit.run(args, recipes)
    if args.device:
        raise ValueError("bench --device goes with --memory: the timings run on this machine's device")
    prepare_output(args.json)
    reporter = partial(progress, "bench", err=sys.stderr)
    doc = bench_document(recipes, args.quick, args.compile, args.iters, args.warmup, args.fsdp_ranks, reporter)
    emit(sys.stdout, render(doc, detect_device()), doc, args.json)
    return 1 if doc["summary"]["error"] else 0
