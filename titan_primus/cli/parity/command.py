"""``titan-primus parity``, rendered: the matrix :mod:`titan_primus.diagnostics.parity` runs (its
docstring says what is compared with what, at which bars), as a table, the failures, the
recipes defined differently and the skipped cells; exit 1 on a failure or a required backend that
did not run."""

from __future__ import annotations

import sys
from functools import partial

from ... import registry
from ...device import DeviceProfile
from ...diagnostics.environment import resolve_profile
from ...diagnostics.parity import Row, differing_definitions, parity_document
from ...diagnostics.results import format_db, prepare_output
from ...numerics import (
    ATTENTION_QUANTITIES,
    E4M3_BAR_DB,
    E5M2_BAR_DB,
    FP8_ATTENTION_BAR_DB,
    HIGH_PRECISION_BAR_DB,
    QUANTITIES,
    SAME_DEFINITION_BAR_DB,
)
from ...recipes import RECIPE_NAMES
from ..arguments import add_profile, add_switch
from ..formatting import column_table, emit, skip_lines
from ..progress import progress

__all__ = ["register", "render", "run"]


def _same_definition_cell(row: Row) -> str:
    cross = [c for c in row.checks if c.against != "fp32"]
    if not cross:
        return "-"
    return f"vs {cross[0].against}: {format_db(min(c.sqnr_db for c in cross))}"


def _fp32_cell(quantity: str):
    def cell(row: Row) -> str:
        found = [c.sqnr_db for c in row.checks if c.against == "fp32" and c.quantity == quantity]
        return format_db(found[0]) if found else "-"

    return cell


def _sqnr_table(rows: list[Row], quantities, headers: list[str]) -> str:
    """One line per row that ran: its SQNR vs fp32 per quantity, the same-definition cell, the status."""
    columns = (
        ("op", lambda r: r.op),
        ("recipe", lambda r: r.recipe),
        ("case", lambda r: r.case),
        ("profile", lambda r: r.device),
        ("backend (definition)", lambda r: r.label + (" *" if r.routed else "")),
        *zip(headers, map(_fp32_cell, quantities)),
        ("same definition", _same_definition_cell),
        ("status", lambda r: r.status),
    )
    return column_table(columns, rows)


def render(rows: list[Row], doc: dict, profile: DeviceProfile) -> str:
    """The console report of a parity run: its rows and the document :func:`parity_document` made of them."""
    ran = [r for r in rows if r.status != "skipped"]
    skipped = [r for r in rows if r.status == "skipped"]
    summary, cases = doc["summary"], doc["settings"]["cases"]
    attention_cases = sum(c["op"] == "attention" for c in cases)
    lines = [
        (
            f"titan-primus parity on {profile.describe()}: {len(cases) - attention_cases} shape cases x "
            f"{len(RECIPE_NAMES)} recipes x {len(registry.backends())} backends, {attention_cases} FP8 attention cases"
        ),
        (
            f"bars: vs fp32 {E4M3_BAR_DB:g} dB (e4m3 GEMMs), {E5M2_BAR_DB:g} dB (GEMMs with an e5m2 operand), "
            f"{HIGH_PRECISION_BAR_DB:g} dB (high-precision GEMMs), {FP8_ATTENTION_BAR_DB:g} dB (FP8 attention vs "
            f"fp32 SDPA); same definition {SAME_DEFINITION_BAR_DB:g} dB; "
            '* = what backend="auto" picks'
        ),
        "",
        _sqnr_table([r for r in ran if r.op != "attention"], QUANTITIES, ["out", "grad_in", "grad_w"]),
    ]
    attention = [r for r in ran if r.op == "attention"]
    if attention:
        lines += ["", _sqnr_table(attention, ATTENTION_QUANTITIES, list(ATTENTION_QUANTITIES))]
    failed = [r for r in ran if r.status != "pass"]
    if failed:
        lines += ["", "failures:"] + [f"  {r.op}/{r.recipe}/{r.case} {r.label}: {r.status}: {r.reason}" for r in failed]
    differing = differing_definitions(ran)
    if differing:
        lines += [
            "",
            (
                "recipes defined differently by the backends here (each compared with fp32 and the emulation "
                "of its own definition, not with each other):"
            ),
            *(f"  {recipe} on {device}: {' vs '.join(found)}" for recipe, device, found in differing),
        ]
    if skipped:
        lines += ["", f"skipped ({len(skipped)} cells):", *skip_lines([(r.backend, r.reason) for r in skipped])]
    if summary["required_missing"]:
        lines += ["", "required backends that did not run:"] + [f"  {p}" for p in summary["required_missing"]]
    totals = ", ".join(
        f"{summary[s]} {word}"
        for s, word in (("pass", "passed"), ("fail", "failed"), ("error", "errors"), ("skipped", "skipped"))
    )
    lines += ["", f"{totals} in {summary['seconds']:.1f} s"]
    return "\n".join(lines) + "\n"


def register(commands) -> None:
    """Adds the command's parser to ``commands`` (the subparsers of ``titan-primus``)."""
    parity = commands.add_parser(
        "parity",
        help="SQNR of every backend against fp32 and each other (exit 1 when a case fails)",
        description="Run op x recipe x shape case x backend and check SQNR of out, grad_input and grad_weight.",
    )
    add_profile(parity, "device profile to test under (default: detected)")
    parity.add_argument("--json", metavar="PATH", help="write the full matrix to PATH (docs/json-schema.md)")
    parity.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="BACKEND",
        help="fail unless BACKEND is available and runs (repeatable)",
    )
    add_switch(parity, "--quick", "a small case set (seconds on a CPU)")
    parity.add_argument(
        "--replay",
        metavar="FILE",
        help="instead of the matrix, re-run a GEMM call the numerics sentinel saved on a breach, on "
        "every backend here, against the emulation (exit 1 when a backend here differs)",
    )
    parity.set_defaults(run=run)


def run(args) -> int:
    """Run the matrix, print it, write --json; 1 when a case failed or a required backend did not run."""
    if args.replay:
        from . import replay

        return replay.run(args)
    profile = resolve_profile(args.device)
    prepare_output(args.json)
    doc, rows = parity_document(profile, args.quick, args.require, partial(progress, "parity", err=sys.stderr))
    emit(sys.stdout, render(rows, doc, profile), doc, args.json)
    return 0 if doc["summary"]["ok"] else 1
