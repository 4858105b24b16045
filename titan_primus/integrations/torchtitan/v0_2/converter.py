"""``Float8Converter``: TorchTitan 0.2.x's way in, a model converter that swaps modules on the
meta model so linears and MoE experts run their GEMMs on the best FP8 backend here."""

from __future__ import annotations

import functools
import logging

from torch import nn

# 0.2.x's converter registry, imported first: on TorchTitan 0.3 (config-tree converters instead)
# the adapter's import error names it.
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.models.moe.utils import set_token_group_alignment_size_m
from torchtitan.protocols.train_spec import get_train_spec

from titan_primus.checkpointing import attention_save_ops, fp8_gemm_save_ops

from titan_primus.conversion import (
    ConversionOptions,
    LayerRouter,
    check_parallelism,
    keep_fp8_cast_rounding_under_inductor,
)
from titan_primus.fsdp_fp8 import fp8_all_gather_plan
from titan_primus.integrations.torchtitan.common.fsdp_shards import fsdp_shards
from titan_primus.recipes import with_fp8_dispatch, with_token_groups_padded_to
from titan_primus.sentinel import COMPILE_UNSUPPORTED, SentinelLayer, watch
from .attention import attention_swaps
from .modules import Fp8GroupedExperts, Fp8Linear
from .dispatch import install_fp8_expert_parallel
from .seams import follow_train_steps, save_in_selective_ac

__all__ = ["CONVERTER_NAME", "Float8Converter"]

CONVERTER_NAME = "titan_primus.float8"
"""The name to list in ``[model] converters``."""

OPTIONS_SECTION = "titan_primus"

logger = logging.getLogger("titan_primus")


def _options(job_config) -> ConversionOptions:
    options = getattr(job_config, OPTIONS_SECTION, None)
    if options is None:
        logger.info(
            "titan-primus: no [%s] options in the job config (set [job] custom_config_module = "
            '"titan_primus.torchtitan02" to read them); using the defaults',
            OPTIONS_SECTION,
        )
        return ConversionOptions()
    if not isinstance(options, ConversionOptions):
        raise TypeError(
            f"job_config.{OPTIONS_SECTION} is a {type(options).__name__}, not titan-primus's ConversionOptions: "
            f"another custom_config_module defines a [{OPTIONS_SECTION}] section"
        )
    return options


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_fqn, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent_fqn), name, new)


def _model_compiled(job_config) -> bool:
    compile_config = getattr(job_config, "compile", None)
    return bool(compile_config and compile_config.enable and "model" in compile_config.components)


