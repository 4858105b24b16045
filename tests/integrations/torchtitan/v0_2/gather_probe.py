"""A test-only ``[experimental] custom_import`` for TorchTitan 0.2's trainer: what
titan_primus.torchtitan02 does (registers the converter), and tests/support/fp8_gather_probe.py's
record of FSDP2's FP8 all-gathers."""

import support.fp8_gather_probe  # noqa: F401
import titan_primus.torchtitan02  # noqa: F401  (registers the converter)
