import os

import pytest

# Third-party plugins installed on a developer machine must not change what the suite tests.
os.environ.setdefault("TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD", "1")

from support.isolation import _seed_and_fresh_routing  # noqa: E402,F401  (autouse fixture)

# The tier on Primus-Turbo's own code imports one Primus-Turbo build per process: `make
# test-turbo` runs it once per build and architecture (tests/real_turbo/conftest.py).
collect_ignore = [] if os.environ.get("TITAN_PRIMUS_TURBO_BUILD") else ["real_turbo"]


@pytest.fixture
def hardware():
    """The GPU a hardware test (``mi300``, ``cuda``) runs on; tests/real_turbo/conftest.py gives
    the real-code tier's, where the same bodies run on Primus-Turbo's own code."""
    from support.helpers import Hardware

    from titan_primus import detect_device

    return Hardware("cuda", detect_device())


def pytest_collection_modifyitems(config, items):
    """Real-hardware tests run only where that hardware is (the MI300X / CUDA CI workflows); the
    costliest tests start first (scheduling.py)."""
    from support.scheduling import costliest_first

    from titan_primus import detect_device

    costliest_first(items)

    device = detect_device()
    for item in items:
        # By marker, not keyword: a parametrized test whose id holds "cuda" is no hardware test.
        if item.get_closest_marker("mi300") and not device.mi300_class:
            item.add_marker(pytest.mark.skip(reason=f"needs an MI300-class GPU; this is {device.arch}"))
        if item.get_closest_marker("cuda") and not (device.kind == "cuda" and device.fp8_hardware):
            item.add_marker(pytest.mark.skip(reason=f"needs an NVIDIA SM89+ GPU; this is {device.arch}"))
