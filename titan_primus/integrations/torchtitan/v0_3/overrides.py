"""The ``--override.imports`` route (users name the public module, titan_primus.torchtitan.overrides): add the converter to any stock TorchTitan config from the
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

__all__ = ["register_overrides"]


def register_overrides(module: str):
    """Register the two overrides as functions of ``module`` and return them (fp8,
    fp8_selective_ac). TorchTitan keys an override by its function's ``module.name``, the path a
    user lists in ``--override.imports``, so they are registered under the public module's name."""

    def fp8(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
        return Float8Converter.Config(**converter_options).build().convert(model_config)

    def fp8_selective_ac(ac_config: SelectiveAC.Config) -> Fp8SelectiveAC.Config:
        return with_fp8_gemms_saved(ac_config)

    for fn in (fp8, fp8_selective_ac):
        fn.__module__, fn.__qualname__ = module, fn.__name__
    return (
        override(target=BaseModel.Config, description="titan-primus FP8 converter (linears and MoE experts)")(fp8),
        override(
            target=SelectiveAC.Config,
            exact=True,
            description="titan-primus: selective activation checkpointing with the FP8 GEMMs under its policy",
        )(fp8_selective_ac),
    )
