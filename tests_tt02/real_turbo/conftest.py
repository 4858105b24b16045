"""The TorchTitan 0.2.x adapter on Primus-Turbo's own code (``make test-tt02`` runs it per
architecture for the build AMD's rocm/primus v26.5 image pairs with TorchTitan 0.2.2). The
harness is the main suite's: tests/real_turbo/loader.py."""

from __future__ import annotations

import os

import pytest

from real_turbo import loader

ARCH = os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")
TURBO, SKIP_REASON = loader.from_environment()


def pytest_report_header(config):
    if TURBO is None:
        return f"Primus-Turbo real-code tier: skipped ({SKIP_REASON})"
    return f"Primus-Turbo real-code tier: {TURBO.__file__}, {ARCH}, Triton interpreter"


def pytest_collection_modifyitems(config, items):
    if TURBO is None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
