"""The ``--override.imports`` route: add the converter to any stock TorchTitan config from the
command line, without a config function of one's own::

    --override.imports 'titan_primus.torchtitan.overrides.fp8={"recipe": "rowwise"}'

The JSON object holds :class:`Float8Converter.Config` fields. Overrides run after the config
function and after sharding configs are attached; the converter copies every field of each node
it replaces, sharding included.

With selective activation checkpointing (a stock ``SelectiveAC.Config``), add
``titan_primus.torchtitan.overrides.fp8_selective_ac`` so the FP8 GEMMs are under its policy
(``Fp8SelectiveAC``: every second one of a block run again in backward, not all)::

    --override.imports 'titan_primus.torchtitan.overrides.fp8={"recipe": "rowwise"}' \
        titan_primus.torchtitan.overrides.fp8_selective_ac
"""

from __future__ import annotations

from torchtitan.config.override import override
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.protocols.model import BaseModel

from .activation_checkpoint import Fp8SelectiveAC, with_fp8_gemms_saved
from .converter import Float8Converter


@override(target=BaseModel.Config, description="titan-primus FP8 converter (linears and MoE experts)")
def fp8(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
    return Float8Converter.Config(**converter_options).build().convert(model_config)


@override(
    target=SelectiveAC.Config,
    exact=True,
    description="titan-primus: selective activation checkpointing with the FP8 GEMMs under its policy",
)
def fp8_selective_ac(ac_config: SelectiveAC.Config) -> Fp8SelectiveAC.Config:
    return with_fp8_gemms_saved(ac_config)