class Float8Converter:
    """Run FP8 linears and grouped MoE GEMMs on Primus-Turbo, TorchAO or the emulation,
    whichever is best on the device, decided once at conversion time.

    TorchTitan 0.2.x's ``ModelConverter`` protocol: built with ``(job_config, parallel_dims)``,
    ``convert(model)`` in place on the meta model before parallelisation. Options come from the
    ``[titan_primus]`` section (:class:`~titan_primus.conversion.ConversionOptions`).
    Parallelisms that would change the FP8 numerics (tensor parallelism; expert parallelism with
    scales across experts that the recipe does not define over a rank's experts) are refused at
    conversion, before the first step. With ``fp8_dispatch`` under expert parallelism the model's
    parallelize function builds :class:`~.token_dispatch.Fp8ExpertParallel` for its experts.
    """

    def __init__(self, job_config, parallel_dims):
        self.router = LayerRouter(_options(job_config))
        self.parallel_dims = parallel_dims
        self.report = self.router.report
        self.sentinel = self.router.options.sentinel()
        # TorchTitan's job config names the model (its train spec); partial ones may not.
        self.model_name = getattr(getattr(job_config, "model", None), "name", None)
        # 0.2.1+: "deepep" moves the tokens with DeepEP's kernels, not ExpertParallel's all-to-all.
        parallelism = getattr(job_config, "parallelism", None)
        self.ep_comm_backend = getattr(parallelism, "expert_parallel_comm_backend", "standard")
        keep_fp8_cast_rounding_under_inductor()
        if self.sentinel:
            if _model_compiled(job_config):
                raise ValueError(COMPILE_UNSUPPORTED)
            follow_train_steps(lambda trainer: _model_compiled(trainer.job_config))

    def convert(self, model: nn.Module) -> None:
        options = self.router.options
        # Listed before the swaps: named_modules() must not walk the modules being replaced.
        modules = list(model.named_modules())
        self._owners = _owners_of_shared_parameters(model)
        if options.linears:
            for fqn, module in modules:
                if isinstance(module, nn.Linear):
                    self._convert_linear(model, fqn, module)
        if options.grouped_experts:
            for fqn, module in modules:
                if isinstance(module, GroupedExperts):
                    self._convert_experts(model, fqn, module)
        for fqn, wrapper in attention_swaps(model, self.router, context_parallel=self.parallel_dims.cp > 1):
            _swap(model, fqn, wrapper)
        routed_attention = any(route.backend for route in self.report.attention)
        if (self.report.converted() or routed_attention) and self.model_name:
            save_fp8_gemms_under_selective_ac(self.model_name)
        logger.info(self.report.summary())

    def _convert_linear(self, model: nn.Module, fqn: str, linear: nn.Linear) -> None:
        unconvertible = None
        if type(linear) is not nn.Linear:
            unconvertible = f"{type(linear).__qualname__} has its own forward, which FP8 would replace"
        decision = self.router.linear(fqn, linear.in_features, linear.out_features, unconvertible=unconvertible)
        if decision:
            check_parallelism(Fp8Linear.__name__, self.parallel_dims, decision, experts=False)
            # Only where FSDP2 shards the weight (tensor parallelism is refused above); a weight
            # another module shares (tied weights) keeps its high-precision all-gather.
            others = [owner for owner in self._owners.get(linear.weight, []) if owner != f"{fqn}.weight"]
            plan = self._all_gather_plan(
                "linear", decision, fqn, shared_with=", ".join(others) or None, shapes=[tuple(linear.weight.shape)]
            )
            self._place(model, fqn, Fp8Linear.from_linear(linear, decision, plan))

    def _convert_experts(self, model: nn.Module, fqn: str, experts: GroupedExperts) -> None:
        unconvertible = None
        if type(experts) is not GroupedExperts:
            unconvertible = f"{type(experts).__qualname__} has its own forward, which FP8 would replace"
        _, hidden_dim, dim = experts.w1.shape
        decision = self.router.experts(fqn, dim, hidden_dim, unconvertible=unconvertible)
        if not decision:
            return
        check_parallelism(Fp8GroupedExperts.__name__, self.parallel_dims, decision, experts=True)
        recipe = decision.recipe
        alignment = decision.backend.group_alignment(recipe)
        if alignment:
            # TorchTitan 0.2 pads token groups to one global multiple (its EP dispatch reads it
            # too; without EP the module pads them).
            set_token_group_alignment_size_m(alignment)
            recipe = with_token_groups_padded_to(recipe, alignment)
        plan = self._all_gather_plan(
            "grouped_mm", decision, fqn, shapes=[tuple(experts.w1.shape), tuple(experts.w2.shape)]
        )
        if self.router.token_dispatch(fqn, recipe, unsupported=self._fp8_dispatch_transport(recipe)):
            recipe = with_fp8_dispatch(recipe)
        fp8 = Fp8GroupedExperts.from_experts(experts, decision, alignment, plan, recipe=recipe)
        self._place(model, fqn, fp8)

    def _fp8_dispatch_transport(self, recipe) -> str | None:
        """Why the routed tokens of experts running ``recipe`` cannot cross the EP all-to-all in
        FP8 here; None where they can, or where the recipe itself refuses (the router reports
        that). Without expert parallelism the experts take the FP8 copy themselves."""
        if not self.router.options.fp8_dispatch or recipe.fp8_dispatch_refusal is not None:
            return None
        return self._expert_parallel_dispatch_refusal if self.parallel_dims.ep > 1 else None

    @functools.cached_property
    def _expert_parallel_dispatch_refusal(self) -> str | None:
        """Under expert parallelism: installs Fp8ExpertParallel in the model's parallelize
        function (once per converter), or says why it cannot. The install is process-wide and
        stays (see ``install_fp8_expert_parallel``): it rebinds a name in TorchTitan's module
        globals, which the trainer's later parallelize call reads."""
        if self.ep_comm_backend != "standard":
            return (
                f"TorchTitan's expert_parallel_comm_backend {self.ep_comm_backend!r} moves the tokens with its own "
                f'kernels; FP8 dispatch runs on ExpertParallel\'s all-to-all ("standard")'
            )
        if not self.model_name:
            return (
                "the job config names no model ([model] name), so the converter cannot reach the "
                "ExpertParallel of its parallelize function"
            )
        return install_fp8_expert_parallel(self.model_name)

    def _place(self, model: nn.Module, fqn: str, fp8: nn.Module) -> None:
        """Swap ``fp8`` in at ``fqn``, under the numerics sentinel when it is on."""
        if self.sentinel:
            fp8.fp8_backend = watch(fp8, fp8.fp8_backend, SentinelLayer(self.sentinel, fqn))
        _swap(model, fqn, fp8)

    def _all_gather_plan(self, op, decision, fqn, shapes, shared_with=None):
        """The FP8 all-gather plan for the weights of the layer at ``fqn`` (of ``shapes``),
        where FSDP2 shards them (:func:`fsdp_shards`: where TorchTitan 0.2 shards them; tensor
        parallelism never reaches here with one, check_parallelism refuses it for these layers)."""
        dims = self.parallel_dims
        sharded = [
            fsdp_shards(
                shape, experts=op == "grouped_mm", fsdp=dims.dp_shard * dims.cp, ep=dims.ep, dim1_without_ep=False
            )
            for shape in shapes
        ]
        if not self.router.fp8_all_gather(op, fqn, shared_with, sharded if dims.fsdp_enabled else None):
            return None
        # Nothing to save where FSDP2 does not shard them (no FSDP; expert parallelism leaving
        # one rank per expert shard).
        if not dims.fsdp_enabled or all(world == 1 for _, _, world in sharded):
            return None
        return fp8_all_gather_plan(decision.backend, decision.recipe, op)[0]

    def post_optimizer_hook(self, model) -> None:
        """Nothing (TorchTitan 0.2.x's ModelConverter protocol asks for it): no scale outlives
        a step; a tensorwise FP8 all-gather reduces its amaxes at each all-gather."""


def _owners_of_shared_parameters(model: nn.Module) -> dict:
    """Parameter -> the ``module.name`` of every place holding it, for parameters held in more
    than one place (tied weights: qwen3's output projection shares the token embedding's)."""
    owners: dict = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(param, []).append(f"{module_fqn}.{name}" if module_fqn else name)
    return {param: where for param, where in owners.items() if len(where) > 1}


def save_fp8_gemms_under_selective_ac(model_name: str) -> None:
    """Add the backends' FP8 GEMM ops to the save list of TorchTitan 0.2.x's per-op selective
    activation checkpointing for ``model_name``: the module-level ``_op_sac_save_list`` of the
    module defining its train spec's ``parallelize_fn``, which that function hands to
    ``apply_ac`` (read when each op runs, so adding to it before then is enough). Without them
    every FP8 GEMM of a checkpointed block runs again in backward (TorchAO's ``_scaled_mm``
    included: 0.2.x's lists hold ``aten.mm`` only)."""
    save_in_selective_ac(
        get_train_spec(model_name).parallelize_fn, fp8_gemm_save_ops() | attention_save_ops(), model_name
    )


# TorchTitan 0.2.x finds converters by name in its registry ([model] converters).
register_model_converter(Float8Converter, CONVERTER_NAME)
