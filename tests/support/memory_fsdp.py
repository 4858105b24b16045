"""Run by test_memory.py under torchrun (2 ranks, gloo): a converted debug model under FSDP2 (bf16
parameters, every transformer block resharded after its forward), one forward recording what
autograd keeps for backward; once the forward is over, prints the bytes each rank keeps by kind
(titan_primus.diagnostics.memory.saved.kept_for_backward): copies of FP8 layers' weights, FP8 and other
activations, and the storage of parameters (FSDP-managed: the root's, which FSDP2 keeps unsharded
after its forward; the blocks' are freed) and buffers (RoPE caches).

Usage: memory_fsdp.py MODEL RECIPE DEVICE_PROFILE BACKEND [OPTIONS...]
OPTIONS: ``fp8_all_gather`` (the converter's enable_fsdp_float8_all_gather), ``seq=N`` (tokens
per sequence, default 31; a weight is told apart by its shape, so no activation may share one). BACKEND
``primus_turbo``: Primus-Turbo's own code, the build the environment names
(tests/real_turbo/loader.py).
"""

import sys

import torch
import torch.distributed as dist
from support.titan_helpers import build, model_config, print_line

from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_primus.diagnostics.memory.saved import kept_for_backward, recording_saved_tensors
from titan_primus.torchtitan import Float8Converter

import titan_primus as tp

dist.init_process_group("gloo")
model_name, recipe, device, backend = sys.argv[1:5]
options = dict(arg.partition("=")[::2] for arg in sys.argv[5:])
if backend == "primus_turbo":
    from real_turbo import loader

    _, why_not = loader.from_environment()
    assert why_not is None, why_not
    tp.registry.refresh()

converter = Float8Converter.Config(
    device=device, recipe=recipe, backend=backend, enable_fsdp_float8_all_gather="fp8_all_gather" in options
).build()
model = build(converter.convert(model_config(model_name)), seed=0)
fp8_weights = [
    tuple(p.shape)
    for m in model.modules()
    if hasattr(m, "fp8_weight_names")
    for name in m.fp8_weight_names
    for p in [getattr(m, name)]
]
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.layers.values():
    fully_shard(block, mp_policy=mp, reshard_after_forward=True)
fully_shard(model, mp_policy=mp)

tokens = torch.randint(0, 2048, (2, int(options.get("seq", 31)) + 1), generator=torch.Generator().manual_seed(7))
with recording_saved_tensors() as saved:
    logits = model(tokens[:, :-1])
loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
# What the parameters are now: the blocks' sharded (their unsharded storages freed), the root's
# unsharded until its backward.
kept = kept_for_backward(saved, fp8_weights, parameters=[*model.parameters(), *model.buffers()])
resharded = all(type(p).__name__ == "DTensor" for block in model.layers.values() for p in block.parameters())
print_line(
    f"rank {dist.get_rank()} kept after the forward, per rank: weight copies {kept['weight_copy']} B, "
    f"FP8 activations {kept['activation_fp8']} B, other activations {kept['activation_hp']} B, "
    f"parameters and buffers {kept['parameter']} B; weights resharded: {resharded}"
)
del saved
loss.backward()
dist.barrier()
exit_without_teardown(
    0
)  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown
