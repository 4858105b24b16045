"""The numerics sentinel's options, as values both TorchTitan adapters carry into the modules."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["POLICIES", "SentinelLayer", "SentinelOptions", "sentinel_options"]

POLICIES = ("warn", "stop")


@dataclass(frozen=True)
class SentinelOptions:
    """``interval``: every this many steps one converted layer is re-computed with the exact
    emulation (round robin); ``policy``: "warn" or "stop" on a breach; ``capture_folder``: where
    a breached layer's inputs are saved ("" saves nothing)."""

    interval: int
    policy: str = "warn"
    capture_folder: str = "sentinel_captures"


@dataclass(frozen=True)
class SentinelLayer:
    """What a converted module needs to put itself under the sentinel: its name in the model
    (the converter knows it; a module does not) and the options."""

    options: SentinelOptions
    name: str


def sentinel_options(interval, policy, capture_folder) -> SentinelOptions | None:
    """The options from the converter's fields, or None when the sentinel is off (``interval``
    0). Raises ValueError naming the bad option (TOML values reach here unchecked)."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(
            f"FP8 option 'sentinel_interval' must be a whole number of steps >= 0 (0 turns the sentinel off), "
            f"got {interval!r}"
        )
    if policy not in POLICIES:
        raise ValueError(f"FP8 option 'sentinel_policy' must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not isinstance(capture_folder, str):
        raise ValueError(
            f"FP8 option 'sentinel_capture_folder' must be a folder path, or \"\" to save nothing; got {capture_folder!r}"
        )
    return SentinelOptions(interval, policy, capture_folder) if interval else None
