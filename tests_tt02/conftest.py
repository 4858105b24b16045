"""The TorchTitan 0.2.x suite: run it in .venv-tt02 (``make test-tt02``), never beside 0.3."""

import os
from importlib.metadata import version

import pytest


# Third-party plugins installed on a developer machine must not change what the suite tests.
os.environ.setdefault("TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD", "1")

if not version("torchtitan").startswith("0.2."):
    raise pytest.UsageError(
        f"tests_tt02 tests the TorchTitan 0.2.x adapter, but torchtitan {version('torchtitan')} is installed: "
        f"run `make test-tt02`, which builds .venv-tt02 with torchtitan 0.2.2"
    )

# Before anything imports torchtitan: the launcher's CPU workarounds apply when first imported.
import titan_primus.integrations.torchtitan.v0_2.launch  # noqa: E402,F401


from support.isolation import _seed_and_fresh_routing  # noqa: E402,F401  (autouse fixture)

# Primus-Turbo's own code, one build per process: `make test-tt02` runs real_turbo/ per architecture.
collect_ignore = [] if os.environ.get("TITAN_PRIMUS_TURBO_BUILD") else ["real_turbo"]


@pytest.fixture(autouse=True)
def _restore_token_group_alignment():
    """Converting experts for TorchAO sets TorchTitan 0.2's global token-group alignment."""
    import torchtitan.models.moe.utils as moe_utils

    saved = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    yield
    moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = saved


def pytest_collection_modifyitems(config, items):
    """The costliest tests start first (tests/support/scheduling.py)."""
    from support.scheduling import costliest_first

    costliest_first(items)
