"""A TorchTitan trainer run as the tests launch one: a CPU launcher under torchrun on gloo, its
losses and its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.repo_root import ROOT

__all__ = ["torchrun_trainer"]

_LOSS = re.compile(r"step:\s*(\d+)\s.*?loss:\s*([0-9.]+)")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_WORLD = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_trainer(
    launcher: Path, args: list[str], *, nproc: int, env: dict | None, expect_failure: bool, timeout: int
) -> tuple[dict[int, float], str]:
    """``launcher`` with ``args`` on ``nproc`` ranks; ({step: loss}, log). ``env``: added to the
    environment. Several ranks under torchrun; one rank as a plain process, whose world the
    launcher sets up (common/cpu_world.py: its store binds a free port itself), without torchrun's
    agent (about 1.6 s of CPU a run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for name in _WORLD:  # a world this process set up in-process is not the run's
        env.pop(name, None)
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(launcher), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    log = proc.stdout + proc.stderr
    if (proc.returncode != 0) != expect_failure:
        raise AssertionError(
            f"trainer exit code {proc.returncode} (expected failure: {expect_failure}):\n{log[-6000:]}"
        )
    return {int(s): float(v) for s, v in _LOSS.findall(_COLOUR.sub("", log))}, log
