"""TorchTitan 0.3's all-to-all token dispatchers with FP8 token dispatch: the dispatch all-to-all
sends the routed tokens as FP8 payload plus scales (titan_primus.token_dispatch); the count
exchange, the permutes, combine and every gradient are TorchTitan's own."""

from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from titan_primus.recipes import Fp8Recipe
from titan_primus.token_dispatch import fp8_all_to_all, fp8_copy, fp8_dispatch_cast

__all__ = ["fp8_dispatcher_config"]

_DISPATCHER_CLASSES: dict[type, type] = {}


def _fp8_dispatcher_class(parent_cls: type[AllToAllTokenDispatcher]) -> type[AllToAllTokenDispatcher]:
    """A subclass of ``parent_cls`` (the "standard" dispatcher, or TorchTitan's padding one for
    quantized grouped GEMMs) whose dispatch all-to-all runs in FP8. One class per parent."""
    if parent_cls in _DISPATCHER_CLASSES:
        return _DISPATCHER_CLASSES[parent_cls]

    class Fp8TokenDispatcher(parent_cls):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_cls.Config):  # type: ignore[misc, name-defined]
            fp8_recipe: Fp8Recipe
            """The experts' recipe, with FP8 token dispatch: the tokens cross in its
            ``fp8_dispatch_cast``."""

        def __init__(self, config: Config):
            super().__init__(config)
            self.fp8_dispatch_cast = fp8_dispatch_cast(config.fp8_recipe)
            if self.fp8_dispatch_cast is None:
                raise ValueError(
                    f"titan-primus: {type(self).__name__} sends the tokens in FP8, but its recipe "
                    f"{config.fp8_recipe.describe()} has no FP8 token dispatch (with_fp8_dispatch)"
                )

        def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
            if self.ep_mesh is None:  # no all-to-all: the experts get the same FP8 copy
                x_TD = fp8_copy(x_TD, self.fp8_dispatch_cast)
            return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)

        def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
            return fp8_all_to_all(routed_input_ND, self.fp8_dispatch_cast, output_splits, input_splits, self.ep_mesh)

    name = f"Fp8{parent_cls.__name__}"
    Fp8TokenDispatcher.__name__ = Fp8TokenDispatcher.__qualname__ = name
    _DISPATCHER_CLASSES[parent_cls] = Fp8TokenDispatcher
    return Fp8TokenDispatcher


def fp8_dispatcher_config(dispatcher_config, recipe: Fp8Recipe):
    """``dispatcher_config`` (an all-to-all dispatcher's Config) as the Config of its FP8
    dispatch subclass for the experts' ``recipe`` (with FP8 token dispatch); a reason string
    where TorchTitan's dispatcher does its own transport."""
    parent_cls = getattr(type(dispatcher_config), "_owner", None)
    if parent_cls is None or not issubclass(parent_cls, AllToAllTokenDispatcher):
        return (
            f"TorchTitan's {type(dispatcher_config).__qualname__} moves the tokens with its own kernels; "
            f'FP8 dispatch runs on the all-to-all dispatcher (moe_comm_backend "standard")'
        )
    if parent_cls in _DISPATCHER_CLASSES.values():
        parent_cls = parent_cls.__mro__[1]
    cls = _fp8_dispatcher_class(parent_cls)
    values = {f.name: getattr(dispatcher_config, f.name) for f in fields(parent_cls.Config) if f.init}
    return cls.Config(**values, fp8_recipe=recipe)
