"""TorchTitan 0.3 modules that run their GEMMs through a titan-primus backend.

The backend and the recipe are fixed in the module's Config at conversion time; a module looks
its backend up once at construction, so the forward pass does no routing. Parameter names,
shapes and dtypes are those of the module replaced, so state dicts and checkpoints are
unchanged and TorchTitan's name-keyed sharding applies as before.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

import spmd_types as spmd
from torch.distributed.tensor import Shard
from torchtitan.distributed.parallel_dims import MeshAxisName

from titan_primus.backends.base import TensorParallelShards
from titan_primus.conversion import check_parallelism
from titan_primus.integrations.torchtitan.common.fsdp_shards import fsdp_shards
from titan_primus.fsdp_fp8 import (
    Fp8AllGatherWeight,
    disable_fp8_all_gather,
    enable_fp8_all_gather,
    fp8_all_gather_plan,
)
from titan_primus.ops import run_grouped_mm, run_linear
from titan_primus.recipes import Fp8Recipe
from titan_primus.registry import get_backend
from titan_primus.sentinel import SentinelLayer, watch

__all__ = ["Fp8Linear", "fp8_experts_class", "is_fp8_config"]

logger = logging.getLogger("titan_primus")


class _Fp8Module:
    """What the FP8 modules share: the backend looked up once, at construction; a refusal of
    the parallelisms under which its scales would differ from one device's; and FP8 weight
    all-gather under FSDP2."""

    covers_experts: bool
    fp8_weight_names: tuple[str, ...]
    """The parameters whose GEMMs run in FP8 (what FSDP2 may all-gather as FP8)."""

    def bind_fp8(self, config) -> None:
        self.fp8_backend = get_backend(config.fp8_backend)
        self.fp8_recipe = config.fp8_recipe
        self.fp8_name = config.fp8_name or type(self).__name__
        if config.fp8_all_gather:
            # Wrapped at construction: TorchTitan's partial_dtensor backend calls parallelize
            # only under tensor parallelism, and fully_shard always follows.
            self.use_fp8_all_gather()
        if config.fp8_sentinel is not None:
            self.fp8_backend = watch(self, self.fp8_backend, config.fp8_sentinel)

    def parallelize(self, parallel_dims) -> None:
        check_parallelism(
            type(self).__name__,
            parallel_dims,
            (self.fp8_backend, self.fp8_recipe),
            experts=self.covers_experts,
            passes_shards=not self.covers_experts,
        )
        # Unwrapped before TorchTitan distributes or annotates the weights where FSDP2 is not
        # the only one to shard them along their GEMM dims (tensor parallelism), and where FSDP2
        # does not shard them (no FSDP; expert parallelism leaving one rank per expert shard):
        # nothing to save. Expert parallelism deals out whole experts first: the wrapped weight
        # stays inside its DTensor, and FSDP2 gathers each rank's experts in FP8.
        if self.covers_experts and parallel_dims.ep > 1:
            _log_expert_parallel_scales(type(self).__name__, parallel_dims.ep, self.fp8_recipe)
        if self.fp8_all_gather:
            shards = self._fsdp_shards(parallel_dims) if parallel_dims.fsdp_enabled else {}
            why_not = self._why_no_fp8_all_gather(parallel_dims)
            if why_not:
                _warn_no_fp8_all_gather(f"the {type(self).__name__} weights", why_not)
            else:
                why_not = self._fsdp_shard_refusal(shards)
                if why_not:  # one line per layer: it depends on the layer's shapes
                    _warn_no_fp8_all_gather(f"the weights of {self.fp8_name}", why_not)
            if why_not or not any(world > 1 for _, _, world in shards.values()):
                self.use_fp8_all_gather(False)
        wrapped = self.fp8_all_gather
        super().parallelize(parallel_dims)
        if wrapped and not self.fp8_all_gather:  # distributing the weights (EP) kept no subclass
            _warn_no_fp8_all_gather(
                f"the weights of {self.fp8_name}",
                f"TorchTitan's parallelize made them DTensors without the FP8 all-gather weight inside (torch "
                f"{torch.__version__}'s distribute_tensor kept no tensor subclass); please report it",
            )

    def _why_no_fp8_all_gather(self, parallel_dims) -> str | None:
        """Why these weights gather in bf16 whatever their shapes, or None."""
        return None

    def _fsdp_shards(self, parallel_dims) -> dict[str, tuple[tuple[int, ...], int, int]]:
        """Where TorchTitan 0.3's FSDP2 shards each FP8 weight (:func:`fsdp_shards`)."""
        return {
            name: fsdp_shards(
                tuple(getattr(self, name).shape),
                experts=self.covers_experts,
                fsdp=parallel_dims.dp_shard * parallel_dims.cp,
                ep=parallel_dims.ep,
                dim1_without_ep=True,
            )
            for name in self.fp8_weight_names
        }

    def _fsdp_shard_refusal(self, shards: dict) -> str | None:
        """Why FSDP2's ``shards`` of these weights cannot carry their FP8 scales (whole rows or
        blocks), if they cannot."""
        op = "grouped_mm" if self.covers_experts else "linear"
        plan, _ = fp8_all_gather_plan(self.fp8_backend, self.fp8_recipe, op)
        for name, (shape, dim, world) in shards.items():
            why = plan.shard_refusal(shape, dim, world)
            if why:
                return f"{name} {list(shape)}: {why}"
        return None

    @property
    def fp8_all_gather(self) -> bool:
        """Whether FSDP2 all-gathers this module's FP8 weights as FP8."""
        weight = getattr(self, self.fp8_weight_names[0])
        return isinstance(getattr(weight, "_local_tensor", weight), Fp8AllGatherWeight)

    def use_fp8_all_gather(self, on: bool = True) -> None:
        """Make FSDP2 all-gather this module's FP8 weights as FP8, or not (before fully_shard)."""
        if not on:
            for name in self.fp8_weight_names:
                disable_fp8_all_gather(self, name)
            return
        op = "grouped_mm" if self.covers_experts else "linear"
        plan, verdict = fp8_all_gather_plan(self.fp8_backend, self.fp8_recipe, op)
        if plan is None:
            raise ValueError(f"titan-primus: no FP8 all-gather for {self.extra_repr()}: {verdict.reason}")
        for name in self.fp8_weight_names:
            enable_fp8_all_gather(self, name, plan)


