"""``--override.imports`` targets for the FP8 token dispatch trainer tests (``tests`` on
PYTHONPATH): the converter as ``titan_primus.torchtitan.overrides.fp8`` runs it, plus

- ``fp8_dispatch_probe``: each rank prints the first packed all-to-all payload it sends
  (``PACKED <dtype> <rows>x<bytes per row>``), so a test sees the FP8 path run in the trainer;
- ``fp8_copy_in_bf16``: FP8 dispatch's definition with the tokens sent in the activations'
  dtype (:func:`copy_in_bf16_config`), what FP8 dispatch must equal bitwise."""

import functools
from dataclasses import dataclass, fields

from torchtitan.config.override import override
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.protocols.model import BaseModel

import titan_primus.token_dispatch as token_dispatch
from titan_primus.torchtitan import Float8Converter


@functools.cache
def _copy_in_bf16_class(fp8_cls):
    class Fp8CopyInBf16(fp8_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(fp8_cls.Config):
            pass

        def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
            copy = token_dispatch.fp8_copy(routed_input_ND, self.fp8_dispatch_cast)
            # TorchTitan's own all-to-all, the one the FP8 dispatcher replaces.
            return super(fp8_cls, self)._dispatch_token_exchange(copy, pg, output_splits, input_splits)

    return Fp8CopyInBf16


def copy_in_bf16_config(fp8_config):
    """``fp8_config`` (an FP8 dispatcher's Config) as the Config of a subclass that sends the same
    FP8 copy through TorchTitan's all-to-all in the activations' dtype: FP8 dispatch's definition
    without the transport."""
    cls = _copy_in_bf16_class(type(fp8_config)._owner)
    return cls.Config(**{f.name: getattr(fp8_config, f.name) for f in fields(fp8_config) if f.init})


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
    routed_experts = [routed for _, routed, _, _ in model_config.traverse(RoutedExperts.Config)]
    assert routed_experts and all(hasattr(r.token_dispatcher, "fp8_recipe") for r in routed_experts), routed_experts
    for routed in routed_experts:
        routed.token_dispatcher = copy_in_bf16_config(routed.token_dispatcher)
    return model_config
