"""`make demo`: FP8 training through TorchTitan's real trainer on this machine.

Trains TorchTitan 0.3's llama3 debug model (dense) and deepseek_v3 debug model (MoE) for a few
steps each with ``--module titan_primus``, launched by torchrun through the CPU launcher when
there is no GPU, on the tokenizer and corpus shipped in titan_primus/integrations/torchtitan/common/assets. Prints titan-primus's
routing report and the losses, next to a run of the same model without the converter.

``--recipe mxfp8`` (or ``make demo RECIPE=mxfp8``) trains with another FP8 recipe: any of
titan-primus's recipe names, e.g. ``blockwise`` for DeepSeek-V3's 128-block FP8.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from titan_primus.integrations.torchtitan.common.debug_data import CORPUS, TOKENIZER
from titan_primus.integrations.torchtitan.v0_3.trainer import LAUNCHER
from titan_primus.recipes import RECIPE_NAMES

EXAMPLES = Path(__file__).resolve().parent
RUNS = [
    # (model, stock config, titan-primus config, steps)
    ("llama3", "llama3_debugmodel", "llama3_debugmodel_fp8", 10),
    ("deepseek_v3", "deepseek_v3_debugmodel", "deepseek_v3_debugmodel_fp8", 6),
]
LOSS = re.compile(r"step:\s*(\d+)\s.*?loss:\s*([0-9.]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def train(module: str, config: str, steps: int, dump: Path, show_routing: bool) -> dict[int, float]:
    launcher = LAUNCHER
    if torch.cuda.is_available():
        launcher = None  # a real GPU runs TorchTitan's own entry point
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += [str(launcher)] if launcher else ["-m", "torchtitan.train"]
    cmd += [
        "--module",
        module,
        "--config",
        config,
        "--hf_assets_path",
        str(TOKENIZER),
        "--dataloader.dataset_path",
        str(CORPUS),
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "2",
        "--checkpoint.no-enable",
        "--validator.no-enable",
        "--dump_folder",
        str(dump),
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "42",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=EXAMPLES.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    losses: dict[int, float] = {}
    log: list[str] = []
    in_report = False
    for raw in proc.stdout:
        line = ANSI.sub("", raw.rstrip("\n"))
        log.append(line)
        if "titan-primus FP8 routing" in line:
            in_report = show_routing
        elif in_report and not line.startswith("  "):
            in_report = False
        if in_report:
            print("   ", line.split(" - INFO - ")[-1])
        match = LOSS.search(line)
        if match:
            losses[int(match.group(1))] = float(match.group(2))
            print(f"    {config:28s} step {match.group(1):>2}  loss {match.group(2)}", flush=True)
    if proc.wait() != 0:
        print("\n".join(log[-60:]), file=sys.stderr)
        raise SystemExit(f"{config}: the trainer failed (exit {proc.returncode}); its last lines are above")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=RECIPE_NAMES, default="rowwise", help="FP8 recipe (default: rowwise)")
    recipe = parser.parse_args().recipe
    suffix = "" if recipe == "rowwise" else f"_{recipe}"
    with tempfile.TemporaryDirectory(prefix="titan-primus-demo-") as tmp:
        summary = []
        for model, stock, fp8, steps in RUNS:
            fp8 += suffix
            print(f"\n== {model}: {fp8} (titan-primus) ==", flush=True)
            with_fp8 = train("titan_primus", fp8, steps, Path(tmp) / fp8, show_routing=True)
            print(f"\n== {model}: {stock} (no converter, same seed and data) ==", flush=True)
            without = train(model, stock, steps, Path(tmp) / stock, show_routing=False)
            summary.append((model, with_fp8, without))
    print("\n== losses: titan-primus FP8 vs. without converter ==")
    for model, with_fp8, without in summary:
        last = max(with_fp8)
        worst = max(abs(with_fp8[s] - without[s]) / without[s] for s in without)
        print(
            f"{model:12s} step 1 {with_fp8[1]:.3f} -> step {last} {with_fp8[last]:.3f}   "
            f"(without: {without[1]:.3f} -> {without[last]:.3f}; largest step-wise gap {100 * worst:.2f}%)"
        )


if __name__ == "__main__":
    main()
