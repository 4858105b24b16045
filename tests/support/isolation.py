"""The fixture every test session uses (tests/conftest.py), on either TorchTitan line, so no test sees
another's routing state."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_fresh_routing(monkeypatch):
    from titan_primus import registry, sentinel

    torch.manual_seed(0)
    sentinel.reset()  # a converter with the sentinel on leaves it for the process
    monkeypatch.delenv("TITAN_PRIMUS_BACKEND", raising=False)
    registry.refresh()  # plugins registered or doubles installed by a test leave with it
    yield
    registry.refresh()
    sentinel.reset()
