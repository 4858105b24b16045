"""A TorchTitan 0.3 override for tests: full activation checkpointing in place of the debug
configs' selective one (``--override.imports full_activation_checkpointing.full_ac``; tests/
must be on PYTHONPATH)."""

from torchtitan.config.override import override
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC


@override(target=SelectiveAC.Config, description="full activation checkpointing (titan-primus tests)")
def full_ac(config: SelectiveAC.Config) -> FullAC.Config:
    return FullAC.Config()
