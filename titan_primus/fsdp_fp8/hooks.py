"""Turning FP8 all-gather on and off for a parameter, the state-dict hook that keeps checkpoints
plain, and the amax precompute after optimizer steps."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from .plan import Fp8AllGatherPlan
from .sharded import _TENSORWISE, Fp8AllGatherWeight, _all_reduce_amaxes

__all__ = [
    "enable_fp8_all_gather",
    "disable_fp8_all_gather",
    "precompute_fp8_weight_amaxes",
    "register_amax_precompute_after_optimizer_steps",
]


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
