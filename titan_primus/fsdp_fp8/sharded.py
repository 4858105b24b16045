"""The sharded side: the parameter FSDP2 holds, its all-gather hooks, and the registry of
tensorwise weights whose stale amaxes one all-reduce refreshes."""

from __future__ import annotations

import functools
import gc
import logging
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from .plan import Fp8AllGatherPlan, quantize_weight

logger = logging.getLogger("titan_primus")

__all__ = ["Fp8AllGatherWeight"]


_PRESERVED = {
    # FSDP2 builds the padded local shard from the parameter with these (and to_empty uses
    # empty_like): they must keep the subclass so the shard still has the all-gather hooks.
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class Fp8AllGatherWeight(torch.Tensor):
    """A sharded FP8 layer's weight whose FSDP2 all-gather carries FP8 payload and scales.

    Wraps the plain high-precision tensor ``_tensor``; every op runs on that tensor (results are
    plain tensors except the views and copies FSDP2 makes of the parameter), so optimizers,
    initialisation and checkpoint loading see an ordinary tensor. ``_amax`` is the whole
    weight's amax (tensorwise plans). Any in-place change (optimizer step, checkpoint load,
    init) makes it stale: one made through this tensor clears it, one made directly to
    ``_tensor`` moves its version counter away from ``_amax_version``. A copy that keeps the
    values (FSDP2's ``.to(device)`` of an offloaded shard before each all-gather) keeps a fresh
    amax, and where to reduce amaxes (``_group``, ``_reduce_device``).
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, plan: Fp8AllGatherPlan):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.shape,
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, plan: Fp8AllGatherPlan):
        self._tensor, self._plan = tensor, plan
        self._amax: torch.Tensor | None = None
        self._amax_version = -1
        self._group = None
        self._reduce_device: torch.device | None = None
        """Where the group reduces: the device FSDP2 all-gathers on (a CPU-offloaded shard
        lives on the CPU)."""

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._tensor!r}, {self._plan.granularity})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        plans = set()
        source = args[0] if args else None
        # A mutation (optimizer step, state-dict load, init) makes a precomputed amax stale.
        # (It reaches the inner tensor below autograd, where its version counter does not move.)
        mutation = func._schema.is_mutable

        def unwrap(t):
            plans.add(t._plan)
            if mutation:
                t._amax = None
            return t._tensor

        args, kwargs = tree_map_only(Fp8AllGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        (plan,) = plans
        out = tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t, plan), out)
        if func is torch.ops.aten._to_copy.default and isinstance(source, Fp8AllGatherWeight):
            out._keep_amax_of(source)
        return out

    def _keep_amax_of(self, source: "Fp8AllGatherWeight") -> None:
        """A copy of ``source`` (another device, same dtype: the same values) keeps its fresh amax.
        FSDP2 makes one of a CPU-offloaded shard before every all-gather; without it each
        all-gather would find the amax stale and reduce it again, one weight at a time."""
        if self.dtype != source.dtype:
            return
        self._group, self._reduce_device = source._group, source._reduce_device
        if source.amax_is_fresh():
            self._set_amax(source._amax)

    def amax_is_fresh(self) -> bool:
        return self._amax is not None and self._amax_version == self._tensor._version

    def _set_amax(self, amax: torch.Tensor) -> None:
        self._amax, self._amax_version = amax, self._tensor._version

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        plan = self._plan
        world = mesh.size()
        param_dtype = mp_policy.param_dtype or self._tensor.dtype
        shard_dim = next((d for d, (a, b) in enumerate(zip(self.shape, outer_size)) if a != b), 0)
        padded_rows = -(-outer_size[0] // world) if shard_dim == 0 else self.shape[0]  # FSDP2 pads dim 0 only
        high_precision = _why_high_precision(plan, outer_size, shard_dim, world) or _shared_with(module)
        if high_precision:
            _warn_high_precision(tuple(outer_size), high_precision)
            return (_pad_rows(self._tensor.to(param_dtype), padded_rows),), (_HIGH_PRECISION, tuple(outer_size), None)
        _announce()  # once: the log shows the FP8 all-gather ran
        # Quantized from the values the GEMM would receive: FSDP2 casts to param_dtype, the layer
        # may cast again (expert weights to bf16); rounding is monotone, so the amax follows.
        dtypes = (param_dtype, plan.quantize_dtype or param_dtype)
        shard = self._tensor.to(dtypes[0]).to(dtypes[1])
        amax = None
        if plan.granularity == "tensorwise":
            self._group, self._reduce_device = mesh.get_group(), self._tensor.device
            if not self.amax_is_fresh():  # first step, or weights changed since the precompute
                _all_reduce_amaxes(_stale_tensorwise_weights(self), self._group, self._reduce_device)
            amax = self._amax.to(dtypes[0]).to(dtypes[1])
        data, scale = quantize_weight(shard, plan, amax)
        data = _pad_rows(data, padded_rows)  # uneven sharding: zero rows, cut off after the gather
        metadata = (scale if plan.granularity == "tensorwise" else None, tuple(outer_size), dtypes[1])
        return ((data,) if plan.granularity == "tensorwise" else (data, scale)), metadata

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        first, outer_size, source_dtype = metadata
        high_precision = first is _HIGH_PRECISION
        tensorwise_scale = None if high_precision else first
        # FSDP2 hands each output back as [world * dim-0 rows of a shard, ...]; the memory is the
        # padded weight in order (dim-0 shards stacked; other shards concatenated back by FSDP2).
        data = all_gather_outputs[0].view(-1, *outer_size[1:])[: outer_size[0]]
        if out is not None:  # the unsharded parameter exists; its payload was gathered in place
            if tensorwise_scale is not None:
                (out._local_tensor if isinstance(out, DTensor) else out)._scale = tensorwise_scale
            return
        if high_precision:
            return data, tuple(all_gather_outputs)
        scale = (
            tensorwise_scale
            if tensorwise_scale is not None
            else all_gather_outputs[1].view(-1, *outer_size[1:-1], 1)[: outer_size[0]]
        )
        # The gathered weight views the first rows; FSDP2 frees and reallocates the whole
        # all-gather outputs between uses.
        gathered = self._plan.backend.gathered_weight(data, scale, param_dtype, self._plan.recipe, source_dtype)
        return gathered, tuple(all_gather_outputs)


_HIGH_PRECISION = "high precision"
"""All-gather metadata of a weight gathered in param_dtype after all."""


def _why_high_precision(plan: Fp8AllGatherPlan, outer_size, shard_dim: int, world: int) -> str | None:
    """Why FSDP2 cannot gather this weight's FP8 payload and scales exactly, if it cannot: it
    wants every all-gather input padded like the weight's shard, which a column of per-row
    scales is not, and for shards on dims other than 0 it re-views each input as the shard."""
    if plan.granularity != "rowwise" or world == 1:
        return None
    if shard_dim != 0:
        return (
            f"FSDP2 shards it on dim {shard_dim} (TorchTitan does for expert weights when the FSDP "
            f"degree exceeds the number of experts), where it cannot gather per-row scales"
        )
    if outer_size[0] % world:
        return f"its {outer_size[0]} rows do not divide by the FSDP degree ({world}), so the per-row scales cannot be padded"
    return None


def _shared_with(module) -> str | None:
    """Why the weight FSDP2 gathers for ``module`` must stay in high precision because
    ``module`` is not an FP8 GEMM, or None. FSDP2 names the first module holding a parameter; a
    weight tied to a module that reads its values (an embedding) lists that one first in every
    model that builds the embedding before the output projection."""
    if module is None or getattr(module, "fp8_backend", None) is not None:
        return None
    return (
        f"it is shared with a {type(module).__name__}, which is not an FP8 GEMM and reads its values "
        f"(tied weights): it keeps its high-precision all-gather"
    )


@functools.cache
def _warn_high_precision(shape: tuple, why: str) -> None:
    logger.warning("titan-primus: an FP8 layer's weight of shape %s is all-gathered in high precision: %s", shape, why)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (FSDP2's padded shard size on dim 0)."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


_TENSORWISE: list[tuple[weakref.ref, str]] = []
"""(module, parameter name) of every weight given a tensorwise FP8 all-gather, in the order
:func:`enable_fp8_all_gather` saw them: the same order on every rank."""


def _group_name(group) -> str:
    return group.group_name


def _stale_tensorwise_weights(first: Fp8AllGatherWeight) -> list[Fp8AllGatherWeight]:
    """``first`` and every other tensorwise FP8 weight FSDP2 holds sharded over ``first``'s group
    whose amax is stale, in registration order: one all-reduce then serves them all, where one
    per weight would run inside each pre-all-gather hook. Every rank of the group builds the
    same list (the same modules, sharded the same way, with the same amaxes stale); models no
    longer referenced are collected first, which garbage collection would otherwise do at
    different moments on different ranks."""
    gc.collect()
    weights, group = [first], _group_name(first._group)
    for module_ref, name in _TENSORWISE:
        module = module_ref()
        param = module._parameters.get(name) if module is not None else None
        if not isinstance(param, DTensor):  # not sharded by FSDP2 (yet), or unsharded right now
            continue
        weight = param._local_tensor
        if (
            weight is first
            or not isinstance(weight, Fp8AllGatherWeight)
            or weight._plan.granularity != "tensorwise"
            or weight.amax_is_fresh()
        ):
            continue
        shard_dims = [d for d, p in enumerate(param.placements) if p.is_shard()]
        if len(shard_dims) != 1 or _group_name(param.device_mesh.get_group(shard_dims[0])) != group:
            continue
        weight._group, weight._reduce_device = first._group, first._reduce_device
        weights.append(weight)
    return weights


def _all_reduce_amaxes(weights: list[Fp8AllGatherWeight], group, device: torch.device) -> None:
    """Whole-weight amaxes of ``weights`` (shards across ``group``): one all-reduce for all, on
    ``device`` (each shard's amax is taken where the shard lives: a CPU-offloaded one on the CPU)."""
    # A rank's shard can be empty (more ranks than rows); 0 is neutral for the max.
    local = torch.stack(
        [
            (
                w._tensor.detach().abs().amax().to(torch.float32)
                if w._tensor.numel()
                else w._tensor.new_zeros((), dtype=torch.float32)
            ).to(device)
            for w in weights
        ]
    )
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    for weight, amax in zip(weights, local.unbind()):
        weight._set_amax(amax)


@functools.cache
def _announce() -> None:
    logger.info("titan-primus: FSDP2 all-gathers FP8 weights as FP8 payload + scales")
