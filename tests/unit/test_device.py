import pytest
import torch

import titan_primus as tp


def test_cpu_detected_here():
    device = tp.detect_device()
    assert (device.kind, device.arch, device.mi300_class, device.detected) == ("cpu", "cpu", False, True)
    assert device.e4m3 == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "arch, kind, mi300, e4m3, e5m2",
    [
        ("gfx942", "rocm", True, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz),
        ("gfx950", "rocm", True, torch.float8_e4m3fn, torch.float8_e5m2),
        ("sm90", "cuda", False, torch.float8_e4m3fn, torch.float8_e5m2),
        ("cpu", "cpu", False, torch.float8_e4m3fn, torch.float8_e5m2),
    ],
)
def test_named_profiles(arch, kind, mi300, e4m3, e5m2):
    device = tp.device_profile(arch)
    assert (device.kind, device.arch, device.mi300_class, device.e4m3, device.e5m2) == (kind, arch, mi300, e4m3, e5m2)
    assert not device.detected


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="gfx942"):
        tp.device_profile("gfx9000")


class _Props:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_rocm_arch_read_from_gcn_arch_name_at_run_time(monkeypatch):
    """gcnArchName carries feature suffixes; the arch is read at run time, not from build flags."""
    from titan_primus import device as device_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", "7.0")
    for arch_name, arch, fnuz in (("gfx942:sramecc+:xnack-", "gfx942", True), ("gfx950:sramecc+", "gfx950", False)):
        device_mod._detect_cuda.cache_clear()
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda i, n=arch_name: _Props(gcnArchName=n, name="AMD Instinct")
        )
        device = tp.detect_device()
        assert (device.kind, device.arch, device.mi300_class, device.fnuz, device.detected) == (
            "rocm",
            arch,
            True,
            fnuz,
            True,
        )
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(major=9, minor=0, name="NVIDIA H100"))
    device_mod._detect_cuda.cache_clear()
    assert tp.detect_device().arch == "sm90" and tp.detect_device().fp8_hardware
    device_mod._detect_cuda.cache_clear()
