"""What every command's output shares: Markdown tables that read in a terminal, and matplotlib for
PNG files."""

from __future__ import annotations

from ..diagnostics.results import ResultsFileError

__all__ = ["markdown_table", "pyplot"]


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
