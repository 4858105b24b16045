"""The TorchTitan 0.2.x adapter's public names (built in titan_primus.integrations.torchtitan.v0_2):
a model converter named ``titan_primus.float8``. Written against the converter, config and MoE
APIs that 0.2.0-0.2.2 share; tested with 0.2.2.

Importing this module registers the converter with TorchTitan 0.2's converter registry. In a
job's TOML::

    [job]
    custom_config_module = "titan_primus.torchtitan02"   # adds the [titan_primus] section
    [experimental]
    custom_import = "titan_primus.torchtitan02"          # registers the converter
    [model]
    converters = ["titan_primus.float8"]
    [titan_primus]
    recipe = "rowwise"

On TorchTitan 0.3 use ``titan_primus.torchtitan`` (``--module titan_primus --config ...``).
"""

from ..integrations.torchtitan.common.imports import adapter_import_error

try:
    # Importing the converter registers it with TorchTitan 0.2's converter registry.
    from ..integrations.torchtitan.v0_2.converter import CONVERTER_NAME, Float8Converter
    from ..integrations.torchtitan.v0_2.job_config import JobConfig
    from ..integrations.torchtitan.v0_2.modules import Fp8GroupedExperts, Fp8Linear
except ImportError as e:
    raise adapter_import_error(
        e,
        adapter="titan_primus.torchtitan02",
        line="0.2.x",
        verified="0.2.2",
        extra="torchtitan02",
        line_module="torchtitan.protocols.model_converter",
        instead="On TorchTitan 0.3 use the 0.3 adapter: --module titan_primus --config <stock>_fp8",
    ) from e

__all__ = ["CONVERTER_NAME", "Float8Converter", "Fp8GroupedExperts", "Fp8Linear", "JobConfig"]
