"""FP8 weight all-gather under FSDP2: each rank quantizes its shard of an FP8 layer's weight and
FSDP2 all-gathers FP8 payload plus scales instead of bf16, through FSDP2's own extension points
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the sharded weight's tensor subclass).

Nothing changes numerically: the gathered FP8 weight is bit for bit the cast the backend would
have made of the gathered high-precision weight, because

- the shard is first cast to FSDP's ``param_dtype``, as FSDP2 does before a plain all-gather, so
  the same values are quantized (quantizing the fp32 master directly would round twice
  differently);
- tensorwise: the scale is the amax of the whole weight (an all-reduce of the shards' amaxes,
  for every FP8 weight at once after each optimizer step, :func:`precompute_fp8_weight_amaxes`),
  rounded to ``param_dtype`` like the values (rounding is monotone, so this is the amax of the
  ``param_dtype`` weight);
- rowwise: a forward scale is per output row, and FSDP2 shards rows (dim 0), so each rank's
  rows carry their whole scale; the scales travel with the payload;
- a weight is gathered in FP8 only where the backward pass needs nothing but that FP8 copy
  (:func:`fp8_all_gather_plan`), and only on backends that take a pre-quantized weight.

State dicts hold the plain high-precision tensor (same names, shapes, dtypes). Torch-only: the
TorchTitan adapters wrap weights and hook the per-step amax precompute.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from .backends.base import Verdict
from .recipes import Fp8Recipe, GemmCasts
from .scaling import amax_to_scale, dequantize, quantize, scaled_cast

logger = logging.getLogger("titan_primus")

__all__ = [
    "Fp8AllGatherPlan",
    "Fp8AllGatherWeight",
    "Fp8GatheredWeight",
    "fp8_all_gather_plan",
    "enable_fp8_all_gather",
    "precompute_fp8_weight_amaxes",
    "register_amax_precompute_after_optimizer_steps",
]


@dataclass(frozen=True)
class Fp8AllGatherPlan:
    """How one weight travels: its forward FP8 cast, and the backend that consumes it."""

    recipe: Fp8Recipe
    granularity: Literal["tensorwise", "rowwise"]
    backend: object
    """The layer's backend; its ``gathered_weight(data, scale, dtype, recipe)`` builds the
    unsharded parameter from the gathered payload."""

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.recipe.dtype(self.recipe.output.b)


def _weight_casts_exact(recipe: Fp8Recipe) -> Verdict:
    """Can one FP8 copy of the weight (its forward cast) serve every GEMM that reads the weight?
    output reads it cast ``output.b`` (contracted over K); grad_input reads it cast
    ``grad_input.b`` (contracted over N); grad_weight does not read it."""
    fwd, dgrad = recipe.output.b, recipe.grad_input.b
    if fwd.fmt is None:
        return Verdict.no("the recipe keeps the weight in high precision in the forward GEMM")
    if fwd.granularity == "block":
        return Verdict.no(
            f"{recipe.describe()}: FP8 all-gather of block-scaled weights is not implemented yet "
            f"(each rank's blocks would have to align with FSDP2's row shards)"
        )
    if fwd.granularity == "tensorwise" and dgrad == fwd:
        return Verdict.yes("tensorwise: forward and grad_input GEMMs read the same FP8 weight")
    if fwd.granularity == "rowwise" and recipe.backward_from_fp8:
        return Verdict.yes(
            "rowwise per output row (FSDP2 shards rows); grad_input re-quantizes the dequantized "
            "forward copy, which the gathered payload reproduces"
        )
    if dgrad.fmt is None:
        why = "grad_input reads the high-precision weight"
    elif dgrad.granularity == "rowwise":
        why = "grad_input scales the weight per column over all output rows, which span ranks"
    else:
        why = "grad_input casts the high-precision weight with one tensorwise scale"
    return Verdict.no(
        f"{recipe.describe()}: {why}, so an exact FP8 all-gather would need a second FP8 copy "
        f"(no traffic saved)"
    )


def fp8_all_gather_plan(backend, recipe: Fp8Recipe) -> tuple[Fp8AllGatherPlan | None, Verdict]:
    """The plan for a linear on ``backend`` running ``recipe``, or None with the reason its
    weight is all-gathered in high precision."""
    exact = _weight_casts_exact(recipe)
    if not exact:
        return None, exact
    takes = backend.takes_gathered_fp8_weight(recipe)
    if not takes:
        return None, takes
    plan = Fp8AllGatherPlan(recipe, recipe.output.b.granularity, backend)
    return plan, Verdict.yes(f"{exact.reason}; {takes.reason}")


def quantize_weight(weight: torch.Tensor, plan: Fp8AllGatherPlan, amax: torch.Tensor | None):
    """(FP8 data, float32 scale) of ``weight`` [N, K] as the forward GEMM casts it; ``amax``:
    the whole weight's amax for tensorwise scales (rowwise scales are per row, local)."""
    if plan.granularity == "rowwise":
        return quantize(weight, plan.fp8_dtype, 1, plan.recipe.pow2_scales)
    scale = amax_to_scale(amax.to(weight.dtype), plan.fp8_dtype, plan.recipe.pow2_scales)
    return scaled_cast(weight, scale, plan.fp8_dtype), scale


