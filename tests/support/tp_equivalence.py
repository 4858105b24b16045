"""Run by test_distributed.py under torchrun (2 ranks, gloo): the emulated FP8 linear on
tensor-parallel shards, told what is sharded, computes exactly the single-device result: every
amax over a split dimension is reduced across the group. Without that (shards=None) tensorwise
and some rowwise scales would come from one shard and the results would differ. Prints one
``RESULT`` line: each rank's smallest SQNR against one device, with shards and without."""

import sys

import torch
import torch.distributed as dist

import titan_primus as tp
from titan_primus.backends.base import TensorParallelShards
from titan_primus.metrics import sqnr
from support.titan_helpers import print_every_rank

from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD
recipe_name, device = sys.argv[1], sys.argv[2]
decision = tp.select_backend("linear", recipe_name, device, "emulated")
backend, recipe = decision.backend, decision.recipe

gen = torch.Generator().manual_seed(3)
M, K, N = 48, 64, 32
x = torch.randn(M, K, generator=gen).bfloat16()
w = torch.randn(N, K, generator=gen) * 0.1
w[0, 0] = 5.0  # an outlier in rank 0's shard: a per-shard amax would differ on rank 1
g = torch.randn(M, N, generator=gen)


def run(x, w, g, shards):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = backend.linear(x, w, None, recipe, shards)
    out.backward(g.to(out.dtype))
    return out.float(), x.grad.float(), w.grad.float()


full_out, full_gx, full_gw = run(x, w, g, None)
n, k = slice(rank * N // world, (rank + 1) * N // world), slice(rank * K // world, (rank + 1) * K // world)


def summed(t):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def layouts(shards_col, shards_row):
    # column-parallel: weight rows (N) split, x whole, grad_output split on N, grad_x partial
    out, gx, gw = run(x, w[n], g[:, n], shards_col)
    col = [(full_out[:, n], out), (full_gx, summed(gx)), (full_gw[n], gw)]
    # row-parallel: weight columns (K) and x split on K, output partial, grad_output whole
    out, gx, gw = run(x[:, k], w[:, k], g, shards_row)
    row = [(full_out, summed(out)), (full_gx[:, k], gx), (full_gw[:, k], gw)]
    return min(sqnr(a, b) for a, b in col + row)


aware = layouts(TensorParallelShards(group, None, 0, 1), TensorParallelShards(group, 1, 1, None))
unaware = layouts(None, None)
print_every_rank({"recipe": recipe_name, "device": device, "with_shards_db": aware, "without_db": unaware})
dist.barrier()
exit_without_teardown(
    0
)  # see titan_primus/integrations/torchtitan/common/cpu_world.py: gloo processes can abort in interpreter teardown
