"""What every command's output shares: Markdown tables that read in a terminal (declared column by
column), the lines that close a run's report (its errors and skipped cells), and matplotlib for
PNG files."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..diagnostics.results import ResultsFileError, prepare_output, write_document

__all__ = [
    "Column",
    "column_table",
    "emit",
    "fields",
    "markdown_table",
    "number",
    "outcome_lines",
    "pyplot",
    "save_png",
    "skip_lines",
]

# A table column: its header and the cell it shows for a row.
Column = tuple[str, Callable[[Any], object]]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table padded to column width, so it reads in a terminal too."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def column_table(columns: Sequence[Column], rows: Iterable) -> str:
    """:func:`markdown_table` of ``rows``, one cell per column."""
    return markdown_table([header for header, _ in columns], [[cell(row) for _, cell in columns] for row in rows])


def fields(*keys: str) -> tuple[Column, ...]:
    """Columns that show a row's ``keys`` as they are, each headed by its key."""
    return tuple((key, lambda row, key=key: row[key]) for key in keys)


def number(value: float | None, pattern: str) -> str:
    """``value`` formatted with ``pattern``; "-" for a figure that was not measured."""
    return "-" if value is None else format(value, pattern)


def skip_lines(skips: list[tuple[str, str]]) -> list[str]:
    """One line per distinct (backend, reason) of the skipped cells, with how many there were."""
    return [f"  {backend} x{count}: {reason}" for (backend, reason), count in Counter(skips).items()]


def outcome_lines(rows: list[dict], noun: str, describe: Callable[[dict], str]) -> list[str]:
    """The lines after a run's table: each error (``describe(row)``: its reason), then the skipped
    rows counted by backend and reason."""
    errors = [r for r in rows if r["status"] == "error"]
    lines = ["", "errors:", *(f"  {describe(r)}: {r['reason']}" for r in errors)] if errors else []
    skipped = [(r["backend"], r["reason"]) for r in rows if r["status"] == "skipped"]
    if skipped:
        lines += ["", f"skipped ({len(skipped)} {noun}):", *skip_lines(skipped)]
    return lines


def emit(out, text: str, doc: dict, json_path: str | None) -> None:
    """A command's report ``text`` to ``out``, and its document to ``json_path`` where given."""
    out.write(text)
    if json_path:
        write_document(json_path, doc)
        out.write(f"JSON written to {json_path}\n")


def pyplot():
    """matplotlib's pyplot for writing files (no display); its absence is one ResultsFileError."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ResultsFileError(f"--png needs matplotlib ({e}); pip install matplotlib") from None
    return plt


def save_png(plt, fig, path: str, rect: tuple[float, float, float, float] | None = None) -> None:
    """``fig`` laid out (within ``rect``) and written to ``path``, then closed."""
    fig.tight_layout(rect=rect)
    prepare_output(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
