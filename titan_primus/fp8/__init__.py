"""The FP8 cast math every backend and every FP8 path shares (as TorchAO's ``torchao/float8/``):
``scaling`` (amax -> scale -> saturated cast, tensorwise, rowwise and per token group, and the
reductions of amaxes across tensor-parallel shards), ``blocks`` (1x128 tiles, 128x128 blocks, MX
1x32 / 32x32 blocks with E8M0 scales). Torch-only; what each recipe casts is ``titan_primus.recipes``."""
