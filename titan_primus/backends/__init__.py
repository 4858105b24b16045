"""The built-in backends, registered with the plugin manager as one plugin."""

from __future__ import annotations

from ..hookspec import hookimpl
from .base import OPS, Fp8Backend, Op, Verdict
from .emulated import EmulatedBackend
from .primus_turbo import PrimusTurboBackend
from .torchao import TorchAOBackend

__all__ = ["OPS", "Op", "Verdict", "Fp8Backend", "EmulatedBackend", "TorchAOBackend", "PrimusTurboBackend"]


@hookimpl
def titan_primus_register_backends():
    return [PrimusTurboBackend(), TorchAOBackend(), EmulatedBackend()]
