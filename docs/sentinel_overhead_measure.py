"""Measure the numerics sentinel's overhead on TorchTitan 0.3's debug models (docs/measurements.md).

Each model is converted (rowwise, the backend ``auto`` picks) twice from the same
initialisation, once with the sentinel off and once on with ``sentinel_interval = 2``, and both
train in this process on one batch of ``--seq`` tokens x ``--batch`` with AdamW, as the trainer
does a step: forward, backward, optimizer step (the sentinel's step ends in its optimizer
pre-hook). The steps interleave (off, on-odd, on-even, off, ...) so a loaded machine slows all
three alike, and the time taken is the process's CPU time (one thread: OMP_NUM_THREADS=1), which
other processes on the machine do not inflate: odd steps of the second model are ``watched`` (the every-step NaN/inf checks alone),
even steps ``checked`` (one layer re-computed with the emulation), and the round robin visits
every converted layer once. Prints the median and minimum step time of each, and per layer the
check's own wall-clock time (the sentinel's ``check_ms``: the re-computation and the comparison;
the capture happens during the step).

Usage (repository root): ``PYTHONPATH=.:tests OMP_NUM_THREADS=1 python docs/sentinel_overhead_measure.py``
"""

import argparse
import statistics
import time

import torch
from support.titan_helpers import build, model_config

from titan_primus import sentinel
from titan_primus.torchtitan import Float8Converter


def step(model, optimizer, tokens) -> float:
    """CPU seconds of one step: forward, backward, optimizer step."""
    started = time.process_time()
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.process_time() - started


def measure(name: str, seq: int, batch: int, warmup: int) -> None:
    tokens = torch.randint(0, 2048, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    sentinel.reset()
    models = {}
    for label, interval in (("off", 0), ("on", 2)):
        config = Float8Converter.Config(recipe="rowwise", sentinel_interval=interval, sentinel_capture_folder="")
        model = build(config.build().convert(model_config(name)), seed=0)
        models[label] = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    active = sentinel.active_sentinel()
    for _ in range(warmup):
        for model, optimizer in models.values():
            step(model, optimizer, tokens)
    active.step = 0  # the round robin starts again at the first layer
    active.reports.clear()
    times = {"off": [], "watched": [], "checked": []}
    for _ in active.layers:
        times["off"].append(step(*models["off"], tokens))
        times["watched"].append(step(*models["on"], tokens))
        times["checked"].append(step(*models["on"], tokens))
    checks = [(r.checked_layer, r.check_ms) for r in active.reports]
    assert len(checks) == len(active.layers) and not any(r.breaches for r in active.reports)
    stats = {k: (statistics.median(v), min(v)) for k, v in times.items()}
    off = stats["off"]
    print(
        f"{name}: seq {seq} batch {batch}, {len(checks)} converted layers, {len(checks)} steps each; step CPU s "
        f"(median / min): off {off[0]:.3f} / {off[1]:.3f}; "
        + "; ".join(
            f"{k} {m:.3f} / {n:.3f} ({100 * (m / off[0] - 1):+.1f}% / {100 * (n / off[1] - 1):+.1f}%)"
            for k, (m, n) in stats.items()
            if k != "off"
        )
    )
    ms = [m for _, m in checks]
    print(
        f"  check_ms per layer: median {statistics.median(ms):.1f}, min {min(ms):.1f}, max {max(ms):.1f} "
        f"({max(checks, key=lambda c: c[1])[0]})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3", "deepseek_v3"])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for name in args.models:
        measure(name, args.seq, args.batch, args.warmup)


if __name__ == "__main__":
    main()
