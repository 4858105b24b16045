"""Selective activation checkpointing with the FP8 GEMMs under its policy: TorchTitan 0.3's own seam
("to customize the per-op SAC save set, subclass ``SelectiveAC`` and override ``get_save_ops``").

The converter's config-registry entries (``--module titan_primus --config <stock>_fp8``) use it
in place of a stock ``SelectiveAC.Config``; in a config of one's own::

    from titan_primus.torchtitan import with_fp8_gemms_saved
    config.activation_checkpoint = with_fp8_gemms_saved(config.activation_checkpoint)

(``Fp8SelectiveAC.Config()`` for a new one), or, on a stock config from the command line,
``--override.imports titan_primus.torchtitan.overrides.fp8_selective_ac``. A converter cannot do
this itself (TorchTitan hands it the model config only): ``Float8Converter.convert`` logs the fix
the first time it converts in a process. What each ``fp8_gemms`` keeps: docs/memory.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Literal

from torch.utils.checkpoint import CheckpointPolicy
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from titan_primus.checkpointing import attention_save_ops, fp8_gemm_save_ops

__all__ = ["Fp8SelectiveAC", "with_fp8_gemms_saved"]


class Fp8SelectiveAC(SelectiveAC):
    """TorchTitan's per-op selective activation checkpointing, with every titan-primus backend's
    FP8 GEMMs in the policy: each block's FP8 GEMMs alternate, the second, fourth, ... recomputed
    in backward, as TorchTitan's policy does for ``aten.mm`` (``fp8_gemms="alternate"``), or all
    saved (``"save"``: three FP8 GEMMs per op per step, 1.75x the linear outputs on Llama3-8B).
    The attention routes' ops are saved, as TorchTitan saves its own attention's. What each
    keeps: docs/memory.md."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        """The fields of ``SelectiveAC.Config``, and which FP8 GEMM outputs are saved."""

        fp8_gemms: Literal["alternate", "save"] = "alternate"
        """"alternate": every second FP8 GEMM of a block is recomputed in backward, counted in
        forward order (TorchTitan's rule for ``aten.mm``); "save": every FP8 GEMM's output is saved."""

    def __init__(self, config: Config, dump_folder: str = ""):
        if config.fp8_gemms not in ("alternate", "save"):
            raise ValueError(f"Fp8SelectiveAC.Config.fp8_gemms must be 'alternate' or 'save', got {config.fp8_gemms!r}")
        super().__init__(config, dump_folder)

    def get_save_ops(self) -> set:
        return set(super().get_save_ops()) | fp8_gemm_save_ops() | attention_save_ops()

    def _wrap_block(self, module, *, base_fqn: str | None = None):
        wrapped = super()._wrap_block(module, base_fqn=base_fqn)
        if self.config.fp8_gemms == "save":
            return wrapped
        # TorchTitan builds its policy inside _wrap_block (a closure, one per checkpointed call):
        # it is taken from the forward context its context_fn makes, and asked about every op
        # but the FP8 GEMMs.
        stock_contexts = wrapped.checkpoint_fn.keywords["context_fn"]
        gemm_ops = fp8_gemm_save_ops()

        def context_fn():
            forward, recompute = stock_contexts()
            forward.policy_fn = _every_second_recomputed(forward.policy_fn, gemm_ops)
            return forward, recompute

        wrapped.checkpoint_fn = functools.partial(wrapped.checkpoint_fn, context_fn=context_fn)
        return wrapped


def _every_second_recomputed(policy, gemm_ops):
    """``policy``, with the ops in ``gemm_ops`` saved and recomputed by turns (the first saved),
    counted apart in forward and in recompute, as TorchTitan counts ``aten.mm``."""
    counts = {False: 0, True: 0}

    def alternating(ctx, func, *args, **kwargs):
        if func not in gemm_ops:
            return policy(ctx, func, *args, **kwargs)
        counts[ctx.is_recompute] += 1
        return CheckpointPolicy.PREFER_RECOMPUTE if counts[ctx.is_recompute] % 2 == 0 else CheckpointPolicy.MUST_SAVE

    return alternating


def with_fp8_gemms_saved(ac_config):
    """``ac_config`` as an ``Fp8SelectiveAC.Config`` when it is TorchTitan's own
    ``SelectiveAC.Config`` (same fields), else unchanged (full, memory-budget or no AC, or a
    subclass of someone else's)."""
    if type(ac_config) is not SelectiveAC.Config:
        return ac_config
    return Fp8SelectiveAC.Config(**{f.name: getattr(ac_config, f.name) for f in fields(ac_config) if f.init})
