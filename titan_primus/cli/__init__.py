"""``titan-primus``: the command line. Parses arguments only; each subcommand lives in its own
module or folder, imported when it runs: ``doctor.py``, ``report.py``, and one folder per
command with helpers, whose ``command.py`` is its entry: ``parity/`` (with ``--replay``),
``bench/`` (with ``--memory`` and the traffic and memory models), ``validate/`` (the trainer
line, the launcher inside the trainer, the verdicts, the report).

Exit codes: 0 success; 1 a parity case failed, a required backend did not run, or a validate
verdict failed; 2 bad usage
(unknown flag, unreadable or malformed input file), reported in one line.
"""

from __future__ import annotations

import argparse
import sys

from ..device import known_profiles
from ..recipes import RECIPE_NAMES
from ..diagnostics.validate.baseline import COMPARED_FIELDS

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-primus",
        description="Portable FP8 training for TorchTitan: inspect, verify and benchmark the FP8 backends here.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor",
        help="versions, device profile, backends and the routing table (always exits 0)",
        description="Report versions, the device profile, every registered backend and the op x recipe routing table.",
    )
    doctor.add_argument(
        "--device",
        choices=known_profiles(),
        metavar="PROFILE",
        help=f"show a named device profile instead of the detected one ({', '.join(known_profiles())})",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON to stdout instead of tables")
    doctor.add_argument(
        "--check-kernels",
        action="store_true",
        help="also run the numeric self-check conversion runs on every routed op and recipe, and exit 1 if one fails",
    )

    parity = commands.add_parser(
        "parity",
        help="SQNR of every backend against fp32 and each other (exit 1 when a case fails)",
        description="Run op x recipe x shape case x backend and check SQNR of out, grad_input and grad_weight.",
    )
    parity.add_argument(
        "--device", choices=known_profiles(), metavar="PROFILE", help="device profile to test under (default: detected)"
    )
    parity.add_argument("--json", metavar="PATH", help="write the full matrix to PATH (docs/json-schema.md)")
    parity.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="BACKEND",
        help="fail unless BACKEND is available and runs (repeatable)",
    )
    parity.add_argument("--quick", action="store_true", help="a small case set (seconds on a CPU)")
    parity.add_argument(
        "--replay",
        metavar="FILE",
        help="instead of the matrix, re-run a GEMM call the numerics sentinel saved on a breach, on "
        "every backend here, against the emulation (exit 1 when a backend here differs)",
    )

    bench = commands.add_parser(
        "bench",
        help="FP8 vs bf16 forward+backward throughput of linears and grouped GEMMs (--memory: memory)",
        description="Time FP8 linear and grouped GEMM forward+backward per available backend against bf16; "
        "with --memory, audit what each converted layer keeps for backward and model memory per rank.",
    )
    bench.add_argument("--json", metavar="PATH", help="write the results to PATH (docs/json-schema.md)")
    bench.add_argument(
        "--recipe",
        action="append",
        choices=RECIPE_NAMES,
        metavar="RECIPE",
        help=f"recipe to time (repeatable; default: all of {', '.join(RECIPE_NAMES)})",
    )
    bench.add_argument("--iters", type=_positive, metavar="N", help="timed iterations per measurement")
    bench.add_argument("--warmup", type=_positive, metavar="N", help="untimed iterations first")
    bench.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each forward, as TorchTitan compiles its blocks (TorchAO fuses its casts only then)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="one GEMM shape per op, both attention shapes, one iteration (for tests)"
    )
    bench.add_argument(
        "--fsdp-ranks",
        type=_positive,
        default=8,
        metavar="N",
        help="FSDP degree of the modelled all-gather traffic and memory per rank (default 8)",
    )
    bench.add_argument(
        "--device",
        choices=known_profiles(),
        metavar="PROFILE",
        help="with --memory: the device profile to audit under (default: detected)",
    )
    bench.add_argument(
        "--memory",
        action="store_true",
        help="instead of timing: the bytes each backend's converted layer keeps from forward to "
        "backward, and modelled memory per rank of Llama3-8B/70B/405B and DeepSeek-V3-671B "
        "(on a GPU also the measured peak of converted blocks under FSDP2)",
    )
    bench.add_argument(
        "--seq-len",
        type=_positive,
        default=8192,
        metavar="N",
        help="sequence length of the --memory model (default 8192)",
    )
    bench.add_argument(
        "--local-batch",
        type=_positive,
        default=1,
        metavar="N",
        help="sequences per rank and step of the --memory model (default 1)",
    )

    _add_validate(commands)

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
    return parser


def _add_validate(commands) -> None:
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
    validate.add_argument("--quick", action="store_true", help="on a CPU: llama3 debug, 20 steps (minutes)")
    validate.add_argument("--steps", type=_positive, metavar="N", help="training steps of every run")
    validate.add_argument("--seq-len", type=_positive, metavar="N", help="training.seq_len")
    validate.add_argument("--batch", type=_positive, metavar="N", help="training.local_batch_size")
    validate.add_argument("--nproc", type=_positive, metavar="N", help="ranks (default: the GPUs here, or 1)")
    validate.add_argument("--recipe", choices=RECIPE_NAMES, help="FP8 recipe (default: the baseline's, or rowwise)")
    validate.add_argument(
        "--backend",
        metavar="NAME",
        help="FP8 runs only: the backend (primus_turbo, torchao, emulated, a plugin's); FP8 engaged then expects it "
        "(default: TITAN_PRIMUS_BACKEND, else auto, expecting the device's preferred backend)",
    )
    validate.add_argument(
        "--fp8-dispatch", action="store_true", help="FP8 runs only: FP8 token dispatch under expert parallelism"
    )
    validate.add_argument(
        "--attention", action="store_true", help="FP8 runs only: attention on Primus-Turbo (docs/attention.md)"
    )
    validate.add_argument(
        "--fp8-attention",
        action="store_true",
        help="FP8 runs only: FP8 attention where it qualifies (docs/attention.md)",
    )
    validate.add_argument(
        "--filter-fqns",
        metavar="A,B",
        help="FP8 runs only: layers whose FQN contains one of these stay in high precision (default router.gate)",
    )
    validate.add_argument("--seed", type=int, help="seed of the bf16 and FP8 runs (default: the baseline's, or 42)")
    validate.add_argument("--floor-seed", type=int, help="seed of the seed-floor run (default: the baseline's, or 43)")
    validate.add_argument(
        "--window", type=_positive, metavar="N", help="steps per window of the means compared (the baseline's, or 10)"
    )
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            from . import doctor

            return doctor.command(args.device, args.json, sys.stdout, check_kernels=args.check_kernels)
        if args.command == "parity" and args.replay:
            from .parity import replay

            return replay.command(args.replay, args.device, args.json, sys.stdout)
        if args.command == "parity":
            from .parity import command as parity

            return parity.command(args.device, args.quick, args.require, args.json, sys.stdout, sys.stderr)
        if args.command == "bench" and args.memory:
            from .bench import memory_audit

            return memory_audit.command(
                args.recipe or list(RECIPE_NAMES),
                args.quick,
                args.json,
                sys.stdout,
                args.fsdp_ranks,
                args.seq_len,
                args.local_batch,
                args.device,
            )
        if args.command == "bench":
            from .bench import command as bench

            if args.device:
                raise ValueError("bench --device goes with --memory: the timings run on this machine's device")

            return bench.command(
                args.recipe or list(RECIPE_NAMES),
                args.quick,
                args.compile,
                args.iters,
                args.warmup,
                args.json,
                sys.stdout,
                fsdp_ranks=args.fsdp_ranks,
                err=sys.stderr,
            )
        if args.command == "validate":
            from .validate import command as validate

            return validate.command(args, sys.argv[1:] if argv is None else argv, sys.stdout)
        from . import report

        return report.command(args.files, args.png, sys.stdout)
    except (ValueError, OSError) as e:  # bad input: one line, not a traceback
        print(f"titan-primus {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