# --- the unsharded side: what the FP8 GEMM receives -----------------------------------------


class Fp8GatheredWeight(torch.Tensor):
    """A gathered FP8 weight as the emulated and Primus-Turbo backends consume it: ``_data`` (FP8, [N, K]) and
    ``_scale`` (float32, [] or [N, 1]); it presents itself as the weight in ``param_dtype``.
    Autograd treats it as the unsharded parameter; its gradient is a plain tensor."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, reciprocal: bool):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device)

    def __init__(self, data, scale, dtype, reciprocal):
        self._data, self._scale, self._reciprocal = data, scale, reciprocal

    def dequantize(self) -> torch.Tensor:
        """The weight as the FP8 GEMM sees it, in float32 (exactly what the emulation's own
        cast of the high-precision weight gives; ``reciprocal``: the recipe unscales by
        multiplying with the scale's reciprocal, as Primus-Turbo's kernels do)."""
        return dequantize(self._data, self._scale, self._reciprocal)

    def fp8_data(self) -> torch.Tensor:
        return self._data

    def scale_inv(self) -> torch.Tensor:
        """fl(1 / scale) in float32: what kernels that take scale inverses (Primus-Turbo's) receive."""
        return torch.reciprocal(self._scale)

    def __repr__(self):
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self._data.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._reciprocal)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], *meta)

    _VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        # FSDP2 re-views the unsharded tensor with its original size and stride, and
        # nn.Parameter detaches it: both are the tensor itself.
        if func in cls._VIEWS or (
            func is torch.ops.aten.as_strided.default
            and tuple(args[1]) == tuple(weight.shape) and tuple(args[2]) == weight.stride()
            and (args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)) in (0, None)
        ):
            return Fp8GatheredWeight(weight._data, weight._scale, weight.dtype, weight._reciprocal)
        # Anything else (a norm for logging, a print) sees the dequantized weight.
        args, kwargs = tree_map_only(
            Fp8GatheredWeight, lambda t: t.dequantize().to(t.dtype), (args, kwargs)
        )
        return func(*args, **kwargs)


