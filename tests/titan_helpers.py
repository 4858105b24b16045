"""Helpers for tests that build TorchTitan 0.3 models or run its trainer on a CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

# The CPU launcher's attention swap (FlexAttention has no CPU backward), reused for models
# built in-process. Importing it also points TorchTitan's device helpers at the CPU.
from cpu_launch import use_causal_sdpa  # noqa: E402

MODEL_REGISTRIES = {
    "llama3": "torchtitan.models.llama3",
    "deepseek_v3": "torchtitan.models.deepseek_v3",
    "qwen3": "torchtitan.models.qwen3",
}


def print_line(text: str) -> None:
    """Print ``text`` as one line in one write. The ranks of a torchrun share one pipe, and under
    PYTHONUNBUFFERED print() writes a line's text and its newline separately, so two ranks'
    lines can interleave ("...: Truerank 1 ...")."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def model_config(model: str, flavor: str = "debugmodel", converters=None):
    """A model config as ``model_registry`` builds it, with CPU-capable attention."""
    import importlib

    registry = importlib.import_module(MODEL_REGISTRIES[model]).model_registry
    config = registry(flavor, converters=converters).model
    use_causal_sdpa(config)
    return config


def build(config, seed: int = 0):
    """Build on the meta device, materialise on the CPU and initialise, as the trainer does."""
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states()
    return model


LOSS = re.compile(r"step:\s*(\d+)\s.*?loss:\s*([0-9.]+)")


def run_trainer(
    module: str,
    config: str,
    dump: Path,
    steps: int,
    *extra: str,
    seq_len: int = 128,
    batch: int = 2,
    nproc: int = 1,
    env: dict | None = None,
    expect_failure: bool = False,
) -> tuple[dict[int, float], str]:
    """Run TorchTitan's real trainer through the CPU launcher (``nproc`` ranks, gloo);
    returns ({step: loss}, log)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(EXAMPLES / "cpu_launch.py"),
        "--module",
        module,
        "--config",
        config,
        "--hf_assets_path",
        str(EXAMPLES / "assets" / "tokenizer"),
        "--dataloader.dataset_path",
        str(EXAMPLES / "assets" / "corpus"),
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(batch),
        "--dump_folder",
        str(dump),
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "42",
        "--validator.no-enable",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if (proc.returncode != 0) != expect_failure:
        raise AssertionError(
            f"trainer exit code {proc.returncode} (expected failure: {expect_failure}):\n{log[-6000:]}"
        )
    return {int(s): float(v) for s, v in LOSS.findall(re.sub(r"\x1b\[[0-9;]*m", "", log))}, log
