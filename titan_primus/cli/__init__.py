"""``titan-primus``: the command line. One module per command, each with ``register(commands)``
(its arguments) and ``run(args) -> int`` (call one library function, render its result):
``doctor.py``, ``parity/command.py`` (with ``--replay``), ``bench/command.py`` (with
``--memory``), ``validate/command.py``, ``report.py``. What they compute is in
:mod:`titan_primus.diagnostics`; what their output shares is in ``formatting.py``.

Exit codes: 0 success; 1 a parity case failed, a required backend did not run, or a validate
verdict failed; 2 bad usage
(unknown flag, unreadable or malformed input file), reported in one line.
"""

from __future__ import annotations

import argparse
import sys

from . import doctor, report
from .bench import command as bench
from .parity import command as parity
from .validate import command as validate

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-primus",
        description="Portable FP8 training for TorchTitan: inspect, verify and benchmark the FP8 backends here.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (doctor, parity, bench, validate, report):
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # validate records the command line it ran
    try:
        return args.run(args)
    except (ValueError, OSError) as e:  # bad input: one line, not a traceback
        print(f"titan-primus {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
