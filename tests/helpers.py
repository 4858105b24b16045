"""Shared test helpers. The fp32 references, forward+backward runners and SQNR bars live in
titan_primus.numerics (the parity command and the sentinel use them too); they are re-exported here
under the names the tests use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_primus import DeviceProfile, device_profile, make_recipe
from titan_primus.numerics import (
    fp32_bars,
    make_offsets,
    reference_grouped,
    reference_linear,
    run_grouped,
    run_linear,
    sqnrs,
)

__all__ = [
    "Hardware",
    "bars",
    "make_offsets",
    "reference_grouped",
    "reference_linear",
    "run_grouped",
    "run_linear",
    "sqnrs",
]


def bars(recipe: str) -> tuple[float, float, float]:
    """Minimum SQNR (dB) vs fp32 for (out, grad_input, grad_weight) under the recipe's TorchAO definition."""
    return fp32_bars(make_recipe(recipe, "torchao", device_profile("cpu")))


@dataclass(frozen=True)
class Hardware:
    """Where a hardware test's body runs (the ``hardware`` fixture): on the GPU its marker names,
    or, for an MI300 test, in the real-code tier too (tests/real_turbo: Primus-Turbo's own code
    on CPU tensors under Triton's interpreter, the architecture given to routing as a profile)."""

    device: str
    """The tensors' device."""
    profile: DeviceProfile
    """The device routing is asked about."""
    compile_backend: str = "inductor"
    """torch.compile's backend (the tier's interpreter runs ``aot_eager``: no Triton code generation)."""
    group_lens: Callable[[torch.Tensor], torch.Tensor] = lambda lens: lens
    """``group_lens`` as Primus-Turbo's public grouped op takes them (it asserts ``is_cuda``)."""
    backend: str = "auto"
    """The backend asked for: routing's choice, or one named where routing here would take
    another (TorchAO on a CPU, where routing takes the emulation)."""

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
