"""The TorchTitan 0.2.x line: ``converter`` (the registered model converter over LayerRouter),
``modules``, ``attention``, ``dispatch`` (FP8 token dispatch), ``job_config`` (the [titan_primus]
section), ``trainer`` (validate's hooks), ``launch`` (the CPU launcher) and ``seams`` (every patch
of TorchTitan 0.2.x's internals). Public names: titan_primus.torchtitan02. Importing this package
imports nothing."""
