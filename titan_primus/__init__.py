"""titan-primus: portable FP8 training for TorchTitan.

Primus-Turbo on AMD MI300-class GPUs, TorchAO on other FP8 hardware, and an exact pure-PyTorch
emulation everywhere else. The core (this package minus ``titan_primus.torchtitan``) imports no
TorchTitan.
"""

from . import registry
from .backends.base import Fp8Backend, Verdict
from .device import DeviceProfile, detect_device, device_profile, known_profiles
from .metrics import sqnr
from .ops import Fp8InputError, fp8_grouped_mm, fp8_linear
from .recipes import RECIPE_NAMES, Fp8Recipe, make_recipe
from .routing import BackendUnavailableError, RoutingDecision, select_backend

__version__ = "0.1.0"


def __getattr__(name: str):
    # The TorchTitan adapter is imported only when asked for, so the core runs without TorchTitan.
    if name == "Float8Converter":
        from .torchtitan import Float8Converter

        return Float8Converter
    raise AttributeError(f"module 'titan_primus' has no attribute {name!r}")


__all__ = [
    "BackendUnavailableError",
    "DeviceProfile",
    "Float8Converter",
    "Fp8Backend",
    "Fp8InputError",
    "Fp8Recipe",
    "RECIPE_NAMES",
    "RoutingDecision",
    "Verdict",
    "detect_device",
    "device_profile",
    "fp8_grouped_mm",
    "fp8_linear",
    "known_profiles",
    "make_recipe",
    "registry",
    "select_backend",
    "sqnr",
]
