"""``titan-primus validate``: the upgrade gate, run and rendered (computed by
:mod:`titan_primus.diagnostics.validate`: the plans, the four trainer runs per config, the
verdicts). Exit 1 when a verdict fails or nothing could be trained, 2 on bad usage."""

from __future__ import annotations

import sys

from ...diagnostics.results import prepare_output, write_document
from ...diagnostics.validate.run import RefusedBeforeTraining, validate_document
from .report import plot_validate_png, render_validate_markdown

__all__ = ["command"]


def command(args, argv: list[str], out) -> int:
    prepare_output(args.json)
    prepare_output(args.png)
    try:
        doc = validate_document(args, argv)
    except RefusedBeforeTraining as e:
        print(f"titan-primus validate: FAIL before training: {e}", file=sys.stderr)
        return 1
    if args.json:
        write_document(args.json, doc)
    out.write(render_validate_markdown(doc, args.json or "validate"))
    if args.png:
        plot_validate_png([(args.json or "validate", doc)], args.png)
        out.write(f"\nPNG written to {args.png}\n")
    return 1 if doc["summary"]["failed"] else 0
