"""A TorchTitan trainer run as the tests launch one: a CPU launcher under torchrun on gloo, the
losses the trainer hands its metric loggers (metrics_launch.py), and its log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import titan_primus
from support.repo_root import ROOT

__all__ = ["torchrun_trainer"]

_METRICS_LAUNCH = Path(__file__).resolve().parent / "metrics_launch.py"
PACKAGE_ROOT = Path(titan_primus.__file__).resolve().parent.parent  # a launcher is a module of the package
_WORLD = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_trainer(
    launcher: Path, args: list[str], *, nproc: int, env: dict | None, expect_failure: bool, timeout: int
) -> tuple[dict[int, float], str]:
    """``launcher`` with ``args`` on ``nproc`` ranks; ({step: loss}, log), each loss as TorchTitan's
    metrics rank logged it (NaN included). ``env``: added to the environment. Several ranks under
    torchrun; one rank as a plain process, whose world the launcher sets up (common/cpu_world.py:
    its store binds a free port itself), without torchrun's agent (about 1.6 s of CPU a run)."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "metrics.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        env["TITAN_PRIMUS_TEST_METRICS"] = str(metrics)
        for name in _WORLD:  # a world this process set up in-process is not the run's
            env.pop(name, None)
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        module = ".".join(launcher.resolve().relative_to(PACKAGE_ROOT).with_suffix("").parts)
        proc = subprocess.run(
            [*cmd, str(_METRICS_LAUNCH), module, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log = proc.stdout + proc.stderr
        if (proc.returncode != 0) != expect_failure:
            raise AssertionError(
                f"trainer exit code {proc.returncode} (expected failure: {expect_failure}):\n{log[-6000:]}"
            )
        steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {entry["step"]: entry["loss"] for entry in steps}, log
