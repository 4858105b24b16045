"""``titan-primus report``: several results files (:mod:`titan_primus.diagnostics.results`, whose
schema docs/json-schema.md states) side by side as Markdown, optionally a PNG."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..diagnostics.results import ResultsFileError, format_db, load_document, parse_db
from .formatting import markdown_table, pyplot, save_png

__all__ = ["plot_memory_png", "plot_sqnr_png", "register", "render_markdown", "run"]


# --- rendering several files side by side ---------------------------------------------------


def _label(path: str, doc: dict) -> str:
    device = doc["environment"].get("device", {})
    return f"{Path(path).name} ({device.get('arch', '?')})"


def _environment_table(labelled: list[tuple[str, dict]]) -> str:
    fields = [
        ("date", lambda env: env.get("date", "")),
        ("device", lambda env: env.get("device", {}).get("description", "")),
    ]
    names = dict.fromkeys(name for _, doc in labelled for name in doc["environment"].get("versions", {}))
    fields += [(name, lambda env, name=name: env.get("versions", {}).get(name) or "-") for name in names]
    rows = [[name, *(get(doc["environment"]) for _, doc in labelled)] for name, get in fields]
    rows.append(["summary", *(_summary_text(doc) for _, doc in labelled)])
    return markdown_table(["", *(label for label, _ in labelled)], rows)


def _summary_text(doc: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in doc["summary"].items() if isinstance(v, int) and not isinstance(v, bool))


def _side_by_side(columns: list[tuple[str, list[dict]]], key, key_header: list[str], cell, group: int) -> str:
    """One row per distinct ``key(row)``, one column per file ("-" where that file has no such row).
    Rows whose keys share their first ``group`` fields stay together, in the order first seen."""
    found: dict[tuple, dict[int, dict]] = {}
    for i, (_, rows) in enumerate(columns):
        for row in rows:
            found.setdefault(key(row), {})[i] = row
    groups = list(dict.fromkeys(k[:group] for k in found))
    table = [
        [*k, *(cell(found[k][i]) if i in found[k] else "-" for i in range(len(columns)))]
        for k in sorted(found, key=lambda k: groups.index(k[:group]))
    ]
    return markdown_table([*key_header, *(label for label, _ in columns)], table)


def _ran(labelled: list[tuple[str, dict]], kind: str, keep=lambda row: True) -> list[tuple[str, list[dict]]]:
    return [
        (label, [r for r in doc["results"] if r["status"] != "skipped" and keep(r)])
        for label, doc in labelled
        if doc["kind"] == kind
    ]


def _parity_cell(row: dict) -> str:
    fp32 = [c["sqnr_db"] for c in row["checks"] if c["against"] == "fp32"]
    cross = [c for c in row["checks"] if c["against"] != "fp32"]
    text = " / ".join(format_db(db) for db in fp32) or "-"
    if cross:
        text += f"; vs {cross[0]['against']} {format_db(min(parse_db(c['sqnr_db']) for c in cross))}"
    return f"{text} {row['status']}"


def _bench_cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    parts = [f"{row['ms']:.3g} ms", f"{row['tflops']:.3g} TFLOP/s"]
    if row.get("speedup_vs_bf16") is not None:
        parts.append(f"{row['speedup_vs_bf16']:.2f}x bf16")
    if row.get("fraction_of_peak") is not None:
        parts.append(f"{100 * row['fraction_of_peak']:.0f}% peak")
    return ", ".join(parts)


def render_markdown(labelled: list[tuple[str, dict]]) -> str:
    """``labelled`` is [(column label, results document)]; parity and bench files may be mixed.
    Cells that did not run (skipped) are "-"; each file's reasons are in its JSON and console output."""
    out = ["# titan-primus results", "", _environment_table(labelled)]
    if any(doc["kind"] == "parity" for _, doc in labelled):
        out += [
            "",
            (
                '## Parity: what backend="auto" runs, SQNR vs fp32 in dB (out / grad_input / grad_weight; '
                "attention: out / dq / dk / dv)"
            ),
            "",
            _side_by_side(
                _ran(labelled, "parity", lambda r: r["routed"]),
                lambda r: (r["op"], r["recipe"], r["case"]),
                ["op", "recipe", "case"],
                lambda r: f"{r['backend']}: {_parity_cell(r)}",
                group=2,
            ),
            "",
            "## Parity: every backend that ran (and the emulation of each definition)",
            "",
            _side_by_side(
                _ran(labelled, "parity"),
                lambda r: (r["op"], r["recipe"], r["case"], f"{r['backend']} ({r['definition']})"),
                ["op", "recipe", "case", "backend (definition)"],
                _parity_cell,
                group=3,
            ),
        ]
    if any(doc["kind"] == "bench" for _, doc in labelled):
        out += [
            "",
            "## Bench: forward+backward",
            "",
            _side_by_side(
                _ran(labelled, "bench"),
                lambda r: (r["op"], r["case"], r["recipe"] or "-", r["backend"]),
                ["op", "case", "recipe", "backend"],
                _bench_cell,
                group=2,
            ),
        ]
    if any(doc["kind"] == "memory" for _, doc in labelled):
        memory = [(label, doc) for label, doc in labelled if doc["kind"] == "memory"]
        out += [
            "",
            "## Memory: bytes a converted layer keeps from forward to backward, besides its parameter",
            "",
            _side_by_side(
                _ran(memory, "memory"),
                lambda r: (r["op"], r["recipe"], r["case"], r["backend"]),
                ["op", "recipe", "path", "backend"],
                _memory_cell,
                group=2,
            ),
            "",
            "## Memory per rank, GiB, total without / with full activation checkpointing (a MODEL)",
            "",
            _side_by_side(
                [(label, doc.get("estimates", [])) for label, doc in memory],
                lambda e: (e["model"], e["column"]),
                ["model", "column"],
                _estimate_cell,
                group=1,
            ),
        ]
    return "\n".join(out) + "\n"


