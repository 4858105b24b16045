"""The adapter import-error checks of tests/test_install_adapters.py, on TorchTitan 0.2.x."""

from test_install_adapters import *  # noqa: F401,F403
