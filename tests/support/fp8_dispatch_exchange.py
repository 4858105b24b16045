"""Run by test_token_dispatch.py under torchrun (2 ranks, gloo): TorchTitan 0.3's all-to-all
token dispatcher against its FP8 dispatch subclass, dispatch -> experts (an FP8 grouped GEMM
on the emulation) -> combine -> backward, eager, compiled (fullgraph) or under selective
activation checkpointing with TorchTitan's save set (``sac``):

- FP8 on the wire equals the same FP8 copy sent in bf16 (``dispatch_overrides.copy_in_bf16_config``), bitwise:
  the received rows, the output, every gradient;
- the bytes each all-to-all moves, counted at the collective (``_c10d_functional`` ops, eager
  and compiled: a compiled step's second call runs its graphs under the counting mode), and how
  many run per direction: the token counts, one packed dispatch, one bf16 combine forward; one
  bf16 all-to-all each for the gradients.

``routing``: ``random`` (top-2 of 8 experts, 4 per rank: no split is 0), ``uneven`` (rank 0
routes every token to its own experts, rank 1 three quarters of its tokens to rank 0's: rank 0
sends rank 1 nothing, and the splits differ), ``empty`` (every token of both ranks to rank 0's
experts: rank 1 receives no token, its grouped GEMMs get 0 rows, and in backward sends nothing).

Prints one ``RESULT {json}`` line on rank 0: a list of every rank's checks."""

import contextlib
import functools
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torchtitan.distributed.activation_checkpoint import _get_default_save_ops
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, TorchAOTokenDispatcher

from support.titan_helpers import print_every_rank  # also the CPU launcher's device patches
from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

import titan_primus as tp
from titan_primus.device import device_profile
from support.dispatch_overrides import copy_in_bf16_config
from titan_primus.recipes import with_fp8_dispatch
from titan_primus.integrations.torchtitan.v0_3.dispatch import fp8_dispatcher_config

_ALL_TO_ALL = {torch.ops._c10d_functional.all_to_all_single.default}


