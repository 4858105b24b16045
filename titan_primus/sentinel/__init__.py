"""The numerics sentinel: FP8 training that checks itself against the exact emulation while it
runs (docs/sentinel.md). Torch-only; the TorchTitan adapters turn it on from the converter's
``sentinel_*`` options."""

from .capture import Capture, load_capture, save_capture
from .check import FLOOR_DB, GemmCheck, GemmRecord, check_record
from .monitor import (
    COMPILE_UNSUPPORTED,
    Sentinel,
    SentinelBreach,
    StepReport,
    WatchedBackend,
    active_sentinel,
    drive_trainer,
    reset,
    sentinel_for,
    watch,
)
from .options import SentinelLayer, SentinelOptions, sentinel_options

__all__ = [
    "COMPILE_UNSUPPORTED",
    "FLOOR_DB",
    "Capture",
    "GemmCheck",
    "GemmRecord",
    "Sentinel",
    "SentinelBreach",
    "SentinelLayer",
    "SentinelOptions",
    "StepReport",
    "WatchedBackend",
    "active_sentinel",
    "check_record",
    "drive_trainer",
    "load_capture",
    "reset",
    "save_capture",
    "sentinel_for",
    "sentinel_options",
    "watch",
]
