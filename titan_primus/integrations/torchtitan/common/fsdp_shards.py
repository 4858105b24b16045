"""Where TorchTitan's FSDP2 shards the weights of an FP8 layer, which decides whether their FP8
scales can travel with the shards (``Fp8AllGatherPlan.shard_refusal``)."""

from __future__ import annotations

__all__ = ["fsdp_shards"]


def fsdp_shards(
    shape: tuple[int, ...], *, experts: bool, fsdp: int, ep: int = 1, dim1_without_ep: bool
) -> tuple[tuple[int, ...], int, int]:
    """(the shape FSDP2 shards, the dim it shards, the FSDP degree) of a weight of ``shape``
    over ``fsdp`` ranks (dp_shard x cp; FP8 experts refuse tensor parallelism). A linear's: its
    rows. An expert weight [E, N, K] under expert parallelism: each rank's E / ep experts over
    the "efsdp" ranks (fsdp / ep), on dim 1 where fsdp > E (TorchTitan 0.2.2 and 0.3); without
    it, all experts over the fsdp ranks, on dim 1 where fsdp > E in TorchTitan 0.3
    (``dim1_without_ep``), always on dim 0 in 0.2.2 (torchtitan/distributed/fsdp.py,
    torchtitan/models/llama4/infra/parallelize.py)."""
    if not experts:
        return tuple(shape), 0, fsdp
    local = (shape[0] // ep, *shape[1:])  # EP deals out whole experts, evenly
    dim = 1 if (ep > 1 or dim1_without_ep) and fsdp > shape[0] else 0
    return local, dim, fsdp // ep
