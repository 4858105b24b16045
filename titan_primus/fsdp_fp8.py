"""FP8 weight all-gather under FSDP2: each rank quantizes its shard of an FP8 layer's weight and
FSDP2 all-gathers FP8 payload plus scales instead of bf16, through FSDP2's own extension points
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the sharded weight's tensor subclass).

Nothing changes numerically: the gathered FP8 weight is bit for bit the cast the backend would
have made of the gathered high-precision weight, because

- the shard is first cast to FSDP's ``param_dtype``, as FSDP2 does before a plain all-gather, so
  the same values are quantized (quantizing the fp32 master directly would round twice
  differently);
- tensorwise: the scale is the amax of the whole weight (one all-reduce of the shards' amaxes
  for every FP8 weight at once: after each optimizer step, :func:`precompute_fp8_weight_amaxes`,
  and on the first all-gather that finds amaxes stale, such as the first step's), rounded to
  ``param_dtype`` like the values (rounding is monotone, so this is the amax of the
  ``param_dtype`` weight);
- rowwise: a forward scale is per output row (per expert and output row for MoE expert
  weights [E, N, K]), reduced over K, and FSDP2 shards rows or experts, never K, so each rank's
  rows carry their whole scale; the scales travel with the payload where FSDP2 can gather them
  (even dim-0 shards), else the weight is gathered in high precision, with a warning;
- a weight is gathered in FP8 only where the backward pass needs nothing but that FP8 copy
  (:func:`fp8_all_gather_plan`), and only on backends that take a pre-quantized weight;
- MoE expert weights are quantized from the bf16 copy TorchTitan's experts cast them to;
- a weight shared with a module that is not an FP8 GEMM (an output projection tied to the token
  embedding) is gathered in high precision: the other module reads its values (the converters
  keep such weights out of FP8 all-gather; the all-gather checks it again).

State dicts hold the plain high-precision tensor (same names, shapes, dtypes). Torch-only: the
TorchTitan adapters wrap weights and hook the per-step amax precompute.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from .backends.base import Op, Verdict
from .recipes import Fp8Recipe
from .scaling import amax_to_scale, dequantize, quantize, scaled_cast

logger = logging.getLogger("titan_primus")

__all__ = [
    "Fp8AllGatherPlan",
    "Fp8AllGatherWeight",
    "Fp8GatheredWeight",
    "fp8_all_gather_plan",
    "enable_fp8_all_gather",
    "disable_fp8_all_gather",
    "precompute_fp8_weight_amaxes",
    "register_amax_precompute_after_optimizer_steps",
]


@dataclass(frozen=True)
class Fp8AllGatherPlan:
    """How one weight travels: its forward FP8 cast, and the backend that consumes it."""

    recipe: Fp8Recipe
    granularity: Literal["tensorwise", "rowwise"]
    backend: object
    """The layer's backend; its ``gathered_weight(data, scale, dtype, recipe, source_dtype)``
    builds the unsharded parameter from the gathered payload."""
    quantize_dtype: torch.dtype | None = None
    """The dtype the layer casts its weight to before the GEMM (TorchTitan's GroupedExperts: bf16),
    which the weight is quantized from; None: FSDP2's param_dtype, the dtype the GEMM receives."""

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
        # Blocks are laid out [non-contracted, contracted]: forward contracts the weight's K,
        # grad_input its N, so only square blocks are the same blocks in both GEMMs.
        if fwd != dgrad or fwd.block[0] != fwd.block[1]:
            return Verdict.no(
                f"{recipe.describe()}: grad_input casts the weight in other blocks ({dgrad.block[0]}x{dgrad.block[1]} "
                f"along N, the forward {fwd.block[0]}x{fwd.block[1]} along K), so an exact FP8 all-gather would "
                f"need a second FP8 copy (no traffic saved)"
            )
        return Verdict.no(
            f"{recipe.describe()}: FP8 all-gather of block-scaled weights is not implemented yet: its "
            f"{fwd.block[0]}x{fwd.block[1]} weight blocks serve both GEMMs and would stay exact where FSDP2's "
            f"row shards align with them, but TorchAO's and Primus-Turbo's block-scaled GEMMs, as wired here, "
            f"quantize the weight themselves"
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
        f"{recipe.describe()}: {why}, so an exact FP8 all-gather would need a second FP8 copy (no traffic saved)"
    )


def fp8_all_gather_plan(backend, recipe: Fp8Recipe, op: Op = "linear") -> tuple[Fp8AllGatherPlan | None, Verdict]:
    """The plan for ``op``'s weights (a linear's, or an MoE expert block's w1/w2/w3) on
    ``backend`` running ``recipe``, or None with the reason they are all-gathered in high
    precision. The same casts decide both: a grouped GEMM's B_t is cast like a linear's weight,
    per (expert, output column) where a linear's is per output row."""
    exact = _weight_casts_exact(recipe)
    if not exact:
        return None, exact
    takes = backend.takes_gathered_fp8_weight(recipe, op)
    if not takes:
        return None, takes
    # TorchTitan's GroupedExperts (0.2.x and 0.3) hand their weights to the grouped GEMM as bf16.
    quantize_dtype = torch.bfloat16 if op == "grouped_mm" else None
    plan = Fp8AllGatherPlan(recipe, recipe.output.b.granularity, backend, quantize_dtype)
    return plan, Verdict.yes(f"{exact.reason}; {takes.reason}")


def quantize_weight(weight: torch.Tensor, plan: Fp8AllGatherPlan, amax: torch.Tensor | None):
    """(FP8 data, float32 scale) of ``weight`` [N, K] or [E, N, K] as the forward GEMM casts
    it; ``amax``: the whole weight's amax for tensorwise scales (rowwise scales are per row,
    over K, local)."""
    if plan.granularity == "rowwise":
        return quantize(weight, plan.fp8_dtype, -1, plan.recipe.pow2_scales)
    scale = amax_to_scale(amax.to(weight.dtype), plan.fp8_dtype, plan.recipe.pow2_scales)
    return scaled_cast(weight, scale, plan.fp8_dtype), scale


# --- the unsharded side: what the FP8 GEMM receives -----------------------------------------


class Fp8GatheredWeight(torch.Tensor):
    """A gathered FP8 weight as the emulated and Primus-Turbo backends consume it: ``_data``
    (FP8; [N, K], or [E, N, K] for expert weights) and ``_scale`` (float32, [] or broadcastable
    to ``_data``: [N, 1], [E, N, 1]); it presents itself as the weight in ``dtype``. Autograd
    treats it as the unsharded parameter; its gradient is a plain tensor.

    The views and casts a layer makes of its weight before the GEMM keep it FP8: transposes
    (an expert's ``B_t``), zero padding (the emulation's alignment), and the cast to
    ``source_dtype``, the dtype the payload was quantized from. Anything else sees the
    dequantized weight."""

    @staticmethod
    def __new__(cls, data, scale, dtype, reciprocal, source_dtype=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device
        )

    def __init__(self, data, scale, dtype, reciprocal, source_dtype=None):
        self._data, self._scale, self._reciprocal = data, scale, reciprocal
        self._source_dtype = source_dtype or dtype

    def _with(self, data=None, scale=None, dtype=None) -> "Fp8GatheredWeight":
        return Fp8GatheredWeight(
            self._data if data is None else data,
            self._scale if scale is None else scale,
            dtype or self.dtype,
            self._reciprocal,
            self._source_dtype,
        )

    def dequantize(self) -> torch.Tensor:
        """The weight as the FP8 GEMM sees it, in float32 (exactly what the emulation's own
        cast of the high-precision weight gives; ``reciprocal``: the recipe unscales by
        multiplying with the scale's reciprocal, as Primus-Turbo's kernels do)."""
        return dequantize(self._data, self._scale, self._reciprocal)

    def fp8_data(self) -> torch.Tensor:
        return self._data

    def scale(self) -> torch.Tensor:
        return self._scale

    def scale_inv(self) -> torch.Tensor:
        """fl(1 / scale) in float32: what kernels that take scale inverses (Primus-Turbo's) receive."""
        return torch.reciprocal(self._scale)

    def __repr__(self):
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self._data.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._reciprocal, self._source_dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], *meta)

    _VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        kept = weight._kept_fp8(func, args, kwargs) if isinstance(weight, Fp8GatheredWeight) else None
        if kept is not None:
            return kept
        if func is torch.ops.aten.embedding.default and isinstance(weight, Fp8GatheredWeight):
            raise RuntimeError(
                "titan-primus: an embedding looked up a weight FSDP2 all-gathered in FP8 (a weight tied to an "
                "FP8 linear): it would read FP8-rounded values. Keep that linear out of FP8 all-gather (the "
                "converters do for TorchTitan's weight tying) or turn enable_fsdp_float8_all_gather off."
            )
        # Anything else (a norm for logging, a print) sees the dequantized weight.
        args, kwargs = tree_map_only(Fp8GatheredWeight, lambda t: t.dequantize().to(t.dtype), (args, kwargs))
        return func(*args, **kwargs)

    def _kept_fp8(self, func, args, kwargs) -> "Fp8GatheredWeight | None":
        """``func(self, ...)`` as an Fp8GatheredWeight where it changes no value, else None."""
        aten = torch.ops.aten
        # FSDP2 re-views the unsharded tensor with its original size and stride, and
        # nn.Parameter detaches it: both are the tensor itself.
        if func in self._VIEWS or (
            func is aten.as_strided.default
            and tuple(args[1]) == tuple(self.shape)
            and tuple(args[2]) == self.stride()
            and (args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)) in (0, None)
        ):
            return self._with()
        if func is aten.transpose.int:
            dims = args[1:3]
            scale = self._scale if self._scale.dim() == 0 else self._scale.transpose(*dims)
            return self._with(self._data.transpose(*dims), scale)
        if (
            func is aten._to_copy.default
            and kwargs.get("dtype") == self._source_dtype
            and all(
                value in (None, False, torch.preserve_format, self.device, self.layout)
                for key, value in kwargs.items()
                if key != "dtype"
            )
        ):
            return self._with(dtype=self._source_dtype)
        if func is aten.constant_pad_nd.default and (args[2] if len(args) > 2 else 0) == 0 and min(args[1]) >= 0:
            return self._zero_padded(args[1])
        return None

    def _zero_padded(self, pad) -> "Fp8GatheredWeight":
        """Zero padding (F.pad's ``pad``: pairs from the last dim): zero FP8 bytes (0x00 is +0 in
        every FP8 format), and a scale of 1 for the new rows of a per-row scale."""
        data = torch.nn.functional.pad(self._data.view(torch.uint8), pad).view(self._data.dtype)
        scale = self._scale
        if scale.dim():
            scale_pad = [p if scale.shape[-1 - i // 2] > 1 else 0 for i, p in enumerate(pad)]
            scale = torch.nn.functional.pad(scale, scale_pad, value=1.0)
        return self._with(data, scale)


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
            isinstance(weight, Fp8AllGatherWeight)
            and weight._plan.granularity == "tensorwise"
            and weight._group is not None
            and not weight.amax_is_fresh()
        ):
            stale.setdefault(weight._group, []).append(weight)
    for group, weights in stale.items():
        _all_reduce_amaxes(weights, group, weights[0]._reduce_device)
    return sum(len(w) for w in stale.values())


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State dicts hold the plain tensor: same name, shape and dtype as without the option."""
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        local = _local(value)
        if isinstance(local, Fp8AllGatherWeight):
            state_dict[key] = (
                DTensor.from_local(
                    local._tensor,
                    value.device_mesh,
                    value.placements,
                    shape=value.shape,
                    stride=value.stride(),
                    run_check=False,
                )
                if isinstance(value, DTensor)
                else local._tensor
            )


def enable_fp8_all_gather(module: torch.nn.Module, name: str, plan: Fp8AllGatherPlan) -> None:
    """Make FSDP2 all-gather ``module``'s parameter ``name`` as FP8 per ``plan``. Call before
    ``fully_shard``; the parameter may be on the meta device. Tensorwise plans need
    :func:`precompute_fp8_weight_amaxes` after each optimizer step (or
    :func:`register_amax_precompute_after_optimizer_steps`); without it the first all-gather
    after a step all-reduces the stale amaxes of every such weight of its group at once."""
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
    if plan.granularity == "tensorwise":
        _TENSORWISE[:] = [(ref, n) for ref, n in _TENSORWISE if ref() is not None]
        _TENSORWISE.append((weakref.ref(module), name))


def disable_fp8_all_gather(module: torch.nn.Module, name: str) -> None:
    """Undo :func:`enable_fp8_all_gather` (before ``fully_shard``): the plain parameter again."""
    param = getattr(module, name)
    if isinstance(param, Fp8AllGatherWeight):
        setattr(module, name, torch.nn.Parameter(param._tensor, requires_grad=param.requires_grad))


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
