"""TorchTitan configs with the titan-primus FP8 converter: ``--module titan_primus --config NAME``.

NAME is any stock config function of the llama3, deepseek_v3 or qwen3 models, with ``_fp8``
appended, optionally followed by a recipe: ``llama3_8b_fp8``, ``deepseek_v3_debugmodel_fp8``,
``qwen3_moe_debug_fp8_tensorwise``, ``llama3_70b_fp8_rowwise_with_gw_hp``,
``deepseek_v3_debugmodel_fp8_mxfp8``, ``deepseek_v3_671b_fp8_blockwise``. The stock config is
built as TorchTitan defines it, then the converter (default recipe "rowwise", backend "auto", or
``TITAN_PRIMUS_BACKEND``) rewrites its model, and a selective activation checkpointing config
becomes :class:`~titan_primus.torchtitan.Fp8SelectiveAC`'s (the FP8 GEMMs under its policy, not
all recomputed). No Python needed.

TorchTitan silently swallows an ImportError raised while importing this module, so it imports
nothing optional at module level: TorchTitan's model registries load on first use.
"""

from __future__ import annotations

import importlib

from titan_primus.recipes import RECIPE_NAMES

MODELS = ("llama3", "deepseek_v3", "qwen3")
SUFFIX = "_fp8"

__all__ = [
    "MODELS",
    "with_fp8",
    "stock_config",
    "llama3_debugmodel_fp8",
    "deepseek_v3_debugmodel_fp8",
    "qwen3_debugmodel_fp8",
    "qwen3_moe_debug_fp8",
]


def stock_config(name: str):
    """The stock TorchTitan config function ``name`` from one of :data:`MODELS`' registries."""
    for model in MODELS:
        if name.startswith(model):
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
            fn = getattr(registry, name, None)
            if callable(fn):
                return fn
    raise AttributeError(f"no stock TorchTitan config {name!r} in the {', '.join(MODELS)} config registries")


def with_fp8(config, **converter_options):
    """Add the titan-primus converter to a Trainer.Config built by a stock config function.

    The model config tree is rewritten in place of the spec's model; TorchTitan's own model
    builder then builds FP8 modules. ``converter_options`` are :class:`Float8Converter.Config`
    fields (backend, recipe, filter_fqns, strict, ...).
    """
    from .converter import Float8Converter
    from .activation_checkpoint import with_fp8_gemms_saved

    compile_model = config.compile.enable and "model" in config.compile.components
    converter = Float8Converter.Config(model_compile_enabled=compile_model, **converter_options).build()
    config.model_spec.model = converter.convert_model(config.model_spec.model)
    # Selective activation checkpointing treats the FP8 GEMMs as it does aten.mm (Fp8SelectiveAC).
    config.activation_checkpoint = with_fp8_gemms_saved(config.activation_checkpoint)
    return config


def _split(name: str) -> tuple[str, str] | None:
    """``"<stock>_fp8[_<recipe>]"`` -> (stock, recipe), or None."""
    for recipe in sorted(RECIPE_NAMES, key=len, reverse=True):
        if name.endswith(f"{SUFFIX}_{recipe}"):
            return name[: -len(f"{SUFFIX}_{recipe}")], recipe
    if name.endswith(SUFFIX):
        return name[: -len(SUFFIX)], "rowwise"
    return None


def __getattr__(name: str):
    split = _split(name)
    if split is None:
        raise AttributeError(f"module 'titan_primus.config_registry' has no attribute {name!r}")
    stock_name, recipe = split
    stock = stock_config(stock_name)

    def config_fn():
        return with_fp8(stock(), recipe=recipe)

    config_fn.__name__ = name
    config_fn.__doc__ = f"TorchTitan's {stock_name} with the titan-primus FP8 converter (recipe {recipe})."
    return config_fn


def llama3_debugmodel_fp8():
    """Dense llama3 debug model with the converter."""
    return __getattr__("llama3_debugmodel_fp8")()


def deepseek_v3_debugmodel_fp8():
    """DeepSeek-V3 debug MoE model with the converter (linears and grouped experts)."""
    return __getattr__("deepseek_v3_debugmodel_fp8")()


def qwen3_debugmodel_fp8():
    """Dense qwen3 debug model with the converter."""
    return __getattr__("qwen3_debugmodel_fp8")()


def qwen3_moe_debug_fp8():
    """Qwen3 MoE debug model with the converter."""
    return __getattr__("qwen3_moe_debug_fp8")()