def _memory_cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    kept = row["kept"]
    return (
        f"{row['kept_bytes']:,} B (FP8 {kept['activation_fp8']:,}, other act. {kept['activation_hp']:,}, "
        f"weight copies {kept['weight_copy']:,})"
    )


def _estimate_cell(row: dict) -> str:
    return f"{row['total_no_ac_bytes'] / 2**30:.1f} / {row['total_full_ac_bytes'] / 2**30:.1f}"


# Headroom past this is drawn at it (bitwise-equal results have infinite SQNR).
_PLOT_CEILING_DB = 40.0


def _series(row: dict) -> str:
    return f"{row['backend']} ({row.get('definition')})"


def _headroom(row: dict) -> float:
    """dB by which the row clears its tightest bar vs fp32 (negative: failed)."""
    margins = [parse_db(c["sqnr_db"]) - c["threshold_db"] for c in row["checks"] if c["against"] == "fp32"]
    return min(margins, default=-math.inf)


def _panels(labelled, kind: str, keep, case_of, missing: str, inches_per_case: float):
    """A figure with one panel per file of ``kind`` (its rows ``keep`` holds) sharing the y axis, one
    bar position per case (``case_of(row)``) of all of them, in the order first seen."""
    plt = pyplot()
    panels = [(label, [r for r in doc["results"] if keep(r)]) for label, doc in labelled if doc["kind"] == kind]
    if not panels:
        raise ResultsFileError(missing)
    cases = list(dict.fromkeys(case_of(r) for _, rows in panels for r in rows))
    size = (6 * len(panels) + 3, inches_per_case * len(cases) + 2.5)
    fig, axes = plt.subplots(1, len(panels), figsize=size, squeeze=False, sharey=True)
    return plt, fig, axes[0], panels, cases


def _finish(plt, fig, axes, path: str, title: str, bottom: float) -> None:
    """One legend of every panel's series (some appear only in later panels), the title, the file."""
    handles = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 4), fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_png(plt, fig, path, rect=(0, bottom, 1, 0.97))


def _sqnr_case(row: dict) -> str:
    return f"{row['op']} {row['recipe']} {row['case']}"