class CollectiveBytes(TorchDispatchMode):
    """Bytes each all-to-all sends from this rank, in call order."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ALL_TO_ALL:
            self.sent.append((str(args[0].dtype).removeprefix("torch."), args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


class CountingGraph(torch.fx.Interpreter):
    """A compiled (AOT forward or backward) graph run node by node, recording what each
    all-to-all node sends into ``sent`` at run time."""

    def __init__(self, gm, sent: list):
        super().__init__(gm)
        self.sent = sent

    def call_function(self, target, args, kwargs):
        if target in _ALL_TO_ALL:
            self.sent.append((str(args[0].dtype).removeprefix("torch."), args[0].numel() * args[0].element_size()))
        return super().call_function(target, args, kwargs)


def counting_backend(sent: list):
    """A torch.compile backend: AOT autograd's forward and backward graphs (those inductor would
    compile), each run through :class:`CountingGraph` (a dispatch mode cannot run under
    torch.compile: dynamo skips every frame while one is active)."""

    def compiler(gm, example_inputs):
        return make_boxed_func(lambda *args: CountingGraph(gm, sent).run(*args))

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def selective_ac(fn):
    """``fn`` under per-op selective activation checkpointing with TorchTitan's own save set
    (which saves every ``_c10d_functional.all_to_all_single``): backward runs the forward again,
    and must not run its all-to-alls again."""
    save = _get_default_save_ops()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    def checkpointed(*args):
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context)

    return checkpointed


def route(routing: str, rank: int, tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, top_k] expert ids: distinct per token, from the experts ``routing`` allows."""
    local = experts // 2

    def choose(candidates: torch.Tensor) -> torch.Tensor:
        return candidates[torch.randperm(len(candidates), generator=gen)[:top_k]]

    first, everyone = torch.arange(local), torch.arange(experts)
    if routing == "random":
        return torch.stack([choose(everyone) for _ in range(tokens)])
    if routing == "empty" or (routing == "uneven" and rank == 0):
        return torch.stack([choose(first) for _ in range(tokens)])
    # uneven, rank 1: three quarters of its tokens to rank 0's experts only, the rest anywhere
    return torch.stack([choose(first if t < 3 * tokens // 4 else everyone) for t in range(tokens)])


def main(recipe_name: str, definition: str, arch: str, padded: bool, mode: str, routing: str) -> None:
    compiled = mode == "compiled"
    dist.init_process_group("gloo")
    torch._dynamo.config.capture_scalar_outputs = True  # as TorchTitan's apply_compile sets it
    set_spmd_backend("full_dtensor")  # TorchTitan's functional-collective path (as under compile), no spmd_types mesh
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    recipe = with_fp8_dispatch(tp.make_recipe(recipe_name, definition, device_profile(arch)))
    experts, top_k, dim, hidden, tokens = 8, 2, 256, 128, 96
    base = (
        TorchAOTokenDispatcher.Config(num_experts=experts, top_k=top_k, pad_multiple=32)
        if padded
        else AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k)
    )
    dispatchers = {"bf16": base.build(), "fp8": fp8_dispatcher_config(base, recipe).build()}
    dispatchers["fp8 copy in bf16"] = copy_in_bf16_config(fp8_dispatcher_config(base, recipe)).build()
    for d in dispatchers.values():
        d.wire_meshes(ep_mesh=mesh)

    gen = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(tokens, dim, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen))).bfloat16()
    ids = route(routing, rank, tokens, experts, top_k, gen)
    scores = torch.rand(tokens, top_k, generator=gen)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    w = (torch.randn(experts // 2, hidden, dim, generator=torch.Generator().manual_seed(rank)) * 0.05).bfloat16()
    grad_out = torch.randn(tokens, dim, generator=gen).bfloat16()
    backend = tp.registry.get_backend("emulated")

    def step(dispatcher, x, w):
        routed, local_counts, meta = dispatcher.dispatch(x, scores, ids, counts)
        offs = torch.cumsum(local_counts, 0, dtype=torch.int32)
        h = tp.ops.run_grouped_mm(backend, routed, w.transpose(-2, -1), offs, recipe)  # [R, hidden]
        out = torch.nn.functional.pad(h, (0, dim - hidden)).to(x.dtype)
        return routed, dispatcher.combine(out, meta, x)

    results = {}
    for name, dispatcher in dispatchers.items():
        forward_bytes, backward_bytes = CollectiveBytes(), CollectiveBytes()
        if compiled:  # counted in the compiled graphs: the forward graph runs first, then the backward
            sent: list = []
            fn = torch.compile(step, fullgraph=True, dynamic=True, backend=counting_backend(sent))
        else:
            fn = selective_ac(step) if mode == "sac" else step
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        with contextlib.nullcontext() if compiled else forward_bytes:
            routed, out = fn(dispatcher, x_, w_)
        if compiled:
            forward_bytes.sent, sent[:] = list(sent), []
        with contextlib.nullcontext() if compiled else backward_bytes:
            out.backward(grad_out)
        if compiled:
            backward_bytes.sent = list(sent)
        results[name] = (routed.detach(), out.detach(), x_.grad, w_.grad, forward_bytes.sent, backward_bytes.sent)

    fp8, copy, bf16 = results["fp8"], results["fp8 copy in bf16"], results["bf16"]
    bitwise = all(torch.equal(a, b) for a, b in zip(fp8[:4], copy[:4]))
    differs_from_bf16 = not torch.equal(fp8[0], bf16[0])
    weight_grads = fp8[3], bf16[3]
    summary = {
        "received_rows": fp8[0].shape[0],
        "recipe": recipe.describe(),
        "padded": padded,
        "mode": mode,
        "bitwise_fp8_vs_copy_in_bf16": bitwise,
        "received_rows_differ_from_bf16_dispatch": differs_from_bf16,
        # The GEMM re-quantizes the received copy to the same values: forward and grad_input as
        # with bf16 dispatch; the weight gradient casts the copy (equal where the recipe's
        # backward already did, else FP8-subnormal elements apart).
        "output_and_grad_input_equal_to_bf16_dispatch": torch.equal(fp8[1], bf16[1]) and torch.equal(fp8[2], bf16[2]),
        "grad_weight_elements_differing_from_bf16_dispatch": (weight_grads[0] != weight_grads[1]).sum().item(),
        "finite": all(torch.isfinite(t).all().item() for t in fp8[:4]),
        # Where no token reached this rank's experts, their weight gradient is exactly zero.
        "grad_weight_zero": bool((fp8[3] == 0).all()),
        "forward_all_to_all": {k: v[4] for k, v in results.items()},
        "backward_all_to_all": {k: v[5] for k, v in results.items()},
    }
    print_every_rank(summary)
    dist.barrier()
    exit_without_teardown(
        0
    )  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown


if __name__ == "__main__":
    recipe_name, definition, arch, padded, mode, routing = sys.argv[1:7]
    main(recipe_name, definition, arch, padded == "padded", mode, routing)
