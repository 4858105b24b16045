"""TorchTitan's lines: the tests here run on the line installed in this venv (``make test`` on
0.3, ``make test-tt02`` and ``make test-oldest`` on 0.2.x), with that line's folder beside them."""

import pytest
from support.lines import installed_line

LINE = installed_line()
collect_ignore = [folder for folder in ("v0_2", "v0_3") if folder != LINE.folder]
if LINE.name == "0.2":
    # Before any test module imports torchtitan: the 0.2 launcher's CPU workarounds apply when it is
    # first imported, and every 0.2.x test runs with them (0.3's tests apply theirs per run).
    LINE.launch


@pytest.fixture(scope="session")
def line():
    """The installed TorchTitan line (support.lines.Line)."""
    return LINE