def tensor_parallel_shards(sharding_config, parallel_dims) -> TensorParallelShards | None:
    """What a linear's operands are sharded on under TorchTitan's tensor parallelism, read from
    the weight's declared TP placement: Shard(0) is column-parallel (x whole, grad_output split
    on N), Shard(1) row-parallel (x split on K). None when the layer is not TP-sharded."""
    layout = sharding_config.state_shardings.get("weight") if sharding_config else None
    if parallel_dims.tp <= 1 or layout is None:
        return None
    tp_type = layout.per_axis_spmd_types().get(MeshAxisName.TP)
    placement = spmd.spmd_type_to_dtensor_placement(tp_type) if tp_type is not None else None
    if not isinstance(placement, Shard):
        return None
    group = parallel_dims.get_mesh(MeshAxisName.TP.value).get_group()
    if placement.dim == 0:
        return TensorParallelShards(group, input_dim=None, weight_dim=0, grad_output_dim=1)
    return TensorParallelShards(group, input_dim=1, weight_dim=1, grad_output_dim=None)


@functools.cache
def _warn_no_fp8_all_gather(weights: str, why: str) -> None:
    logger.warning("titan-primus: enable_fsdp_float8_all_gather: FSDP2 gathers %s in bf16: %s", weights, why)


@functools.cache
def _log_expert_parallel_scales(module: str, degree: int, recipe: Fp8Recipe) -> None:
    logger.info(
        "titan-primus: expert parallelism (degree %d), %s %s: %s",
        degree,
        module,
        recipe.describe(),
        recipe.expert_parallel_scales,
    )


class Fp8Linear(_Fp8Module, Linear):
    """``Linear`` whose GEMMs run in FP8 on a titan-primus backend."""

    covers_experts = False
    fp8_weight_names = ("weight",)
    fp8_shards: TensorParallelShards | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        fp8_backend: str
        """Registered backend name, chosen by the converter."""
        fp8_recipe: Fp8Recipe
        """The exact numerics (recipe, definition, FP8 formats) the backend runs."""
        fp8_all_gather: bool = False
        """FSDP2 all-gathers the weight as FP8 (the converter found it exact here)."""
        fp8_sentinel: SentinelLayer | None = None
        """The numerics sentinel watches this layer (titan_primus.sentinel)."""
        fp8_name: str = ""
        """The layer's name in the model (the converter's fqn), for messages."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.bind_fp8(config)

    def parallelize(self, parallel_dims) -> None:
        self.fp8_shards = tensor_parallel_shards(self._sharding_config, parallel_dims)
        super().parallelize(parallel_dims)

    def _why_no_fp8_all_gather(self, parallel_dims) -> str | None:
        return "tensor parallelism shards them first" if self.fp8_shards is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Local shapes: under tensor parallelism x and the weight are this rank's shards, and
        # fp8_shards tells the backend which amaxes to reduce across the TP group.
        return run_linear(self.fp8_backend, x, self.weight, self.bias, self.fp8_recipe, self.fp8_shards)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_backend.name}:{self.fp8_recipe.describe()}"


_EXPERTS_CLASSES: dict[type, type] = {}


def fp8_experts_class(parent_cls: type[GroupedExperts]) -> type[GroupedExperts]:
    """A subclass of ``parent_cls`` (GroupedExperts or a subclass such as gpt-oss's) whose
    ``_grouped_mm`` seam runs on a titan-primus backend. One class per parent, reused."""
    if parent_cls in _EXPERTS_CLASSES:
        return _EXPERTS_CLASSES[parent_cls]

    class Fp8GroupedExperts(_Fp8Module, parent_cls):  # type: ignore[valid-type, misc]
        covers_experts = True
        fp8_weight_names = ("w1_EFD", "w2_EDF", "w3_EFD")

        @dataclass(kw_only=True, slots=True)
        class Config(parent_cls.Config):  # type: ignore[misc, name-defined]
            fp8_backend: str
            fp8_recipe: Fp8Recipe
            fp8_all_gather: bool = False
            fp8_sentinel: SentinelLayer | None = None
            fp8_name: str = ""

        def __init__(self, config: Config):
            super().__init__(config)
            self.bind_fp8(config)

        def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return run_grouped_mm(self.fp8_backend, A, B_t, offs, self.fp8_recipe)

    name = f"Fp8{parent_cls.__name__}"
    Fp8GroupedExperts.__name__ = Fp8GroupedExperts.__qualname__ = name
    _EXPERTS_CLASSES[parent_cls] = Fp8GroupedExperts
    return Fp8GroupedExperts


def is_fp8_config(config) -> bool:
    """Whether ``config`` builds one of the FP8 modules above."""
    return isinstance(config, (Fp8Linear.Config, *(cls.Config for cls in _EXPERTS_CLASSES.values())))
