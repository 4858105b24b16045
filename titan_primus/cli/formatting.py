"""What every command's output shares: Markdown tables that read in a terminal, output folders made
up front, matplotlib for PNG files, and the one error a malformed results file raises."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ResultsFileError", "markdown_table", "prepare_output", "pyplot"]


class ResultsFileError(ValueError):
    """A results file is missing, unreadable, or not in the documented schema."""


def prepare_output(path: str | None) -> None:
    """Create the parent folder of an output file up front, so a long run cannot end in a failed write."""
    if path:
        Path(path).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table padded to column width, so it reads in a terminal too."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def pyplot():
    """matplotlib's pyplot for writing files (no display); its absence is one ResultsFileError."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ResultsFileError(f"--png needs matplotlib ({e}); pip install matplotlib") from None
    return plt
