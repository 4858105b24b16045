"""Run by test_fsdp_fp8_all_gather.py under torchrun (2 ranks, gloo): one converted model trained
for a few steps under FSDP2 (bf16 parameters, fp32 reduction, as TorchTitan sets it) twice from
the same initialisation, the weights of its FP8 linears and MoE experts all-gathered in bf16 and
then in FP8 where the converter (enable_fsdp_float8_all_gather) gathers them so (the recipe
allows it, the weight is not tied to another module). Prints one ``RESULT`` line, each rank's
figures: whether losses, gradients and updated weights are bitwise equal, and the bytes
all-gathered per step, counted at the collective (all of it) and at the FP8 hooks (the FP8
weights' payload).

Usage: fsdp_fp8_all_gather.py MODEL RECIPE DEVICE_PROFILE BACKEND STEPS [OPTIONS...]
OPTIONS: ``shapes`` (then single FP8 linears with fewer rows than ranks and uneven rows, FP8 against
bf16 all-gather: :func:`uneven_and_empty_rows`); ``experts_shard1`` (FSDP2 shards expert weights on dim 1, as TorchTitan does when the FSDP
degree exceeds the number of experts); ``cpu_offload`` (the FP8 all-gather run under FSDP2's
``CPUOffloadPolicy``, compared with the bf16 all-gather without it; FSDP2 then copies each shard to
the device before its pre-all-gather hook, ``.to(device)``: on a CPU that aliases, so here the copy
is made as a CPU-to-GPU move makes it, one ``aten._to_copy`` reaching the shard's tensor subclass). Primus-Turbo's own code is imported first where the
environment names a build (tests/real_turbo/loader.py: ``TITAN_PRIMUS_TURBO_BUILD`` ...).
"""

import logging
import sys

import torch
import torch.distributed as dist
from support.titan_helpers import build, model_config, print_every_rank

from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from titan_primus.fsdp_fp8 import Fp8AllGatherWeight, fp8_all_gather_plan
from titan_primus.torchtitan import Float8Converter

import titan_primus as tp

logging.basicConfig(
    stream=sys.stdout, level=logging.WARNING, format="%(message)s"
)  # titan-primus's warnings, for the test
dist.init_process_group("gloo")
model_name, recipe, device, backend, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
options = dict(arg.partition("=")[::2] for arg in sys.argv[6:])
if backend == "primus_turbo":
    from real_turbo import loader

    _, why_not = loader.from_environment()
    assert why_not is None, why_not
    tp.registry.refresh()
world = dist.get_world_size()

gathered = {"collective": 0, "fp8_hooks": 0, "amax_all_reduces": 0, "high_precision": 0, "fp8_by_shard_dim": {}}
_all_gather_single, _all_reduce = dist.all_gather_single, dist.all_reduce


def _counting_all_reduce(tensor, *args, **kwargs):
    gathered["amax_all_reduces"] += 1
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = _counting_all_reduce


def _counting_all_gather(output, input, *args, **kwargs):
    gathered["collective"] += output.numel() * output.element_size()
    return _all_gather_single(output, input, *args, **kwargs)


dist.all_gather_single = _counting_all_gather  # what FSDP2's default all-gather calls
_pre_all_gather = Fp8AllGatherWeight.fsdp_pre_all_gather


