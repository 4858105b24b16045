"""``titan-primus bench --memory`` on a named device profile, optionally with the Primus-Turbo
TEST DOUBLE installed (tests/doubles/: not the real kernels): the Primus-Turbo rows of
docs/measurements.md, "Memory kept from forward to backward".

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python docs/memory_measure.py gfx942 v0.4.0 [--json PATH]
"""

import argparse
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from doubles import primus_turbo_double  # noqa: E402

import titan_primus as tp  # noqa: E402
from titan_primus.cli import memory_audit  # noqa: E402
from titan_primus.cli.memory_model import estimate_rows  # noqa: E402
from titan_primus.recipes import RECIPE_NAMES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile")
    parser.add_argument("double", nargs="?", help="install the Primus-Turbo TEST DOUBLE at this release")
    parser.add_argument("--quick", action="store_true", help="eager only")
    args = parser.parse_args()
    if args.double:
        primus_turbo_double.install(pytest.MonkeyPatch(), version=args.double, arch=args.profile)
        tp.registry.refresh()
    profile = tp.device_profile(args.profile)
    started = time.perf_counter()
    paths = ("eager",) if args.quick else memory_audit.PATHS
    rows = memory_audit.audit_rows(profile, list(RECIPE_NAMES), paths)
    estimates = estimate_rows(memory_audit.gemm_memory_columns(rows), 8, 8192, 1)
    settings = {"fsdp_ranks": 8, "seq_len": 8192, "local_batch": 1}
    print(f"Primus-Turbo: TEST DOUBLE {args.double}" if args.double else "Primus-Turbo: not installed")
    print(memory_audit.render(rows, estimates, None, profile, settings, time.perf_counter() - started))


if __name__ == "__main__":
    main()
