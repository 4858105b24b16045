"""The TorchTitan 0.2.x suite: run it in .venv-tt02 (``make test-tt02``), never beside 0.3. The
0.2 launcher's CPU workarounds are applied by ../conftest.py, before any test imports torchtitan;
the rest (plugin autoload off, routing isolation, costliest first) is tests/conftest.py's."""

import os
from importlib.metadata import version

import pytest

if not version("torchtitan").startswith("0.2."):
    raise pytest.UsageError(
        f"tests/integrations/torchtitan/v0_2 tests the TorchTitan 0.2.x adapter, but torchtitan {version('torchtitan')} is installed: "
        f"run `make test-tt02`, which builds .venv-tt02 with torchtitan 0.2.2"
    )

# Primus-Turbo's own code, one build per process: `make test-tt02` runs real_turbo/ per architecture.
collect_ignore = [] if os.environ.get("TITAN_PRIMUS_TURBO_BUILD") else ["real_turbo"]


@pytest.fixture(autouse=True)
def _restore_token_group_alignment():
    """Converting experts for TorchAO sets TorchTitan 0.2's global token-group alignment."""
    import torchtitan.models.moe.utils as moe_utils

    saved = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    yield
    moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = saved