def plot_sqnr_png(labelled: list[tuple[str, dict]], path: str) -> None:
    """Per case and backend, the headroom of SQNR vs fp32 over its bar; one panel per parity file."""
    missing = "--png plots parity SQNR, and none of the files is a parity run"
    plt, fig, axes, parity, cases = _panels(
        labelled, "parity", lambda r: r["status"] != "skipped", _sqnr_case, missing, 0.3
    )
    series = list(dict.fromkeys(_series(r) for _, rows in parity for r in rows))
    colors = {name: f"C{i % 10}" for i, name in enumerate(series)}  # one colour per backend in every panel
    height = 0.8 / len(series)
    for ax, (label, rows) in zip(axes, parity):
        for s, name in enumerate(series):
            mine = [r for r in rows if _series(r) == name]
            ys = [cases.index(_sqnr_case(r)) + s * height for r in mine]
            widths = [max(min(_headroom(r), _PLOT_CEILING_DB), -_PLOT_CEILING_DB) for r in mine]
            edges = ["red" if r["status"] != "pass" else "none" for r in mine]
            ax.barh(ys, widths, height, color=colors[name], edgecolor=edges, linewidth=1.5, label=name)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel(
            f"dB above the bar vs fp32 (tightest of out, grad_input, grad_weight; capped at {_PLOT_CEILING_DB:g})",
            fontsize=7,
        )
    axes[0].set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], cases, fontsize=7)
    axes[0].invert_yaxis()
    title = "titan-primus parity: SQNR headroom per case and backend (below 0 or red edge = failed)"
    _finish(plt, fig, axes, path, title, 0.06)


_MEMORY_COLORS = {"activation_fp8": "C0", "activation_hp": "C1", "weight_copy": "C3", "other": "C7"}


def _memory_case(row: dict) -> str:
    return f"{row['backend']} {row['recipe']} {row['op']} {row['case']}"


def plot_memory_png(labelled: list[tuple[str, dict]], path: str) -> None:
    """Per audited layer, the bytes it keeps for backward stacked by kind (weight copies in red);
    one panel per memory file."""
    plt, fig, axes, memory, cases = _panels(
        labelled, "memory", lambda r: r["status"] == "ok", _memory_case, "no file is a bench --memory run", 0.25
    )
    for ax, (label, rows) in zip(axes, memory):
        left = [0.0] * len(cases)
        for category, color in _MEMORY_COLORS.items():
            ys, widths, starts = [], [], []
            for r in rows:
                i = cases.index(_memory_case(r))
                ys.append(i)
                widths.append(r["kept"][category] / 1024)
                starts.append(left[i])
                left[i] += r["kept"][category] / 1024
            ax.barh(ys, widths, left=starts, color=color, label=category.replace("_", " "))
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("KiB kept from forward to backward, besides the parameter", fontsize=7)
    axes[0].set_yticks(range(len(cases)), cases, fontsize=6)
    axes[0].invert_yaxis()
    _finish(plt, fig, axes, path, "titan-primus bench --memory: what each converted layer keeps for backward", 0.05)


def run(args) -> int:
    paths, png, out = args.files, args.png, sys.stdout
    labelled = [(_label(p, doc), doc) for p, doc in ((p, load_document(p)) for p in paths)]
    validate = [(Path(p).name, doc) for p, (_, doc) in zip(paths, labelled) if doc["kind"] == "validate"]
    if validate:  # validate files render on their own: verdicts, runs, curves
        from .validate_results import plot_validate_png, render_validate_markdown

        if len(validate) < len(labelled):
            raise ResultsFileError("validate files are rendered on their own: give them without parity/bench files")
        out.write("\n".join(render_validate_markdown(doc, label) for label, doc in validate))
        if png:
            plot_validate_png(validate, png)
            out.write(f"\nPNG written to {png}\n")
        return 0
    out.write(render_markdown(labelled))
    if png:
        kinds = {doc["kind"] for _, doc in labelled}
        targets = []
        if "parity" in kinds or "memory" not in kinds:
            plot_sqnr_png(labelled, png)
            targets.append(png)
        if "memory" in kinds:
            target = png if not targets else str(Path(png).with_name(f"{Path(png).stem}-memory{Path(png).suffix}"))
            plot_memory_png(labelled, target)
            targets.append(target)
        out.write("".join(f"\nPNG written to {t}\n" for t in targets))
    return 0


def register(commands) -> None:
    """Adds the command's parser to ``commands`` (the subparsers of ``titan-primus``)."""
    report = commands.add_parser(
        "report",
        help="render parity/bench/memory JSON files side by side as Markdown (or a validate file)",
        description="Render parity, bench and bench --memory results files side by side as Markdown, optionally a PNG plot.",
    )
    report.add_argument("files", nargs="+", metavar="FILE", help="results files written with --json")
    report.add_argument(
        "--png",
        metavar="PATH",
        help="also plot SQNR per case per backend (parity files) or bytes kept per layer (memory files) "
        "to PATH; both kinds: the memory plot goes to PATH with '-memory' before the suffix "
        "(needs matplotlib); a validate file: its loss curves, tokens/s and memory",
    )
    report.set_defaults(run=run)
