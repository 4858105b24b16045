"""Device detection: what accelerator this process runs on and which FP8 formats it uses.

A :class:`DeviceProfile` is a frozen value. Routing and the emulated backend read only the
profile, never the hardware, so a named profile (``device_profile("gfx942")``) reproduces an
MI300X's FP8 formats and backend choice on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

__all__ = ["DeviceProfile", "detect_device", "device_profile", "known_profiles", "resolve_device"]


@dataclass(frozen=True)
class DeviceProfile:
    kind: str
    """"cpu", "cuda" (NVIDIA) or "rocm" (AMD)."""
    arch: str
    """"cpu", "sm90", "gfx942", ..."""
    name: str
    """Marketing name of the device, e.g. "AMD Instinct MI300X"."""
    e4m3: torch.dtype
    """FP8 format for activations and weights on this device."""
    e5m2: torch.dtype
    """FP8 format for gradients when a recipe quantizes them to e5m2."""
    fp8_hardware: bool
    """True where the device has FP8 matrix units (NVIDIA SM89+, AMD gfx942+)."""
    mi300_class: bool
    """AMD MI300-class (gfx942 or gfx950): the devices Primus-Turbo targets."""
    detected: bool = False
    """True when read off the running hardware, False for a named profile."""

    @property
    def fnuz(self) -> bool:
        return self.e4m3 == torch.float8_e4m3fnuz

    def describe(self) -> str:
        formats = f"{_short(self.e4m3)}/{_short(self.e5m2)}"
        origin = "detected" if self.detected else "named profile"
        return f"{self.name} ({self.kind}, {self.arch}, FP8 {formats}, {origin})"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


_OCP = (torch.float8_e4m3fn, torch.float8_e5m2)
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)

# FP8 format per architecture. gfx942 is the only FNUZ architecture among those with FP8 units;
# gfx950 and NVIDIA use the OCP formats (see shared reference notes on Primus-Turbo and TorchAO).
_NAMED: dict[str, DeviceProfile] = {
    p.arch: p
    for p in (
        DeviceProfile("cpu", "cpu", "CPU", *_OCP, fp8_hardware=False, mi300_class=False),
        DeviceProfile("cuda", "sm80", "NVIDIA A100", *_OCP, fp8_hardware=False, mi300_class=False),
        DeviceProfile("cuda", "sm89", "NVIDIA L40S", *_OCP, fp8_hardware=True, mi300_class=False),
        DeviceProfile("cuda", "sm90", "NVIDIA H100", *_OCP, fp8_hardware=True, mi300_class=False),
        DeviceProfile("cuda", "sm100", "NVIDIA B200", *_OCP, fp8_hardware=True, mi300_class=False),
        DeviceProfile("rocm", "gfx90a", "AMD Instinct MI250X", *_OCP, fp8_hardware=False, mi300_class=False),
        DeviceProfile("rocm", "gfx942", "AMD Instinct MI300X", *_FNUZ, fp8_hardware=True, mi300_class=True),
        DeviceProfile("rocm", "gfx950", "AMD Instinct MI355X", *_OCP, fp8_hardware=True, mi300_class=True),
    )
}


def known_profiles() -> tuple[str, ...]:
    return tuple(_NAMED)


def device_profile(arch: str) -> DeviceProfile:
    """A named profile for ``arch`` ("cpu", "sm90", "gfx942", "gfx950", ...), without the hardware."""
    try:
        return _NAMED[arch]
    except KeyError:
        raise ValueError(f"unknown device profile {arch!r}; known profiles: {', '.join(_NAMED)}") from None


def _rocm_profile(arch: str, name: str) -> DeviceProfile:
    if arch in _NAMED:
        return replace(_NAMED[arch], name=name or _NAMED[arch].name, detected=True)
    # Unknown ROCm arch: FP8 units from gfx942 on (gfx1200-class Navi 4 has OCP FP8 too).
    has_fp8 = arch.startswith("gfx12") or (arch.startswith("gfx9") and arch >= "gfx942")
    return DeviceProfile("rocm", arch, name, *_OCP, fp8_hardware=has_fp8, mi300_class=False, detected=True)


def _cuda_profile(major: int, minor: int, name: str) -> DeviceProfile:
    arch = f"sm{major}{minor}"
    return DeviceProfile(
        "cuda", arch, name, *_OCP, fp8_hardware=(major, minor) >= (8, 9), mi300_class=False, detected=True
    )


def detect_device(index: int | None = None) -> DeviceProfile:
    """Profile of the accelerator this process would train on (device ``index``, default current).

    ROCm arch comes from ``gcnArchName`` at run time (not from build flags), so one wheel serves
    MI300X (gfx942, FNUZ) and MI355X (gfx950, OCP).
    """
    if not torch.cuda.is_available():
        return replace(_NAMED["cpu"], detected=True)
    return _detect_cuda(torch.cuda.current_device() if index is None else index)


@cache
def _detect_cuda(index: int) -> DeviceProfile:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
        return _rocm_profile(arch, props.name)
    return _cuda_profile(props.major, props.minor, props.name)


def resolve_device(device: DeviceProfile | str | None) -> DeviceProfile:
    """Accept a profile, a profile name, or None (detect)."""
    if device is None:
        return detect_device()
    if isinstance(device, str):
        return device_profile(device)
    if isinstance(device, DeviceProfile):
        return device
    raise TypeError(
        f"device must be a DeviceProfile, a profile name such as 'gfx942', or None; got {type(device).__name__}"
    )
