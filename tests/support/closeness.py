"""How the tests judge closeness, in one place: NaN and inf never pass (a comparison with NaN is
False, so ``not gap > bound``, ``max()`` over gaps or a count of elements beyond a bound would
otherwise let them through)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from titan_primus import sqnr


def _assert_finite(what: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), f"{what}: {name} holds NaN or inf"


def assert_bitwise(expected: torch.Tensor, actual: torch.Tensor, what: str = "") -> None:
    """Equal bit for bit (dtype and shape too), and finite."""
    _assert_finite(what, expected=expected, actual=actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    )
    assert torch.equal(actual, expected), f"{what}: not bitwise equal ({sqnr(expected, actual):.1f} dB)"


def assert_sqnr_at_least(reference: torch.Tensor, actual: torch.Tensor, min_db: float, what: str = "") -> float:
    """SQNR of ``actual`` against ``reference`` at least ``min_db``, both finite; returns it."""
    _assert_finite(what, reference=reference, actual=actual)
    db = sqnr(reference, actual)
    assert db >= min_db, f"{what}: {db:.1f} dB < {min_db} dB"
    return db


Losses = Mapping[int, float] | Sequence[float]


def relative_gaps(actual: Losses, expected: Losses, what: str = "") -> list[float]:
    """|actual - expected| / |expected| per step ({step: loss} or in step order): the same steps,
    every loss finite."""
    if isinstance(actual, Mapping) or isinstance(expected, Mapping):
        assert dict(actual).keys() == dict(expected).keys(), f"{what}: steps {sorted(actual)} vs {sorted(expected)}"
        actual, expected = [actual[k] for k in sorted(expected)], [expected[k] for k in sorted(expected)]
    assert len(actual) == len(expected) > 0, f"{what}: {len(actual)} vs {len(expected)} steps"
    assert all(math.isfinite(v) for v in [*actual, *expected]), f"{what}: a loss is not finite: {actual} vs {expected}"
    return [abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True)]


def assert_losses_within(actual: Losses, expected: Losses, rel: float, what: str = "") -> float:
    """Every step's loss within ``rel`` (relative) of the expected one, the same steps, all finite;
    returns the largest gap."""
    worst = max(relative_gaps(actual, expected, what))
    assert worst <= rel, f"{what}: losses {actual} vs {expected}: gap {worst:.4%} > {rel:.4%}"
    return worst


def fraction_beyond(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """The fraction of elements whose ``diff`` exceeds ``bound``; a NaN or inf ``diff`` counts as
    beyond."""
    beyond = ~(diff.abs() <= bound)  # NaN compares False: beyond
    return beyond.float().mean().item()
