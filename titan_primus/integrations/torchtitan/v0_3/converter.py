"""``Float8Converter``: TorchTitan 0.3's way in. One entry in a model's converters list rewrites
the model config tree so linears and MoE experts run their GEMMs on the best FP8 backend here."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

# 0.3's config-tree converter protocol, imported first: on TorchTitan 0.2.x (a module-swap registry
# instead) the adapter's import error names it.
from torchtitan.protocols.model import ModelConfigConverter  # noqa: F401
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.utils import swap_token_dispatcher
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from titan_primus.recipes import with_fp8_dispatch, with_token_groups_padded_to
from titan_primus.conversion import ConversionOptions, LayerRouter, keep_fp8_cast_rounding_under_inductor
from titan_primus.sentinel import COMPILE_UNSUPPORTED, SentinelLayer
from .attention import HOST_DOCUMENT_MASKS, convert_attention, has_routed_documents
from .modules import Fp8Linear, fp8_experts_class, is_fp8_config
from .dispatch import fp8_dispatcher_config
from .seams import build_document_masks_on_host, follow_train_steps, recognise_fp8_in_has_quantization

__all__ = ["SELECTIVE_AC_FIX", "Float8Converter", "has_fp8_conversion"]

logger = logging.getLogger("titan_primus")

SELECTIVE_AC_FIX = (
    "titan-primus: TorchTitan's stock SelectiveAC leaves the FP8 GEMMs out of its policy; with selective "
    "activation checkpointing set config.activation_checkpoint = with_fp8_gemms_saved(config.activation_checkpoint) "
    "(titan_primus.torchtitan), nothing to do with full or no AC or a ready config: docs/memory.md"
)
"""Logged once per process by :meth:`Float8Converter.convert`: TorchTitan 0.3 hands a converter the
model config only, so it cannot see the trainer's activation checkpointing (set after the model
spec in a config function, or by an override); once, since a process that built one converted
model builds the rest with the same config."""

_selective_ac_fix_logged = False


def has_fp8_conversion(model_config) -> bool:
    """Whether the converter replaced any linear or expert block in ``model_config``."""
    return any(
        is_fp8_config(config)
        for config_cls in (Linear.Config, GroupedExperts.Config)
        for _, config, _, _ in model_config.traverse(config_cls)
    )


def _replace(model_config, parent, attr, new_config):
    if parent is None:
        return new_config
    if isinstance(parent, list):
        parent[attr] = new_config
    else:
        setattr(parent, attr, new_config)
    return model_config


def _copy_as(config, new_cls, **extra):
    """``config``'s fields on ``new_cls`` (a subclass of its class), plus ``extra``."""
    return new_cls(**{f.name: getattr(config, f.name) for f in fields(config) if f.init}, **extra)


def _model_compiled(trainer) -> bool:
    return trainer.config.compile.enable and "model" in trainer.config.compile.components


def _tied_linears(model_config) -> dict[str, str]:
    """Linears whose weight another module shares: fqn -> that module. TorchTitan 0.3's decoder
    ties ``tok_embeddings.weight`` to ``lm_head.weight`` when ``enable_weight_tying`` is set
    (models/common/decoder.py; qwen3's small flavors and debug model, llama3's 1B and 3B)."""
    if getattr(model_config, "enable_weight_tying", False):
        return {"lm_head": "tok_embeddings.weight"}
    return {}


