"""Turning FP8 all-gather on and off for a parameter, and the state-dict hook that keeps
checkpoints plain."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .plan import Fp8AllGatherPlan
from .sharded import Fp8AllGatherWeight, check_scales_every

__all__ = [
    "enable_fp8_all_gather",
    "disable_fp8_all_gather",
]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


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
    ``fully_shard``; the parameter may be on the meta device."""
    param = getattr(module, name)
    if isinstance(_local(param), Fp8AllGatherWeight):
        return
    if isinstance(param, DTensor):
        raise ValueError(
            f"titan-primus: FP8 all-gather wraps the plain weight before FSDP2 shards it; "
            f"{type(module).__name__}.{name} is already a DTensor (tensor parallelism?)"
        )
    weight = Fp8AllGatherWeight(param.data, plan)
    weight._check_every = check_scales_every()
    setattr(module, name, torch.nn.Parameter(weight, requires_grad=param.requires_grad))
    module.register_state_dict_post_hook(_plain_state_dict)


def disable_fp8_all_gather(module: torch.nn.Module, name: str) -> None:
    """Undo :func:`enable_fp8_all_gather` (before ``fully_shard``): the plain parameter again."""
    param = getattr(module, name)
    if isinstance(param, Fp8AllGatherWeight):
        setattr(module, name, torch.nn.Parameter(param._tensor, requires_grad=param.requires_grad))
