"""Shared test helpers. The fp32 references, forward+backward runners and SQNR bars live in
titan_primus.numerics (the parity command and the sentinel use them too); they are re-exported here
under the names the tests use."""

from __future__ import annotations

from titan_primus import device_profile, make_recipe
from titan_primus.numerics import (
    fp32_bars,
    make_offsets,
    reference_grouped,
    reference_linear,
    run_grouped,
    run_linear,
    sqnrs,
)

__all__ = ["bars", "make_offsets", "reference_grouped", "reference_linear", "run_grouped", "run_linear", "sqnrs"]


def bars(recipe: str) -> tuple[float, float, float]:
    """Minimum SQNR (dB) vs fp32 for (out, grad_input, grad_weight) under the recipe's TorchAO definition."""
    return fp32_bars(make_recipe(recipe, "torchao", device_profile("cpu")))
