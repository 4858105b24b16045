"""Run by test_failure_classes.py under torchrun (2 ranks, gloo): gradient accumulation under
FSDP2 (bf16 parameters, fp32 reduction, as TorchTitan sets it) with FP8 all-gather off and on,
for each backend that runs here: the llama3 debug model, tensorwise, one step of two
microbatches accumulated, the same two as one big batch, and the first microbatch alone (what
Primus PR #1046's bug left). Prints one ``RESULT`` line, each rank's figures per backend: whether
the accumulated gradients are bitwise equal with FP8 all-gather on and off, and the smallest SQNR
over parameters of the accumulated and of the first-only gradients against the big batch's; and,
as the baseline, of the big batch's FP8 gradients against the model's without the converter
(bf16 GEMMs).
"""

import logging
import os
import sys

import torch
import torch.distributed as dist
from support.titan_helpers import build, model_config, print_every_rank

from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import titan_primus as tp
from titan_primus.fsdp_fp8 import Fp8AllGatherWeight
from titan_primus.metrics import sqnr
from titan_primus.torchtitan import Float8Converter

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
dist.init_process_group("gloo")
generator = torch.Generator().manual_seed(7)
microbatches = [torch.randint(0, 2048, (2, 33), generator=generator) for _ in range(2)]  # same on every rank
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def gradients(config, fp8_all_gather: bool, batches, scale: float):
    model = build(config, seed=0)
    for module in model.modules():
        if fp8_all_gather and hasattr(module, "use_fp8_all_gather") and not module.covers_experts:
            module.use_fp8_all_gather()
    for block in model.layers.values():
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for tokens in batches:  # a trainer's microbatch loop: one backward each, gradients accumulate
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        (loss * scale).backward()
    gathered = sum(isinstance(p._local_tensor, Fp8AllGatherWeight) for p in model.parameters())
    return [p.grad.full_tensor() for p in model.parameters()], gathered


stock = model_config("llama3")
high_precision, _ = gradients(stock, False, [torch.cat(microbatches)], 1.0)
BACKENDS = (("emulated", "cpu"), ("torchao", "cpu"))
if os.environ.get("TITAN_PRIMUS_TURBO_BUILD"):  # Primus-Turbo's own code (tests/real_turbo/loader.py) instead
    from real_turbo import loader

    _, why_not = loader.from_environment()
    assert why_not is None, why_not
    tp.registry.refresh()
    BACKENDS = (("primus_turbo", os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")),)
results = {}
for backend, device in BACKENDS:
    config = (
        Float8Converter.Config(device=device, recipe="tensorwise", backend=backend)
        .build()
        .convert(model_config("llama3"))
    )
    off, _ = gradients(config, False, microbatches, 0.5)
    on, gathered = gradients(config, True, microbatches, 0.5)
    big, _ = gradients(config, False, [torch.cat(microbatches)], 1.0)
    first, _ = gradients(config, False, microbatches[:1], 0.5)
    results[backend] = {
        "fp8_gathered_weights": gathered,
        "on_equals_off_bitwise": all(torch.equal(a, b) for a, b in zip(off, on)),
        "vs_big_batch_db": min(sqnr(b, a) for a, b in zip(on, big)),
        "dropped_microbatch_db": min(sqnr(b, f) for f, b in zip(first, big)),
        "big_batch_vs_bf16_db": min(sqnr(h, b) for h, b in zip(high_precision, big)),
    }
print_every_rank(results)
dist.barrier()
exit_without_teardown(
    0
)  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown
