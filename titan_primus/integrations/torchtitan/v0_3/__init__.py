"""The TorchTitan 0.3 line: ``converter`` (Float8Converter over LayerRouter), ``modules`` (Fp8Linear,
the FP8 experts), ``attention``, ``dispatch`` (FP8 token dispatch), ``activation_checkpoint``
(Fp8SelectiveAC), ``overrides`` and ``config_registry`` (the ways in without Python), ``trainer``
(validate's hooks), ``launch`` (the CPU launcher) and ``seams`` (every patch of TorchTitan 0.3's
internals). Public names: titan_primus.torchtitan. Importing this package imports nothing."""
