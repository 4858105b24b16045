"""``--override.imports`` targets for the FP8 token dispatch trainer tests (``tests`` on
PYTHONPATH): the converter as ``titan_primus.torchtitan.overrides.fp8`` runs it, plus

- ``fp8_dispatch_probe``: each rank prints the first packed all-to-all payload it sends
  (``PACKED <dtype> <rows>x<bytes per row>``), so a test sees the FP8 path run in the trainer;
- ``fp8_copy_in_bf16``: FP8 dispatch's definition with the tokens sent in the activations'
  dtype (:func:`copy_in_bf16_config`), what FP8 dispatch must equal bitwise;
- ``fp8_first_half_experts``: on odd steps every token routed to the first half of the
  experts, so that under EP 2 one rank's experts receive no token; TorchTitan's routing on even
  steps."""

import functools
from dataclasses import dataclass, fields

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
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
    (round robin over them) on odd steps: under EP 2 the second rank's experts then receive no
    token, forward, backward and recomputation alike (the routing depends on the optimizer steps
    taken, which recomputation does not change, not on how often the router ran)."""
    model_config = _converted(model_config, converter_options)
    for _, moe, _, _ in model_config.traverse(MoE.Config):
        router = moe.router
        values = {f.name: getattr(router, f.name) for f in fields(router) if f.init}
        values["_debug_force_load_balance"] = True
        moe.router = FirstHalfRouter.Config(**values)
    return model_config


class _Steps:
    """Optimizer steps this process has taken: those of the first optimizer that stepped (a
    container of optimizers steps each of its own too)."""

    first, taken = None, 0

    @classmethod
    def count(cls, optimizer, args, kwargs):
        cls.first = cls.first or optimizer
        cls.taken += optimizer is cls.first


register_optimizer_step_post_hook(_Steps.count)


class FirstHalfRouter(TokenChoiceTopKRouter):
    """TorchTitan's router whose debug round robin (``_debug_force_load_balance``) runs over the
    first half of the experts, on odd steps only."""

    printed_at = None

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def forward(self, *args, **kwargs):
        self._debug_force_load_balance = _Steps.taken % 2 == 0
        return super().forward(*args, **kwargs)

    def _debug_force_load_balance_routing(self, scores_BLE):
        bs, slen, _ = scores_BLE.shape
        ids = torch.arange(bs * slen * self.top_k, device=scores_BLE.device).reshape(bs, slen, self.top_k)
        ids = ids % (self.num_experts // 2)
        step = _Steps.taken + 1
        if FirstHalfRouter.printed_at != step:  # once per rank and step: what the test sees of the routing
            FirstHalfRouter.printed_at = step
            print(
                f"ROUTED at step {step} to experts {ids.min().item()}-{ids.max().item()} of {self.num_experts}",
                flush=True,
            )
        return ids, scores_BLE.gather(dim=-1, index=ids)
