"""``titan-primus validate``: the upgrade gate, run and rendered (computed by
:mod:`titan_primus.diagnostics.validate`: the plans, the four trainer runs per config, the
verdicts). Exit 1 when a verdict fails or nothing could be trained, 2 on bad usage."""

from __future__ import annotations

import argparse
import sys

from ...diagnostics.results import prepare_output, write_document
from ...diagnostics.validate.baseline import COMPARED_FIELDS
from ...diagnostics.validate.run import RefusedBeforeTraining, validate_document
from ...recipes import RECIPE_NAMES
from ..arguments import add_count, add_switch
from ..validate_results import plot_validate_png, render_validate_markdown

__all__ = ["register", "run"]


def run(args) -> int:
    out = sys.stdout
    prepare_output(args.json)
    prepare_output(args.png)
    try:
        doc = validate_document(args, args.argv)
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


def register(commands) -> None:
    """Adds the command's parser to ``commands`` (the subparsers of ``titan-primus``)."""
    validate = commands.add_parser(
        "validate",
        help="the upgrade gate: TorchTitan's trainer with FP8 against bf16 and two noise floors "
        "(--baseline: against an earlier run); exit 1 when a verdict fails",
        description="Train bf16, FP8, bf16 at another seed (the seed floor) and FP8 with its initial weights "
        "changed in the last bit (the last-bit floor) on the same data; judge FP8's convergence against bf16 "
        "and, with --baseline, losses, tokens/s and memory against an earlier validate JSON (docs/validate.md). "
        "Arguments after -- go to TorchTitan's trainer.",
    )
    validate.add_argument(
        "--module", help="stock TorchTitan model of the config (llama3, deepseek_v3, qwen3); optional on 0.2.x"
    )
    validate.add_argument(
        "--config",
        help="stock TorchTitan config (e.g. llama3_8b); FP8 runs its titan_primus _fp8 twin. On TorchTitan 0.2.x: "
        "the job's TOML file, FP8 runs it with titan-primus's converter. "
        "Default on a CPU: llama3 and deepseek_v3 debug models on the shipped corpus",
    )
    add_switch(validate, "--quick", "on a CPU: llama3 debug, 20 steps (minutes)")
    add_count(validate, "--steps", "training steps of every run")
    add_count(validate, "--seq-len", "training.seq_len")
    add_count(validate, "--batch", "training.local_batch_size")
    add_count(validate, "--nproc", "ranks (default: the GPUs here, or 1)")
    validate.add_argument("--recipe", choices=RECIPE_NAMES, help="FP8 recipe (default: the baseline's, or rowwise)")
    validate.add_argument(
        "--backend",
        metavar="NAME",
        help="FP8 runs only: the backend (primus_turbo, torchao, emulated, a plugin's); FP8 engaged then expects it "
        "(default: TITAN_PRIMUS_BACKEND, else auto, expecting the device's preferred backend)",
    )
    add_switch(validate, "--fp8-dispatch", "FP8 runs only: FP8 token dispatch under expert parallelism")
    add_switch(validate, "--attention", "FP8 runs only: attention on Primus-Turbo (docs/attention.md)")
    add_switch(validate, "--fp8-attention", "FP8 runs only: FP8 attention where it qualifies (docs/attention.md)")
    validate.add_argument(
        "--filter-fqns",
        metavar="A,B",
        help="FP8 runs only: layers whose FQN contains one of these stay in high precision (default router.gate)",
    )
    validate.add_argument("--seed", type=int, help="seed of the bf16 and FP8 runs (default: the baseline's, or 42)")
    validate.add_argument("--floor-seed", type=int, help="seed of the seed-floor run (default: the baseline's, or 43)")
    add_count(validate, "--window", "steps per window of the means compared (the baseline's, or 10)")
    validate.add_argument(
        "--seed-factor",
        type=float,
        default=1.0,
        help="FP8 vs bf16 bounds: this times the seed floor (default 1)",
    )
    validate.add_argument(
        "--last-bit-factor",
        type=float,
        default=2.0,
        help="baseline loss and grad-norm bounds: this times the last-bit floor (default 2)",
    )
    validate.add_argument(
        "--spike-factor",
        type=float,
        default=3.0,
        help="a grad-norm spike: this times the median of the window before (default 3)",
    )
    validate.add_argument(
        "--tps-tolerance", type=float, default=0.05, help="tokens/s may be this fraction below the baseline's (0.05)"
    )
    validate.add_argument(
        "--memory-tolerance", type=float, default=0.05, help="memory may be this fraction above the baseline's (0.05)"
    )
    validate.add_argument(
        "--baseline",
        metavar="PATH",
        help="an earlier validate JSON; without --config its configs and settings run again",
    )
    validate.add_argument(
        "--allow-mismatch",
        action="append",
        default=[],
        choices=COMPARED_FIELDS,
        metavar="FIELD",
        help=f"compare with a baseline that differs in FIELD (repeatable): {', '.join(COMPARED_FIELDS)}",
    )
    validate.add_argument("--json", metavar="PATH", help="write the results to PATH (docs/json-schema.md)")
    validate.add_argument("--png", metavar="PATH", help="also plot the curves to PATH (titan-primus report does too)")
    validate.add_argument("--work-dir", metavar="DIR", help="keep the trainer logs and dump folders in DIR")
    validate.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then TorchTitan trainer arguments")
    validate.set_defaults(run=run)
