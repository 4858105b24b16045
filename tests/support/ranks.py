"""Several ranks on gloo: a script of this package under torchrun, the figures each rank printed,
and a pair of TorchTitan trainer runs with and without expert parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.repo_root import ROOT

from support.titan_helpers import MODEL_REGISTRIES, run_trainer

__all__ = ["ep_trainer_runs", "every_rank", "torchrun_script"]

SUPPORT = Path(__file__).resolve().parent


def torchrun_script(script: str, *args: str, env: dict | None = None, nproc: int = 2) -> str:
    """Run ``script`` (a file of tests/support) on ``nproc`` ranks; its stdout. The repository root
    is first on the path: its titan_primus, not an installed copy."""
    path = os.pathsep.join([str(ROOT), str(SUPPORT.parent)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(SUPPORT / script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def every_rank(out: str, world: int = 2) -> list[dict]:
    """The figures a script printed with titan_helpers.print_every_rank, rank 0's first; every
    rank must have reported."""
    line = next(row for row in out.splitlines() if row.startswith("RESULT "))
    ranks = json.loads(line.removeprefix("RESULT "))
    assert [r["rank"] for r in ranks] == list(range(world)), line
    return ranks


def ep_trainer_runs(
    tmp_path, converter: str, options: dict, *, steps: int, config="deepseek_v3_debugmodel", env=None, **kwargs
):
    """``config`` (an MoE model's, default deepseek_v3 debug) on 2 gloo ranks with the converter
    override ``converter`` (options as JSON): experts split across the ranks (EP 2), and
    replicated (FSDP 2 only). Returns both runs' losses and the EP run's log."""
    override = ("--override.imports", f"{converter}={json.dumps(options)}")
    common = (*override, "--parallelism.data_parallel_shard_degree", "2")
    # TorchTitan refuses EP's token dispatcher with CUDA graphs on, even on a CPU.
    ep_args = ("--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs")

    def run(dump, *extra):
        module = next(model for model in MODEL_REGISTRIES if config.startswith(model))
        return run_trainer(module, config, dump, steps, *extra, nproc=2, env=env, **kwargs)

    ep, log = run(tmp_path / "ep", *common, *ep_args)
    dp, _ = run(tmp_path / "dp", *common)
    return ep, dp, log
