"""Selective activation checkpointing that keeps the FP8 GEMMs: TorchTitan 0.3's own seam
("to customize the per-op SAC save set, subclass ``SelectiveAC`` and override ``get_save_ops``").

The converter's config-registry entries (``--module titan_primus --config <stock>_fp8``) use it
in place of a stock ``SelectiveAC.Config``; in a config of one's own::

    from titan_primus.torchtitan import with_fp8_gemms_saved
    config.activation_checkpoint = with_fp8_gemms_saved(config.activation_checkpoint)

(``Fp8SelectiveAC.Config()`` for a new one). A converter cannot do this itself (TorchTitan hands it
the model config only): ``Float8Converter.convert`` logs this fix whenever it converts a layer.

or, on a stock config from the command line, ``--override.imports
titan_primus.torchtitan.overrides.fp8_selective_ac``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.distributed.activation_checkpoint import SelectiveAC

from ..checkpointing import fp8_gemm_save_ops

__all__ = ["Fp8SelectiveAC", "with_fp8_gemms_saved"]


class Fp8SelectiveAC(SelectiveAC):
    """TorchTitan's per-op selective activation checkpointing, with the outputs of every
    titan-primus backend's FP8 GEMMs saved too (three FP8 GEMMs per op per step, not four)."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        """The fields of ``SelectiveAC.Config``."""

    def get_save_ops(self) -> set:
        return set(super().get_save_ops()) | fp8_gemm_save_ops()


def with_fp8_gemms_saved(ac_config):
    """``ac_config`` as an ``Fp8SelectiveAC.Config`` when it is TorchTitan's own
    ``SelectiveAC.Config`` (same fields), else unchanged (full, memory-budget or no AC, or a
    subclass of someone else's)."""
    if type(ac_config) is not SelectiveAC.Config:
        return ac_config
    return Fp8SelectiveAC.Config(**{f.name: getattr(ac_config, f.name) for f in fields(ac_config) if f.init})
