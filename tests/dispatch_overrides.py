"""``--override.imports`` targets for the FP8 token dispatch trainer tests (``tests`` on
PYTHONPATH): the converter as ``titan_primus.torchtitan.overrides.fp8`` runs it, plus

- ``fp8_dispatch_probe``: each rank prints the first packed all-to-all payload it sends
  (``PACKED <dtype> <rows>x<bytes per row>``), so a test sees the FP8 path run in the trainer;
- ``fp8_copy_in_bf16``: FP8 dispatch's definition with the tokens sent in the activations'
  dtype (:func:`copy_in_bf16_config`), what FP8 dispatch must equal bitwise;
- ``fp8_first_half_experts``: every token routed to the first half of the experts, so that
  under EP 2 one rank's experts receive no token."""

import functools
from dataclasses import dataclass, fields

import torch
from torchtitan.config.override import override
from torchtitan.models.common.moe import MoE, RoutedExperts, TokenChoiceTopKRouter
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


@override(
    target=BaseModel.Config,
    description="titan-primus FP8 converter, every token routed to the first half of the experts (tests)",
)
def fp8_first_half_experts(model_config: BaseModel.Config, **converter_options) -> BaseModel.Config:
    """The converter, with every MoE router sending each token to experts of the first half only
    (round robin over them): under EP 2 the second rank's experts receive no token, in every
    step, forward, backward and recomputation alike (the routing depends on no state)."""
    model_config = _converted(model_config, converter_options)
    for _, moe, _, _ in model_config.traverse(MoE.Config):
        router = moe.router
        values = {f.name: getattr(router, f.name) for f in fields(router) if f.init}
        values["_debug_force_load_balance"] = True
        moe.router = FirstHalfRouter.Config(**values)
    return model_config


class FirstHalfRouter(TokenChoiceTopKRouter):
    """TorchTitan's router whose debug round robin (``_debug_force_load_balance``) runs over the
    first half of the experts."""

    printed = False

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def _debug_force_load_balance_routing(self, scores_BLE):
        bs, slen, _ = scores_BLE.shape
        ids = torch.arange(bs * slen * self.top_k, device=scores_BLE.device).reshape(bs, slen, self.top_k)
        ids = ids % (self.num_experts // 2)
        if not FirstHalfRouter.printed:  # once per rank: what the test sees of the routing
            FirstHalfRouter.printed = True
            print(f"ROUTED to experts {ids.min().item()}-{ids.max().item()} of {self.num_experts}", flush=True)
        return ids, scores_BLE.gather(dim=-1, index=ids)
