"""``titan-primus parity``, rendered: the matrix :mod:`titan_primus.diagnostics.parity` runs (its
docstring says what is compared with what, at which bars), as a table, the failures, the
recipes defined differently and the skipped cells; exit 1 on a failure or a required backend that
did not run."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from ... import registry
from ...device import DeviceProfile
from ...diagnostics.environment import environment, resolve_profile
from ...diagnostics.parity import (
    DEFAULT_ATTENTION_CASES,
    DEFAULT_CASES,
    QUICK_ATTENTION_CASES,
    QUICK_CASES,
    Row,
    parity_settings,
    require_problems,
    run_matrix,
)
from ...diagnostics.results import document, prepare_output, write_document
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
from ..progress import progress
from ...diagnostics.results import format_db
from ..report import markdown_table, skip_lines

__all__ = ["command", "render"]


def _same_definition_cell(row: Row) -> str:
    cross = [c for c in row.checks if c.against != "fp32"]
    if not cross:
        return "-"
    return f"vs {cross[0].against}: {format_db(min(c.sqnr_db for c in cross))}"


def _sqnr_table(rows: list[Row], quantities, headers: list[str]) -> str:
    """One line per row that ran: its SQNR vs fp32 per quantity, the same-definition cell, the status."""
    table = []
    for r in rows:
        fp32 = {c.quantity: c.sqnr_db for c in r.checks if c.against == "fp32"}
        table.append(
            [
                r.op,
                r.recipe,
                r.case,
                r.device,
                r.label + (" *" if r.routed else ""),
                *(format_db(fp32[q]) if q in fp32 else "-" for q in quantities),
                _same_definition_cell(r),
                r.status,
            ]
        )
    labels = ["op", "recipe", "case", "profile", "backend (definition)", *headers, "same definition", "status"]
    return markdown_table(labels, table)


def render(
    rows: list[Row], profile: DeviceProfile, cases, required_missing: list[str], seconds: float, attention_cases=()
) -> str:
    ran = [r for r in rows if r.status != "skipped"]
    skipped = [r for r in rows if r.status == "skipped"]
    lines = [
        (
            f"titan-primus parity on {profile.describe()}: {len(cases)} shape cases x {len(RECIPE_NAMES)} recipes "
            f"x {len(registry.backends())} backends, {len(attention_cases)} FP8 attention cases"
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
    definitions: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in ran:
        definitions[r.recipe, r.device].add(r.definition)
    differing = [(key, found) for key, found in definitions.items() if len(found) > 1]
    if differing:
        lines += [
            "",
            (
                "recipes defined differently by the backends here (each compared with fp32 and the emulation "
                "of its own definition, not with each other):"
            ),
        ]
        lines += [f"  {recipe} on {device}: {' vs '.join(sorted(found))}" for (recipe, device), found in differing]
    if skipped:
        lines += ["", f"skipped ({len(skipped)} cells):", *skip_lines([(r.backend, r.reason) for r in skipped])]
    if required_missing:
        lines += ["", "required backends that did not run:"] + [f"  {p}" for p in required_missing]
    counts = Counter(r.status for r in rows)
    totals = ", ".join(
        f"{counts[s]} {word}"
        for s, word in (("pass", "passed"), ("fail", "failed"), ("error", "errors"), ("skipped", "skipped"))
    )
    lines += ["", f"{totals} in {seconds:.1f} s"]
    return "\n".join(lines) + "\n"


def command(device: str | None, quick: bool, required: list[str], json_path: str | None, out, err) -> int:
    """Run the matrix, print it, write ``json_path``; 1 when a case failed or a required backend did not run."""
    profile = resolve_profile(device)
    prepare_output(json_path)
    cases = QUICK_CASES if quick else DEFAULT_CASES
    attention_cases = QUICK_ATTENTION_CASES if quick else DEFAULT_ATTENTION_CASES
    started = time.perf_counter()
    total = len(cases) * len(RECIPE_NAMES) + len(attention_cases)
    with progress("parity", total, err) as reporter:
        rows = run_matrix(profile, cases, RECIPE_NAMES, reporter, attention_cases)
    seconds = time.perf_counter() - started
    missing = require_problems(rows, required, profile)
    counts = Counter(r.status for r in rows)
    ok = not (counts["fail"] or counts["error"] or missing)
    out.write(render(rows, profile, cases, missing, seconds, attention_cases))
    if json_path:
        summary = {status: counts[status] for status in ("pass", "fail", "error", "skipped")}
        summary.update(required_missing=missing, ok=ok, seconds=round(seconds, 2))
        write_document(
            json_path,
            document(
                "parity",
                environment(profile),
                parity_settings(profile, cases, quick, required, attention_cases),
                [r.to_json() for r in rows],
                summary,
            ),
        )
        out.write(f"JSON written to {json_path}\n")
    return 0 if ok else 1
