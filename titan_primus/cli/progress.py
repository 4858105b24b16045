"""What a long command is doing, on stderr: a bar on a terminal; elsewhere (a CI log, a pipe) one
line per item as it starts, so the first compile of a kernel never looks like a hung command."""

from __future__ import annotations

from contextlib import contextmanager

from tqdm import tqdm

__all__ = ["progress"]


class _Progress:
    def __init__(self, command: str, total: int, err):
        self.command, self.total, self.err, self.done = command, total, err, 0
        self.bar = tqdm(total=total, file=err, leave=False) if err.isatty() else None

    def starting(self, what: str) -> None:
        """``what`` (its case, recipe and backend) is about to run."""
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=True)
        else:
            self.err.write(f"{self.command} [{self.done + 1}/{self.total}] {what}\n")
            self.err.flush()

    def finished(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()


@contextmanager
def progress(command: str, total: int, err):
    """A reporter of ``total`` items for ``command``: ``starting(what)`` before each, ``finished()`` after."""
    reporter = _Progress(command, total, err)
    try:
        yield reporter
    finally:
        if reporter.bar is not None:
            reporter.bar.close()
