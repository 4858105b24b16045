"""The ``--override.imports`` route: add the converter to any stock TorchTitan 0.3 config from the
command line, without a config function of one's own::

    --override.imports 'titan_primus.torchtitan.overrides.fp8={"recipe": "rowwise"}'

The JSON object holds :class:`Float8Converter.Config` fields. With selective activation
checkpointing, add ``titan_primus.torchtitan.overrides.fp8_selective_ac`` (the FP8 GEMMs under its
policy). Built in titan_primus.integrations.torchtitan.v0_3.overrides.
"""

from ..integrations.torchtitan.v0_3.overrides import register_overrides

fp8, fp8_selective_ac = register_overrides(__name__)

__all__ = ["fp8", "fp8_selective_ac"]
