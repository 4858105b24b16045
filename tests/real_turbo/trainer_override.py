"""An ``--override.imports`` target for TorchTitan 0.3's trainer on Primus-Turbo's own code: each
rank imports the build the environment names (loader.py) before the converter routes, then the
model is converted as ``titan_primus.torchtitan.overrides.fp8`` does::

    --override.imports 'real_turbo.trainer_override.fp8_on_primus_turbo={"recipe": "rowwise", ...}'

(``tests`` on PYTHONPATH, ``TRITON_INTERPRET=1`` and ``TITAN_PRIMUS_TURBO_BUILD`` set.)"""

from torchtitan.config.override import override
from torchtitan.protocols.model import BaseModel

import titan_primus as tp
from real_turbo import loader
from titan_primus.torchtitan import Float8Converter


@override(target=BaseModel.Config, description="titan-primus FP8 converter on Primus-Turbo's own code (tests)")
def fp8_on_primus_turbo(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
    _, why_not = loader.from_environment()
    if why_not:
        raise RuntimeError(f"Primus-Turbo's own code cannot be imported: {why_not}")
    tp.registry.refresh()
    return Float8Converter.Config(**converter_options).build().convert(model_config)