# --- the sharded side: the parameter FSDP2 holds -------------------------------------------


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
    ``_tensor`` moves its version counter away from ``_amax_version``.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, plan: Fp8AllGatherPlan):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.shape, strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, plan: Fp8AllGatherPlan):
        self._tensor, self._plan = tensor, plan
        self._amax: torch.Tensor | None = None
        self._amax_version = -1
        self._group = None

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._tensor!r}, {self._plan.granularity})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        plans = set()
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
        return tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t, plan), out)

    def amax_is_fresh(self) -> bool:
        return self._amax is not None and self._amax_version == self._tensor._version

    def _set_amax(self, amax: torch.Tensor) -> None:
        self._amax, self._amax_version = amax, self._tensor._version

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        plan = self._plan
        world = mesh.size()
        if plan.granularity == "rowwise" and outer_size[0] % world:
            # FSDP2 wants every all-gather input padded to the shard's padded size, which a
            # per-row scale column is not; the check is the same on every rank, so all raise.
            raise NotImplementedError(
                f"titan-primus: rowwise FP8 all-gather of a weight with {outer_size[0]} rows needs "
                f"the rows divisible by the FSDP degree ({world}); turn enable_fsdp_float8_all_gather off"
            )
        shard = self._tensor.to(mp_policy.param_dtype or self._tensor.dtype)
        if plan.granularity == "tensorwise":
            self._group = mesh.get_group()
            if not self.amax_is_fresh():  # first step, or weights changed since the precompute
                _all_reduce_amaxes([self], self._group)
        data, scale = quantize_weight(shard, plan, self._amax)
        padded_rows = -(-outer_size[0] // world)  # FSDP2 pads every shard to this many rows
        if data.shape[0] < padded_rows:  # uneven sharding: zero rows, cut off after the gather
            data = torch.cat([data, data.new_zeros(padded_rows - data.shape[0], *data.shape[1:])])
        if plan.granularity == "tensorwise":
            return (data,), (scale, outer_size[0])
        return (data, scale), (None, outer_size[0])

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        tensorwise_scale, rows = metadata
        data = all_gather_outputs[0]
        scale = tensorwise_scale if tensorwise_scale is not None else all_gather_outputs[1]
        if out is not None:  # the unsharded parameter exists; its payload was gathered in place
            if tensorwise_scale is not None:
                (out._local_tensor if isinstance(out, DTensor) else out)._scale = tensorwise_scale
            return
        # The gathered weight views the first ``rows`` rows; FSDP2 frees and reallocates the
        # whole all-gather outputs between uses.
        gathered = self._plan.backend.gathered_weight(data[:rows], scale if scale.dim() == 0 else scale[:rows],
                                                      param_dtype, self._plan.recipe)
        return gathered, tuple(all_gather_outputs)


def _all_reduce_amaxes(weights: list[Fp8AllGatherWeight], group) -> None:
    """Whole-weight amaxes of ``weights`` (shards across ``group``): one all-reduce for all."""
    # A rank's shard can be empty (more ranks than rows); 0 is neutral for the max.
    local = torch.stack([
        w._tensor.detach().abs().amax().to(torch.float32) if w._tensor.numel() else w._tensor.new_zeros((), dtype=torch.float32)
        for w in weights
    ])
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    for weight, amax in zip(weights, local.unbind()):
        weight._set_amax(amax)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


@torch.no_grad()
def precompute_fp8_weight_amaxes(params) -> int:
    """Refresh the whole-weight amaxes of the tensorwise FP8-gathered weights among ``params``
    whose values changed: one all-reduce per process group (one in all under plain FSDP2).
    Call after each optimizer step (the adapters do). Returns the number refreshed. Weights
    never all-gathered yet are left to their first all-gather."""
    stale: dict[object, list[Fp8AllGatherWeight]] = {}
    for param in params:
        weight = _local(param)
        if (
            isinstance(weight, Fp8AllGatherWeight) and weight._plan.granularity == "tensorwise"
            and weight._group is not None and not weight.amax_is_fresh()
        ):
            stale.setdefault(weight._group, []).append(weight)
    for group, weights in stale.items():
        _all_reduce_amaxes(weights, group)
    return sum(len(w) for w in stale.values())


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State dicts hold the plain tensor: same name, shape and dtype as without the option."""
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        local = _local(value)
        if isinstance(local, Fp8AllGatherWeight):
            state_dict[key] = (
                DTensor.from_local(local._tensor, value.device_mesh, value.placements,
                                   shape=value.shape, stride=value.stride(), run_check=False)
                if isinstance(value, DTensor) else local._tensor
            )


def enable_fp8_all_gather(module: torch.nn.Module, name: str, plan: Fp8AllGatherPlan) -> None:
    """Make FSDP2 all-gather ``module``'s parameter ``name`` as FP8 per ``plan``. Call before
    ``fully_shard``; the parameter may be on the meta device. Tensorwise plans need
    :func:`precompute_fp8_weight_amaxes` after each optimizer step (or
    :func:`register_amax_precompute_after_optimizer_steps`); without it each all-gather after
    a step all-reduces its own weight's amax (correct, one collective per weight)."""
    param = getattr(module, name)
    if isinstance(_local(param), Fp8AllGatherWeight):
        return
    if isinstance(param, DTensor):
        raise ValueError(
            f"titan-primus: FP8 all-gather wraps the plain weight before FSDP2 shards it; "
            f"{type(module).__name__}.{name} is already a DTensor (tensor parallelism?)"
        )
    setattr(module, name, torch.nn.Parameter(Fp8AllGatherWeight(param.data, plan), requires_grad=param.requires_grad))
    module.register_state_dict_post_hook(_plain_state_dict)
    _announce()


@functools.cache
def _announce() -> None:
    logger.info("titan-primus: FSDP2 all-gathers FP8 weights as FP8 payload + scales")


_HOOK = []


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    precompute_fp8_weight_amaxes(p for group in optimizer.param_groups for p in group["params"])


def register_amax_precompute_after_optimizer_steps() -> None:
    """Refresh FP8-gathered weights' amaxes after every optimizer step, once, process-wide
    (torch.optim's global step post-hook): TorchTitan 0.3's converters have no post-optimizer
    seam, and every optimizer that updates such a weight makes its amax stale. Optimizers that
    hold no such weight cost a scan of their parameter list."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))
