"""Run by test_distributed.py under torchrun (2 ranks, gloo): a converted model sharded with
FSDP2 computes exactly what the unsharded model computes on one device, for tensorwise scales
too, because FSDP2 all-gathers each full weight before the FP8 ops see it. Prints one ``RESULT``
line: whether each rank's forward is bitwise equal, and the parameters whose gradients are not
within 1e-7."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from support.titan_helpers import build, model_config, print_every_rank

from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

from titan_primus.torchtitan import Float8Converter

dist.init_process_group("gloo")
model_name, recipe = sys.argv[1], sys.argv[2]
config = Float8Converter.Config(device="cpu", recipe=recipe).build().convert(model_config(model_name))
single, sharded = build(config, seed=0), build(config, seed=0)
for block in sharded.layers.values():
    fully_shard(block)
fully_shard(sharded)
tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(7))  # same on every rank
outputs = []
for model in (single, sharded):
    out = model(tokens)
    out.float().pow(2).mean().backward()
    outputs.append(out)
apart = [
    name
    for (name, p_single), p_sharded in zip(single.named_parameters(), sharded.parameters())
    # full_tensor: the mean over ranks of identical gradients
    if not torch.allclose(p_single.grad, p_sharded.grad.full_tensor(), rtol=0, atol=1e-7)
]
print_every_rank({"forward_equal": torch.equal(outputs[0], outputs[1]), "gradients_apart": apart})
dist.barrier()
exit_without_teardown(
    0
)  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown
