"""TorchTitan 0.3 configs with the titan-primus FP8 converter: ``--module titan_primus --config
NAME``, NAME any stock llama3, deepseek_v3 or qwen3 config with ``_fp8`` (and optionally a recipe)
appended. TorchTitan looks the configs up in ``<module>.config_registry``, so this module is where
they are found; they are built in titan_primus.integrations.torchtitan.v0_3.config_registry.

TorchTitan silently swallows an ImportError raised while importing this module, so neither
imports anything optional at module level."""

from .integrations.torchtitan.v0_3.config_registry import *  # noqa: F403  (the public config names)
from .integrations.torchtitan.v0_3.config_registry import __all__, __getattr__  # noqa: F401
