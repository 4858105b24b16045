"""The sharded side: the parameter FSDP2 holds, its all-gather hooks, and the one all-reduce
per FSDP2 parameter group and all-gather that gives tensorwise weights their amaxes."""

from __future__ import annotations

import functools
import logging
import os
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
    initialisation and checkpoint loading see an ordinary tensor. Nothing derived from the values
    is kept between all-gathers: a tensorwise weight's whole-weight amax is reduced anew at each
    all-gather (:class:`_AmaxRound`), so no write, through whatever alias (the tensors of
    ``model.state_dict()``, ``param.data``, the local shard), can leave a stale scale.
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
        self._origin: Fp8AllGatherWeight | None = None
        """For the device copy FSDP2 makes of a CPU-offloaded shard before each all-gather: the
        shard it copies (FSDP2's own parameter, which its all-gather round knows)."""
        self._pending: tuple[_AmaxRound, torch.Tensor] | None = None
        """This weight's amax, reduced by the first weight of its all-gather round."""
        self._round_led: _AmaxRound | None = None
        self._fsdp_group: list[weakref.ref] | None = None
        self._check_every = 0
        """``TITAN_PRIMUS_CHECK_FP8_SCALES`` when FP8 all-gather was enabled: every this many
        all-gathers the amax is checked against the gathered values (0: never)."""
        self._all_gathers = 0

    def sharded(self) -> "Fp8AllGatherWeight":
        """The shard FSDP2 holds: this weight, or the one this device copy was made of."""
        return self if self._origin is None else self._origin

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._tensor!r}, {self._plan.granularity})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        plans, check_every = set(), set()
        source = args[0] if args else None

        def unwrap(t):
            plans.add(t._plan)
            check_every.add(t._check_every)
            return t._tensor

        args, kwargs = tree_map_only(Fp8AllGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        (plan,) = plans
        out = tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t, plan), out)
        for weight in out if isinstance(out, (list, tuple)) else (out,):
            weight._check_every = max(check_every)
        if func is torch.ops.aten._to_copy.default and isinstance(source, Fp8AllGatherWeight):
            out._origin = source.sharded()
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        plan = self._plan
        world = mesh.size()
        param_dtype = mp_policy.param_dtype or self._tensor.dtype
        shard_dim = next((d for d, (a, b) in enumerate(zip(self.shape, outer_size)) if a != b), 0)
        padded_rows = -(-outer_size[0] // world) if shard_dim == 0 else self.shape[0]  # FSDP2 pads dim 0 only
        high_precision = plan.shard_refusal(tuple(outer_size), shard_dim, world) or _shared_with(module)
        if high_precision:
            _warn_high_precision(tuple(outer_size), high_precision)
            shard = _pad_rows(self._tensor.to(param_dtype), padded_rows)
            return (shard,), (_HIGH_PRECISION, tuple(outer_size), None, None, shard.dtype)
        _announce()  # once: the log shows the FP8 all-gather ran
        # Quantized from the values the GEMM would receive: FSDP2 casts to param_dtype, the layer
        # may cast again (expert weights to bf16); rounding is monotone, so the amax follows.
        dtypes = (param_dtype, plan.quantize_dtype or param_dtype)
        shard = self._tensor.to(dtypes[0]).to(dtypes[1])
        amax = None
        if plan.granularity == "tensorwise":
            amax = _whole_weight_amax(self, mesh.get_group(), self._tensor.device)
            if _checked_now(self.sharded()):
                _check_amax(self, amax, mesh.get_group(), padded_rows, module, tuple(outer_size))
            amax = amax.to(dtypes[0]).to(dtypes[1])
        data, scale = quantize_weight(shard, plan, amax)
        # Uneven sharding: zero rows, cut off after the gather. FSDP2 chunks dim 0 with the padding
        # at the end, so the first rows gathered are the weight's.
        data = _pad_rows(data, padded_rows)
        # Gathered as bytes: FSDP2 gives a group whose inputs are all FP8 (a weight alone in its
        # group) a float8 buffer, which gloo cannot all-gather ("Invalid scalar type").
        payload = data.view(torch.uint8)
        shape = tuple(outer_size)
        scale_shape = plan.scale_shape(shape)
        metadata = (shape, scale_shape, dtypes[1], data.dtype)
        if plan.granularity == "tensorwise":
            return (payload,), (scale, *metadata)
        if shard_dim == 0 and outer_size[0] % world == 0:
            return (payload, scale), (None, *metadata)  # the scales ride along
        # FSDP2 takes from an unevenly sharded weight only inputs of its padded shard's size, and
        # re-views every input of a weight sharded on another dim as that shard: per-row or block
        # scales are neither, so they travel in an all-gather of their own, on every rank alike
        # (one small collective per gather of such a weight). A shard's scale rows are padded as
        # its rows are (whole blocks: see Fp8AllGatherPlan.shard_refusal); FSDP2 shards other dims evenly.
        if shard_dim == 0:
            scale = _pad_rows(scale, plan.scale_rows(padded_rows, len(shape)))
        scales = _all_gathered_along(scale, shard_dim, mesh.get_group()).narrow(shard_dim, 0, scale_shape[shard_dim])
        return (payload,), (scales.contiguous(), *metadata)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        first, outer_size, scale_shape, source_dtype, payload_dtype = metadata
        if self._round_led is not None:  # this weight's all-gather round is over
            self._round_led.open = False
        high_precision = first is _HIGH_PRECISION
        # The scale, where it travelled in the metadata: tensorwise, or gathered on its own.
        known_scale = None if high_precision else first
        # FSDP2 hands each output back as [world * dim-0 rows of a shard, ...]; the memory is the
        # padded weight in order (dim-0 shards stacked; other shards concatenated back by FSDP2).
        data = all_gather_outputs[0].view(payload_dtype).view(-1, *outer_size[1:])[: outer_size[0]]
        if out is not None:  # the unsharded parameter exists; its payload was gathered in place
            if known_scale is not None:
                (out._local_tensor if isinstance(out, DTensor) else out)._scale = known_scale
            return
        if high_precision:
            return data, tuple(all_gather_outputs)
        scale = (
            known_scale
            if known_scale is not None
            else all_gather_outputs[1].view(-1, *scale_shape[1:])[: scale_shape[0]]
        )
        # The gathered weight views the first rows; FSDP2 frees and reallocates the whole
        # all-gather outputs between uses.
        gathered = self._plan.backend.gathered_weight(data, scale, param_dtype, self._plan.recipe, source_dtype)
        return gathered, tuple(all_gather_outputs)


_HIGH_PRECISION = "high precision"
"""All-gather metadata of a weight gathered in param_dtype after all."""


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


def _all_gathered_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on each), stacked on dim 0 in rank order."""
    whole = t.new_empty((t.shape[0] * dist.get_world_size(group), *t.shape[1:]))
    # torch 2.14 names it all_gather_single (all_gather_into_tensor, deprecated there, calls it).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(whole, t.contiguous(), group=group)
    return whole


def _all_gathered_along(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on each), concatenated along ``dim`` in rank order."""
    return _all_gathered_rows(t.movedim(dim, 0), group).movedim(0, dim)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (FSDP2's padded shard size on dim 0)."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


class _AmaxRound:
    """One all-gather round of an FSDP2 parameter group: FSDP2 calls the pre-all-gather hooks
    of all the group's weights, in order, before it gathers them and calls any post-all-gather
    hook. The first tensorwise weight of the round reduces the amaxes of all of them in one
    all-reduce; the others take theirs while the round is open (until the first weight's
    post-all-gather). A weight that finds none open starts a round of its own, so an amax is
    never used past the round it was reduced for."""

    def __init__(self):
        self.open = True


def _whole_weight_amax(weight: Fp8AllGatherWeight, group, device: torch.device) -> torch.Tensor:
    """The amax of the whole tensorwise weight whose shard ``weight`` is (or copies), from its
    values now."""
    sharded = weight.sharded()
    pending, sharded._pending = sharded._pending, None
    if pending is not None and pending[0].open:
        return pending[1]
    members = _all_gathered_with(sharded)
    amaxes = _all_reduce_amaxes(members, group, device)
    this_round = _AmaxRound()
    for member, amax in zip(members, amaxes):
        member._pending = (this_round, amax)
    sharded._pending, sharded._round_led = None, this_round
    return next(amax for member, amax in zip(members, amaxes) if member is sharded)  # not ==: tensors


def _all_gathered_with(weight: Fp8AllGatherWeight) -> list[Fp8AllGatherWeight]:
    """The tensorwise FP8 weights FSDP2 all-gathers in the same round as ``weight`` (its
    parameter group, ``weight`` included), in FSDP2's order: the same list on every rank. Read
    once per weight from FSDP2's parameter groups (:func:`_fsdp_param_groups`); where those are
    not readable, ``[weight]`` (one all-reduce per weight: slower, as exact)."""
    if weight._fsdp_group is not None:
        members = [ref() for ref in weight._fsdp_group]
        if all(m is not None for m in members):
            return members
    for sharded_weights in _fsdp_param_groups():
        if any(w is weight for w in sharded_weights):
            members = [
                w for w in sharded_weights if isinstance(w, Fp8AllGatherWeight) and w._plan.granularity == "tensorwise"
            ]
            break
    else:
        _warn_amax_per_weight()
        members = [weight]
    refs = [weakref.ref(m) for m in members]
    for member in members:
        member._fsdp_group = refs
    return members


def _fsdp_param_groups():
    """The sharded local tensors of each FSDP2 parameter group alive, in FSDP2's order
    (torch private: the fully_shard states by module, their parameter groups, their
    parameters); nothing where torch's internals are not as read here."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref() if isinstance(state_ref, weakref.ref) else state_ref
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            params = [getattr(p, "sharded_param", None) for p in getattr(group, "fsdp_params", ())]
            yield [p._local_tensor for p in params if isinstance(p, DTensor)]


CHECK_SCALES_VARIABLE = "TITAN_PRIMUS_CHECK_FP8_SCALES"


def check_scales_every() -> int:
    """The debug check's cadence from ``TITAN_PRIMUS_CHECK_FP8_SCALES``: every this many
    all-gathers of a tensorwise weight (1: each), 0 (unset) for never."""
    value = os.environ.get(CHECK_SCALES_VARIABLE, "0").strip() or "0"
    if not value.isdigit():
        raise ValueError(
            f"{CHECK_SCALES_VARIABLE} must be a whole number of all-gathers >= 0 (1 checks every one, 0 none), got {value!r}"
        )
    return int(value)


def _checked_now(weight: Fp8AllGatherWeight) -> bool:
    if not weight._check_every:
        return False
    weight._all_gathers += 1
    return weight._all_gathers % weight._check_every == 0


def _check_amax(weight: Fp8AllGatherWeight, amax, group, padded_rows: int, module, shape: tuple) -> None:
    """Raise unless ``amax`` is the amax of the whole weight as an independent path computes it:
    every rank's shard all-gathered in the weight's own dtype (a debug check: a whole weight's
    traffic)."""
    whole = _all_gathered_rows(_pad_rows(weight._tensor.detach(), padded_rows), group)
    fresh = whole.abs().amax().to(torch.float32).to(amax.device)
    if not torch.equal(fresh, amax):
        sharded = weight.sharded()
        name = next(
            (n for n, p in module.named_parameters(recurse=False) if getattr(p, "_local_tensor", p) is sharded), "?"
        )
        raise RuntimeError(
            f"titan-primus: {CHECK_SCALES_VARIABLE}: the FP8 all-gather of {type(module).__name__}.{name} {list(shape)} "
            f"was about to scale with amax {amax.item()!r}, but the weight's amax is {fresh.item()!r}; its FP8 "
            f"weight would be wrong. Please report it with the write that preceded this step."
        )


@functools.cache
def _warn_amax_per_weight() -> None:
    logger.warning(
        "titan-primus: FSDP2's parameter groups are not readable on torch %s: each tensorwise FP8 weight "
        "reduces its amax in an all-reduce of its own at each all-gather (exact, more collectives)",
        torch.__version__,
    )


def _all_reduce_amaxes(weights: list[Fp8AllGatherWeight], group, device: torch.device) -> list[torch.Tensor]:
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
    return list(local.unbind())


@functools.cache
def _announce() -> None:
    logger.info("titan-primus: FSDP2 all-gathers FP8 weights as FP8 payload + scales")
