"""Run by test_fsdp_fp8_all_gather.py under torchrun (gloo, any world size): the FP8 all-gather
matrix on single FP8 layers of TorchTitan 0.3's deepseek_v3 debug model, converted on the
emulated backend. Recipes: tensorwise (TorchAO's and Primus-Turbo's definitions), rowwise
(Primus-Turbo's), blockwise (both). Layers: a linear [N, 256] with N a multiple of the world size,
N not one, and N below it (empty shards); expert weights sharded by expert with E a multiple of
the world size, not one, and below it; expert weights sharded on dim 1 (N); at even world sizes
from 4, expert weights under expert parallelism as TorchTitan shards them (EP 2: each rank's
experts a DTensor on the "ep" mesh, FSDP2 over the world / 2 "efsdp" ranks: each rank's experts a
multiple of those ranks, not one, and one expert sharded on dim 1). Parameters in bf16 and
in fp32 (FSDP2's param_dtype bf16). Each case runs twice from the same weights, its weights
all-gathered in bf16 and then in FP8 where the plan allows, for two AdamW steps. Checked on every
rank, per case: the gathered FP8 payload bytes and scales equal the forward cast of the gathered
bf16 weight (gather-then-quantize) at every gather; outputs, input and weight gradients, and the
updated weights equal the bf16 gather's bit for bit; and how the weights went (``fp8`` or ``high
precision``). Prints one ``RESULT`` line.

Usage: fsdp_fp8_matrix.py (no arguments; the world size is torchrun's)."""

import copy
import logging
import sys

import torch
import torch.distributed as dist
from support.titan_helpers import build, model_config, print_every_rank
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_primus.fsdp_fp8 import Fp8GatheredWeight, fp8_all_gather_plan, quantize_weight
from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown
from titan_primus.torchtitan import Float8Converter

logging.basicConfig(stream=sys.stderr, level=logging.ERROR)
dist.init_process_group("gloo")
world = dist.get_world_size()
RECIPES = [
    ("tensorwise", "cpu"),
    ("tensorwise", "gfx942"),
    ("rowwise", "gfx942"),
    ("blockwise", "cpu"),
    ("blockwise", "gfx942"),
]
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
EP = 2
# TorchTitan's sparse mesh (torchtitan/distributed/parallel_dims.py): "efsdp" outer, "ep" inner.
EP_MESH = (
    init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("efsdp", "ep"))
    if world >= 4 and world % EP == 0
    else None
)


def templates(recipe: str, device: str):
    """(an Fp8Linear, an Fp8GroupedExperts) of the converted debug model, FP8 all-gather off."""
    config = Float8Converter.Config(
        device=device, recipe=recipe, backend="emulated", enable_fsdp_float8_all_gather=True
    )
    model = build(config.build().convert(model_config("deepseek_v3")), seed=0)
    linear = model.layers["0"].feed_forward.w1
    experts = model.layers["1"].moe.routed_experts.inner_experts
    for module in (linear, experts):
        module.use_fp8_all_gather(False)
    return linear, experts


def cases():
    """(name, kind, shapes of the weights, shard dim, expert parallel degree)."""
    block = 128  # whole 128-row blocks per rank where a case means them
    for name, rows in (("divisible", world * block), ("uneven", world * block - 1), ("fewer_than_ranks", world - 1)):
        yield f"linear_{name}", "linear", {"weight": (rows, 256)}, 0, 1
    for name, count in (("divisible", world), ("uneven", world + 1), ("fewer_than_ranks", world - 1)):
        yield f"experts_{name}", "experts", _expert_shapes(count, 128, 128), 0, 1
    yield "experts_dim1", "experts", _expert_shapes(2, world * block, world * block), 1, 1
    if EP_MESH is not None:
        efsdp = world // EP
        for name, per_rank in (("divisible", efsdp), ("uneven", efsdp + 1)):
            yield f"experts_ep_{name}", "experts", _expert_shapes(EP * per_rank, 128, 128), 0, EP
        yield "experts_ep_dim1", "experts", _expert_shapes(EP, efsdp * block, efsdp * block), 1, EP


def _expert_shapes(experts: int, hidden: int, dim: int) -> dict:
    return {"w1_EFD": (experts, hidden, dim), "w2_EDF": (experts, dim, hidden), "w3_EFD": (experts, hidden, dim)}


def layer(template, shapes: dict, dtype: torch.dtype, fp8: bool):
    module = copy.deepcopy(template)
    generator = torch.Generator().manual_seed(sum(sum(s) for s in shapes.values()))
    for name, shape in shapes.items():
        setattr(module, name, torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.05).to(dtype)))
    if isinstance(getattr(module, "num_experts", None), int):
        module.num_experts = shapes["w1_EFD"][0]
    if fp8:
        module.use_fp8_all_gather()
    return module


def run(template, kind, shapes, shard_dim, ep, dtype, fp8):
    module = layer(template, shapes, dtype, fp8)
    placement = (lambda p: Shard(shard_dim)) if shard_dim else None
    if ep > 1:  # as TorchTitan's expert parallelism: whole experts dealt out, then FSDP2 within
        for name in shapes:
            weight = distribute_tensor(getattr(module, name), EP_MESH["ep"], [Shard(0)])
            setattr(module, name, torch.nn.Parameter(weight))
        fully_shard(module, mesh=EP_MESH["efsdp"], mp_policy=MP, shard_placement_fn=placement)
    else:
        fully_shard(module, mp_policy=MP, shard_placement_fn=placement)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    gathered = []  # per forward: each FP8 weight's (name, payload, scale) or bf16 weight, this rank's experts

    def capture(mod, args):
        for name in shapes:
            w = getattr(mod, name)
            w = w.to_local() if isinstance(w, DTensor) else w
            gathered.append(
                (
                    name,
                    (w.fp8_data().clone(), w.scale().clone())
                    if isinstance(w, Fp8GatheredWeight)
                    else w.detach().clone(),
                )
            )

    module.register_forward_pre_hook(capture)
    # Under EP each rank routes its own tokens to its own experts.
    generator = torch.Generator().manual_seed(3 + (EP_MESH["ep"].get_local_rank() if ep > 1 else 0))
    results = []
    for _ in range(2):
        if kind == "linear":
            x = torch.randn(16, shapes["weight"][1], generator=generator).bfloat16().requires_grad_()
            out = module(x)
        else:
            experts, _, dim = shapes["w1_EFD"]
            experts //= ep
            x = torch.randn(16 * experts, dim, generator=generator).bfloat16().requires_grad_()
            out = module(x, torch.full((experts,), 16, dtype=torch.int64))
        out.float().square().mean().backward()
        results += [out.detach(), x.grad, *(getattr(module, n).grad.full_tensor() for n in shapes)]
        optimizer.step()
        optimizer.zero_grad()
    results += [getattr(module, n).full_tensor() for n in shapes]
    return results, gathered


def check(template, kind, shapes, shard_dim, ep, dtype) -> str:
    plan, _ = fp8_all_gather_plan(
        template.fp8_backend, template.fp8_recipe, "linear" if kind == "linear" else "grouped_mm"
    )
    plain, plain_gathered = run(template, kind, shapes, shard_dim, ep, dtype, fp8=False)
    fp8, fp8_gathered = run(template, kind, shapes, shard_dim, ep, dtype, fp8=True)

    if not all(torch.equal(a, b) for a, b in zip(plain, fp8)):
        return "different"
    went_fp8 = [isinstance(g, tuple) for _, g in fp8_gathered]
    if not any(went_fp8):
        return "equal, high precision"
    if not all(went_fp8):
        return "mixed"
    for (name, (data, scale)), (_, weight) in zip(fp8_gathered, plain_gathered):
        # gather-then-quantize: the forward cast of the gathered bf16 weight (experts: TorchTitan's bf16 copy)
        source = weight.to(plan.quantize_dtype or weight.dtype)
        expected = quantize_weight(source, plan, source.abs().amax().float())
        if not (torch.equal(data.view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(scale, expected[1])):
            return f"equal outputs, but {name}'s gathered FP8 differs from gather-then-quantize"
    return "equal, fp8"


found = {}
for recipe, device in RECIPES:
    linear, experts = templates(recipe, device)
    for name, kind, shapes, shard_dim, ep in cases():
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{recipe}/{device}/{name}/{str(dtype).removeprefix('torch.')}"
            found[key] = check(linear if kind == "linear" else experts, kind, shapes, shard_dim, ep, dtype)
print_every_rank({"cases": found})
dist.barrier()
exit_without_teardown(0)
