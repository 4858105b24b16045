"""The ``--override.imports`` route: add the converter to any stock TorchTitan config from the
command line, without a config function of one's own::

    --override.imports 'titan_primus.torchtitan.overrides.fp8={"recipe": "rowwise"}'

The JSON object holds :class:`Float8Converter.Config` fields. Overrides run after the config
function and after sharding configs are attached; the converter copies every field of each node
it replaces, sharding included.
"""

from __future__ import annotations

from torchtitan.config.override import override
from torchtitan.protocols.model import BaseModel

from .converter import Float8Converter


@override(target=BaseModel.Config, description="titan-primus FP8 converter (linears and MoE experts)")
def fp8(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
    return Float8Converter.Config(**converter_options).build().convert(model_config)