def _counting_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 reads the signature
    inputs, metadata = _pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
    gathered["fp8_hooks"] += world * sum(t.numel() * t.element_size() for t in inputs)
    scales = metadata[0]
    if isinstance(scales, torch.Tensor) and scales.dim():  # row or block scales gathered on their own (uneven rows)
        gathered["fp8_hooks"] += world * -(-scales.shape[0] // world) * scales[0].numel() * 4
    gathered["high_precision"] += metadata[0] == "high precision"
    if metadata[0] != "high precision":  # an FP8 gather, by the dim FSDP2 shards the weight on
        dim = str(next((d for d, (a, b) in enumerate(zip(self.shape, outer_size)) if a != b), 0))
        gathered["fp8_by_shard_dim"][dim] = gathered["fp8_by_shard_dim"].get(dim, 0) + 1
    return inputs, metadata


Fp8AllGatherWeight.fsdp_pre_all_gather = _counting_pre_all_gather
offload = "cpu_offload" in options
if offload:

    def _moving_to(self, *args, **kwargs):  # FSDP2's .to(device) of the offloaded shard, as to a GPU
        return torch.Tensor.to(self, *args, copy=True, **kwargs)

    Fp8AllGatherWeight.to = _moving_to

# The converter decides which weights FSDP2 gathers in FP8 (not a tied one), as in training.
configs = {
    on: Float8Converter.Config(device=device, recipe=recipe, backend=backend, enable_fsdp_float8_all_gather=on)
    .build()
    .convert(model_config(model_name))
    for on in (False, True)
}
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fp8_modules(model):
    """The FP8 linears and expert blocks whose weights this recipe and backend can gather in FP8."""
    for module in model.modules():
        if hasattr(module, "use_fp8_all_gather"):
            op = "grouped_mm" if module.covers_experts else "linear"
            if fp8_all_gather_plan(module.fp8_backend, module.fp8_recipe, op)[0] is not None:
                yield module


def sharded(fp8_all_gather: bool):
    model = build(configs[fp8_all_gather], seed=0)
    expert_weights = {p for module in fp8_modules(model) if module.covers_experts for p in module.parameters()}
    placement = (lambda p: Shard(1) if p in expert_weights else None) if "experts_shard1" in options else None
    # The FP8 run offloaded, the bf16 one not: equal results cover both.
    offload_policy = CPUOffloadPolicy(pin_memory=False) if offload and fp8_all_gather else None
    for block in model.layers.values():
        fully_shard(block, mp_policy=mp, shard_placement_fn=placement, offload_policy=offload_policy)
    fully_shard(model, mp_policy=mp, offload_policy=offload_policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


generator = torch.Generator().manual_seed(7)
batches = [torch.randint(0, 2048, (2, 32), generator=generator) for _ in range(steps)]  # same on every rank
runs = {}
for fp8_all_gather in (False, True):
    model, optimizer = sharded(fp8_all_gather)
    losses, grads, bytes_per_step = [], [], []
    for tokens in batches:
        gathered.update(collective=0, fp8_hooks=0, amax_all_reduces=0, high_precision=0, fp8_by_shard_dim={})
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        bytes_per_step.append(dict(gathered))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    runs[fp8_all_gather] = losses, grads, bytes_per_step, state
    fp8_gathered = {
        kind: sum(
            isinstance(getattr(p, "_local_tensor", p), Fp8AllGatherWeight)
            for m in fp8_modules(model)
            if m.covers_experts == (kind == "experts")
            for p in m.parameters()
        )
        for kind in ("linears", "experts")
    }
    # reported, as fp8_gathered, for the last run (FP8 all-gather); None where no weight is tied
    tied = (
        model.tok_embeddings.weight is model.lm_head.weight
        if getattr(model.config, "enable_weight_tying", False)
        else None
    )


def uneven_and_empty_rows() -> dict[int, str]:
    """One FP8 linear alone in its FSDP2 group, its weight [N, 256] with N = world - 1 and world + 1
    (some ranks hold no row) and 2 * world + 1 (an uneven last shard); block-scaled recipes: N =
    128 * world - 1 (whole 128-row blocks, the last one partial), 128 * world + 1 and
    128 * (world - 1) (shards of other sizes: high precision). Forward and weight gradient with
    the FP8 all-gather against the bf16 one, bit for bit, for each N, and how the weight went
    (``fp8`` or ``high precision``)."""
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    found = {}
    block_scaled = next(fp8_modules(build(configs[True], seed=0))).fp8_recipe.block_scaled
    all_rows = (
        (128 * world - 1, 128 * world + 1, 128 * (world - 1)) if block_scaled else (world - 1, world + 1, 2 * world + 1)
    )
    for rows in all_rows:
        runs = []
        for fp8 in (False, True):
            linear = build(configs[False], seed=0).layers["0"].feed_forward.w1
            linear.weight = torch.nn.Parameter(torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)))
            if fp8:
                linear.use_fp8_all_gather()
            fully_shard(linear, mp_policy=mp)
            gathered["high_precision"] = 0
            try:
                out = linear(x)
                out.float().square().mean().backward()
            except Exception as error:
                found[rows] = f"{type(error).__name__}: {error}"
                break
            runs.append((out.detach(), linear.weight.grad.full_tensor()))
        if len(runs) == 2:
            (out_bf16, grad_bf16), (out_fp8, grad_fp8) = runs
            equal = torch.equal(out_bf16, out_fp8) and torch.equal(grad_bf16, grad_fp8)
            how = "high precision" if gathered["high_precision"] else "fp8"
            found[rows] = f"{'equal' if equal else 'different'}, {how}"
    return found


(l0, g0, b0, s0), (l1, g1, b1, s1) = runs[False], runs[True]
assert all(type(v) is torch.Tensor for v in s1.values()), "state dict must hold plain tensors"
assert {k: (v.shape, v.dtype) for k, v in s0.items()} == {k: (v.shape, v.dtype) for k, v in s1.items()}
loss_equal = all(torch.equal(a, b) for a, b in zip(l0, l1))
grads_equal = all(torch.equal(a, b) for step0, step1 in zip(g0, g1) for a, b in zip(step0, step1))
weights_equal = all(torch.equal(s0[k], s1[k]) for k in s0)
off, on = b0[-1]["collective"], b1[-1]["collective"]
fp8_payload = b1[-1]["fp8_hooks"]
bf16_payload = off - (on - fp8_payload)  # the same weights' bytes when gathered in bf16
print_every_rank(
    {
        "losses": [round(float(v), 6) for v in l1],
        "amax_all_reduces_per_step": [b["amax_all_reduces"] for b in b1],
        "bitwise_equal": {"loss": loss_equal, "grads": grads_equal, "weights": weights_equal},
        "fp8_gathered_weights": fp8_gathered,
        "weights_tied": tied,
        # all of each step's all-gathers, and the FP8 weights' alone, gathered in bf16 and in FP8
        "all_gathered_bytes": {"bf16": off, "fp8": on},
        "fp8_weight_bytes": {"bf16": bf16_payload, "fp8": fp8_payload},
        # FP8 layers' weights gathered in high precision after all, in the last step
        "high_precision_gathers": b1[-1]["high_precision"],
        "fp8_gathers_by_shard_dim": b1[-1]["fp8_by_shard_dim"],
        "uneven_and_empty_rows": uneven_and_empty_rows() if "shapes" in options else None,
    }
)
dist.barrier()
exit_without_teardown(
    0
)  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown
