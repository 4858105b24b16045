"""``Float8Converter``: TorchTitan 0.3's way in. One entry in a model's converters list rewrites
the model config tree so linears and MoE experts run their GEMMs on the best FP8 backend here."""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, fields

import torchtitan.components.quantization.utils as quantization_utils
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.utils import swap_token_dispatcher
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from ..adapter_import import installed_version
from ..recipes import with_fp8_dispatch, with_token_groups_padded_to
from ..conversion import ConversionOptions, LayerRouter, keep_fp8_cast_rounding_under_inductor
from ..sentinel import COMPILE_UNSUPPORTED, SentinelLayer, drive_trainer
from .attention import convert_attention
from .modules import Fp8Linear, fp8_experts_class, is_fp8_config
from .token_dispatch import fp8_dispatcher_config

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


def recognise_fp8_in_has_quantization() -> None:
    """Make TorchTitan's ``has_quantization(model_config)`` true for converted configs.

    The trainer asks it whether the model is quantized and then logs no MFU (MFU against the
    bf16 peak misleads for FP8). In TorchTitan 0.3.0 it recognises only TorchTitan's own
    float8/MXFP8/NVFP4 Config classes and offers no registration hook, so it is wrapped: the
    original answer, or :func:`has_fp8_conversion`. Both places that hold the function are
    updated (its module, and ``torchtitan.trainer``, which imported it by name). Idempotent;
    done when a converter is built, which is before the trainer asks.
    """
    original = getattr(quantization_utils, "has_quantization", None)
    if original is None:
        # Only the MFU line depends on it: training goes on, and the user learns why MFU shows.
        _warn_has_quantization_moved()
        return
    if getattr(original, "recognises_titan_primus", False):
        return

    @functools.wraps(original)
    def has_quantization(model_config) -> bool:
        return original(model_config) or has_fp8_conversion(model_config)

    has_quantization.recognises_titan_primus = True
    quantization_utils.has_quantization = has_quantization
    trainer = sys.modules.get("torchtitan.trainer")
    if trainer is not None and getattr(trainer, "has_quantization", None) is original:
        trainer.has_quantization = has_quantization


@functools.cache
def _warn_has_quantization_moved() -> None:
    logger.warning(
        "titan-primus: TorchTitan %s has no torchtitan.components.quantization.utils.has_quantization, which "
        "titan-primus wraps so that the trainer knows an FP8 model is quantized (titan_primus/torchtitan/"
        "converter.py; verified on TorchTitan 0.3.0): TorchTitan moved or renamed it, so the trainer logs MFU "
        "against the bf16 peak. Training is unaffected. Fix: install torchtitan==0.3.0, or a titan-primus "
        "that supports this TorchTitan",
        installed_version("torchtitan"),
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
        recognise_fp8_in_has_quantization()
        if self.sentinel:
            if config.model_compile_enabled:
                raise ValueError(COMPILE_UNSUPPORTED)
            from torchtitan.trainer import Trainer

            drive_trainer(Trainer, _model_compiled)

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
