"""Run by test_token_dispatch.py under torchrun (2 ranks, gloo): TorchTitan 0.2.2's ExpertParallel
against titan-primus's Fp8ExpertParallel on one Fp8GroupedExperts block (emulated FP8 grouped
GEMMs), dispatch -> experts -> combine -> backward, for each token-group alignment given:

- FP8 on the wire equals TorchTitan's bf16 all-to-all of the same FP8 copy (``fp8_copy`` applied
  before ExpertParallel), bitwise: the output, the input's and the weights' gradients;
- what each all-to-all sends from this rank (dtype, shape; forward and backward);
- experts with FP8 dispatch that TorchTitan's own ExpertParallel parallelised refuse to run;
- experts without FP8 dispatch under Fp8ExpertParallel (which the converter installs for the
  whole process) run exactly as under ExpertParallel: the same results and all-to-alls.

Arguments: cases ``recipe,device profile,token-group alignment``. Prints one ``RESULT {json}``
line per case on rank 0: a list of every rank's checks."""

import json
import sys

import titan_primus.integrations.torchtitan.v0_2.launch  # noqa: F401  (before torchtitan: the CPU device, the CPU permute indices)
import torch
import torch.distributed as dist
import torchtitan.models.moe.utils as moe_utils
from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe.moe import GroupedExperts

from titan_primus.device import device_profile
from titan_primus.recipes import with_fp8_dispatch
from titan_primus.routing import select_backend
from titan_primus.token_dispatch import fp8_copy, fp8_dispatch_cast
from titan_primus.torchtitan02 import Fp8GroupedExperts
from titan_primus.integrations.torchtitan.v0_2.dispatch import Fp8ExpertParallel

_ALL_TO_ALL = {
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
}


class Sent(TorchDispatchMode):
    """(dtype, shape) of what each all-to-all sends from this rank, in call order."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ALL_TO_ALL:
            self.sent.append((str(args[0].dtype).removeprefix("torch."), list(args[0].shape)))
        return func(*args, **(kwargs or {}))


def main(cases: list[tuple[str, str, int]]) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    for recipe_name, arch, alignment in cases:
        run_case(mesh, recipe_name, arch, alignment)
    dist.barrier()
    exit_without_teardown(
        0
    )  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown


def run_case(mesh, recipe_name: str, arch: str, alignment: int) -> None:
    rank = dist.get_rank()
    experts, dim, hidden, tokens = 8, 256, 128, 96
    decision = select_backend("grouped_mm", recipe_name, device_profile(arch), "emulated")
    recipe = with_fp8_dispatch(decision.recipe)
    cast = fp8_dispatch_cast(recipe)

    shapes = {"w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
    # The same global experts on both ranks; EP keeps each rank's half.
    weights = {
        name: torch.randn(experts, *shape, generator=torch.Generator().manual_seed(i)).bfloat16() * 0.05
        for i, (name, shape) in enumerate(shapes.items())
    }

    def block(block_recipe, style):
        with torch.device("meta"):
            experts_ = GroupedExperts(dim, hidden, experts, use_grouped_mm=True)
        module = Fp8GroupedExperts.from_experts(experts_, decision, None, recipe=block_recipe)
        module.to_empty(device="cpu")
        with torch.no_grad():
            for name, w in weights.items():
                getattr(module, name).copy_(w)
        return parallelize_module(module, mesh, style)

    gen = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(tokens, dim, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen))).bfloat16()
    # Rows grouped by expert, as TorchTitan's reorderer hands them to the experts: the counts.
    counts = torch.bincount(torch.randint(0, experts, (tokens,), generator=gen), minlength=experts)
    grad_out = torch.randn(tokens, dim, generator=gen).bfloat16()

    saved_alignment, moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M, alignment
    runs = {
        "fp8": (block(recipe, Fp8ExpertParallel()), lambda t: t),
        "fp8 copy in bf16": (block(decision.recipe, ExpertParallel()), lambda t: fp8_copy(t, cast)),
        "bf16": (block(decision.recipe, ExpertParallel()), lambda t: t),
        "bf16 under Fp8ExpertParallel": (block(decision.recipe, Fp8ExpertParallel()), lambda t: t),
    }
    results = {}
    for name, (module, before) in runs.items():
        x_ = x.clone().requires_grad_()
        forward, backward = Sent(), Sent()
        with forward:
            out = module(before(x_), counts)
        with backward:
            out.backward(grad_out)
        grads = [p.grad.to_local() for p in (module.w1, module.w2, module.w3)]
        results[name] = (out.detach(), x_.grad, *grads), forward.sent, backward.sent
    try:
        block(recipe, ExpertParallel())(x, counts)
        unmarked_refused = False
    except RuntimeError as e:
        unmarked_refused = "not titan-primus's Fp8ExpertParallel" in str(e)
    moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = saved_alignment
    fp8, copy_, bf16 = (results[k][0] for k in ("fp8", "fp8 copy in bf16", "bf16"))
    bf16_under_fp8_style = results["bf16 under Fp8ExpertParallel"]
    summary = {
        "recipe": recipe.describe(),
        "alignment": alignment,
        "bitwise_fp8_vs_copy_in_bf16": all(torch.equal(a, b) for a, b in zip(fp8, copy_)),
        "output_equal_to_bf16": torch.equal(fp8[0], bf16[0]),
        "grad_input_equal_to_bf16": torch.equal(fp8[1], bf16[1]),
        "grad_weight_elements_differing_from_bf16": sum((a != b).sum().item() for a, b in zip(fp8[2:], bf16[2:])),
        "finite": all(torch.isfinite(t).all().item() for t in fp8),
        "unmarked_module_refused": unmarked_refused,
        "bf16_under_fp8_expert_parallel_is_expert_parallel": all(
            torch.equal(a, b) for a, b in zip(bf16_under_fp8_style[0], bf16)
        )
        and bf16_under_fp8_style[1:] == results["bf16"][1:],
        "forward_sent": {k: v[1] for k, v in results.items()},
        "backward_sent": {k: v[2] for k, v in results.items()},
    }
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, {"rank": rank, **summary})
    if rank == 0:
        print("RESULT " + json.dumps(every_rank), flush=True)


if __name__ == "__main__":
    main([(recipe, arch, int(alignment)) for recipe, arch, alignment in (case.split(",") for case in sys.argv[1:])])
