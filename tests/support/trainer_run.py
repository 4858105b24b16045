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


def torchrun_trainer(
    launcher: Path, args: list[str], *, nproc: int, env: dict | None, expect_failure: bool, timeout: int
) -> tuple[dict[int, float], str]:
    """``launcher`` with ``args`` on ``nproc`` ranks; ({step: loss}, log). ``env``: added to the
    environment. Always torchrun, one rank too: its standalone rendezvous binds its own port, where
    a plain launch (cpu_world picks a free port, then releases it) can lose the port to a
    concurrent test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(launcher), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    log = proc.stdout + proc.stderr
    if (proc.returncode != 0) != expect_failure:
        raise AssertionError(
            f"trainer exit code {proc.returncode} (expected failure: {expect_failure}):\n{log[-6000:]}"
        )
    return {int(s): float(v) for s, v in _LOSS.findall(_COLOUR.sub("", log))}, log
