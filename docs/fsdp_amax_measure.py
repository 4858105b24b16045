"""Measure what tensorwise FP8 all-gather's amaxes cost per training step (docs/parallelism.md).

Under torchrun (gloo, CPU): the llama3 debug model converted tensorwise, FSDP2 over every rank
(bf16 parameters, fp32 reduction), blocks and root sharded as TorchTitan shards them, AdamW;
``STEPS`` steps after 2 warm-up steps, with FP8 all-gather off and on. Prints, per run, the median
step time (ms) and the all-reduces per step, counted at ``torch.distributed``; then the median
time of one all-reduce of 5 fp32 values (what each FSDP2 parameter group's amaxes cost). Run it
on a checkout of each design to compare them.

Usage (repository root): ``PYTHONPATH=.:tests OMP_NUM_THREADS=1 python -m torch.distributed.run
--standalone --nproc_per_node=2 docs/fsdp_amax_measure.py [STEPS]``
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from support.titan_helpers import build, model_config, token_ids
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_primus.torchtitan import Float8Converter


def main() -> None:
    dist.init_process_group("gloo")
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    counts = {"all_reduce": 0}
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        counts["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    config = Float8Converter.Config(recipe="tensorwise", backend="emulated").build().convert(model_config("llama3"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tokens = token_ids(4, 128, torch.Generator().manual_seed(0))
    for fp8_all_gather in (False, True):
        model = build(config, seed=0)
        for module in model.modules():
            if fp8_all_gather and hasattr(module, "use_fp8_all_gather"):
                module.use_fp8_all_gather()
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times, per_step = [], []
        for step in range(steps + 2):
            counts.update(all_reduce=0)
            dist.barrier()
            start = time.perf_counter()
            model(tokens).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            if step >= 2:
                times.append((time.perf_counter() - start) * 1e3)
                per_step.append(dict(counts))
        if dist.get_rank() == 0:
            print(
                f"fp8_all_gather={fp8_all_gather}: median step {statistics.median(times):.1f} ms "
                f"(min {min(times):.1f}), all-reduces per step {[c['all_reduce'] for c in per_step]}",
                flush=True,
            )
    amaxes, latencies = torch.zeros(5), []
    for _ in range(200):
        start = time.perf_counter()
        all_reduce(amaxes, op=dist.ReduceOp.MAX)
        latencies.append((time.perf_counter() - start) * 1e3)
    if dist.get_rank() == 0:
        print(f"one all-reduce of 5 fp32 amaxes: median {statistics.median(latencies):.3f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