class Float8Converter(QuantizationConverter):
    """Run FP8 linears and grouped MoE GEMMs on Primus-Turbo, TorchAO or the emulation,
    whichever is best on the device, decided once at conversion time. The fields are
    :class:`titan_primus.conversion.ConversionOptions` (backend, recipe, linears,
    grouped_experts, filter_fqns, auto_filter_small_kn, strict, device,
    enable_fsdp_float8_all_gather, fp8_dispatch, attention, fp8_attention, the sentinel's)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config, ConversionOptions):
        """TorchTitan's quantization-converter fields plus titan-primus's ConversionOptions."""

    def __init__(self, config: Config):
        self.config = config
        options = ConversionOptions(**{f.name: getattr(config, f.name) for f in fields(ConversionOptions)})
        self.router = LayerRouter(options)  # checks the options: bad values fail here
        self.report = self.router.report
        self.sentinel = options.sentinel()
        keep_fp8_cast_rounding_under_inductor()
        recognise_fp8_in_has_quantization(has_fp8_conversion)
        if options.attention:
            build_document_masks_on_host(HOST_DOCUMENT_MASKS, has_routed_documents)
        if self.sentinel:
            if config.model_compile_enabled:
                raise ValueError(COMPILE_UNSUPPORTED)
            follow_train_steps(_model_compiled)

    def convert(self, model_config):
        """``model_config`` with FP8 linears and experts, as ``model_registry`` calls it; logs
        :data:`SELECTIVE_AC_FIX` the first time anything was converted (see :meth:`convert_model`)."""
        global _selective_ac_fix_logged
        model_config = self.convert_model(model_config)
        if self.report.converted() and not _selective_ac_fix_logged:
            _selective_ac_fix_logged = True
            logger.warning(SELECTIVE_AC_FIX)
        return model_config

    def convert_model(self, model_config):
        """:meth:`convert` for callers that make the activation checkpointing save the FP8 GEMMs
        themselves (the ready configs: ``config_registry.with_fp8``)."""
        if self.config.linears:
            model_config = self._convert_linears(model_config)
        if self.config.grouped_experts:
            model_config = self._convert_experts(model_config)
        model_config = convert_attention(model_config, self.router, _replace)
        logger.info(self.report.summary())
        return model_config

    def _watched(self, fqn: str) -> SentinelLayer | None:
        return SentinelLayer(self.sentinel, fqn) if self.sentinel else None

    def _convert_linears(self, model_config):
        tied = _tied_linears(model_config)
        for fqn, linear, parent, attr in list(model_config.traverse(Linear.Config)):
            custom = type(linear) is not Linear.Config
            decision = self.router.linear(
                fqn,
                linear.in_features,
                linear.out_features,
                unconvertible=f"{type(linear).__qualname__} has its own forward, which FP8 would replace"
                if custom
                else None,
            )
            if decision is not None:
                all_gather = self.router.fp8_all_gather("linear", fqn, shared_with=tied.get(fqn))
                new = _copy_as(
                    linear,
                    Fp8Linear.Config,
                    fp8_backend=decision.backend_name,
                    fp8_recipe=decision.recipe,
                    fp8_all_gather=all_gather,
                    fp8_sentinel=self._watched(fqn),
                    fp8_name=fqn,
                )
                model_config = _replace(model_config, parent, attr, new)
        return model_config

    def _convert_experts(self, model_config):
        for fqn, experts, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            decision = self.router.experts(fqn, experts.dim, experts.hidden_dim)
            if decision is None:
                continue
            recipe = decision.recipe
            alignment = decision.backend.group_alignment(recipe)
            if alignment:
                swap_token_dispatcher(parent, alignment)  # ``parent`` is RoutedExperts.Config
                recipe = with_token_groups_padded_to(recipe, alignment)
            if self.config.fp8_dispatch:
                recipe = self._fp8_token_dispatch(fqn, parent, recipe)
            cls = fp8_experts_class(type(experts)._owner)
            new = _copy_as(
                experts,
                cls.Config,
                fp8_backend=decision.backend_name,
                fp8_recipe=recipe,
                fp8_all_gather=self.router.fp8_all_gather("grouped_mm"),
                fp8_sentinel=self._watched(fqn),
                fp8_name=fqn,
            )
            model_config = _replace(model_config, parent, attr, new)
        return model_config

    def _fp8_token_dispatch(self, fqn, routed_experts, recipe):
        """``recipe``, with FP8 token dispatch where the recipe and TorchTitan's dispatcher allow it
        (``routed_experts``, the RoutedExperts.Config, then gets the FP8 dispatcher)."""
        dispatching = swapped = None
        if recipe.fp8_dispatch_refusal is None:
            # One recipe for the experts and their dispatcher: it says what the tokens are sent in.
            dispatching = with_fp8_dispatch(recipe)
            swapped = fp8_dispatcher_config(routed_experts.token_dispatcher, dispatching)
        if not self.router.token_dispatch(fqn, recipe, unsupported=swapped if isinstance(swapped, str) else None):
            return recipe
        routed_experts.token_dispatcher = swapped
        return dispatching
