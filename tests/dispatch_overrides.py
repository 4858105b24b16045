"""``--override.imports`` targets for the FP8 token dispatch trainer tests (``tests`` on
PYTHONPATH): the converter as ``titan_primus.torchtitan.overrides.fp8`` runs it, plus

- ``fp8_dispatch_probe``: each rank prints the first packed all-to-all payload it sends
  (``PACKED <dtype> <rows>x<bytes per row>``), so a test sees the FP8 path run in the trainer;
- ``fp8_copy_in_bf16``: FP8 dispatch's definition with the tokens sent in the activations'
  dtype (the dispatchers' ``fp8_on_the_wire=False``), what FP8 dispatch must equal bitwise."""

import functools

from torchtitan.config.override import override
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.protocols.model import BaseModel

import titan_primus.token_dispatch as token_dispatch
from titan_primus.torchtitan import Float8Converter


def _converted(model_config, options):
    return Float8Converter.Config(**options).build().convert(model_config)


@override(target=BaseModel.Config, description="titan-primus FP8 converter, printing what FP8 dispatch sends (tests)")
def fp8_dispatch_probe(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
    pack = token_dispatch._pack

    @functools.wraps(pack)
    def printing_pack(x, cast):
        packed = pack(x, cast)
        if not printing_pack.printed:
            printing_pack.printed = True
            print(
                f"PACKED {packed.dtype} {packed.shape[0]}x{packed.shape[1]} from {x.dtype} {tuple(x.shape)}", flush=True
            )
        return packed

    printing_pack.printed = False
    token_dispatch._pack = printing_pack
    return _converted(model_config, converter_options)


@override(target=BaseModel.Config, description="titan-primus FP8 dispatch's definition sent in bf16 (tests)")
def fp8_copy_in_bf16(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
    model_config = _converted(model_config, converter_options)
    dispatchers = [routed.token_dispatcher for _, routed, _, _ in model_config.traverse(RoutedExperts.Config)]
    assert dispatchers and all(hasattr(d, "fp8_on_the_wire") for d in dispatchers), dispatchers
    for dispatcher in dispatchers:
        dispatcher.fp8_on_the_wire = False
    return model_config
