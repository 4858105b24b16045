"""TorchTitan integration: everything of titan-primus that imports TorchTitan, and nothing else does.

- ``common/``: what every line shares (import diagnosis, the CPU world, the debug data, validate's
  hooks' common part, the :class:`~.common.seams.Seam` record).
- ``v0_3/``, ``v0_2/``: one package per TorchTitan line, each with the same modules (converter,
  modules, attention, dispatch, trainer, launch, seams) and, for 0.3, the config registry.

Public names stay where users import them: titan_primus.torchtitan (0.3), titan_primus.torchtitan02
(0.2.x), titan_primus.config_registry (``--module titan_primus``). A new line is one new package
here and one entry in :data:`LINES`. Importing this package imports no TorchTitan.
"""

from __future__ import annotations

import importlib

from .common.imports import installed_version
from .common.trainer import TrainerLine

__all__ = ["LINES", "TrainerLine", "installed_line", "line_seams", "trainer_line"]

# The version prefix of each supported line -> its package.
LINES = {"0.3": "v0_3", "0.2": "v0_2"}


def installed_line() -> tuple[str | None, str | None]:
    """(the installed torchtitan's version or None, the package of its line or None)."""
    version = installed_version("torchtitan")
    for prefix, package in LINES.items():
        if version and version.startswith(prefix):
            return version, package
    return version, None


def trainer_line() -> TrainerLine:
    """The line of the installed torchtitan, or ValueError naming the fix."""
    version, package = installed_line()
    if package is None:
        raise ValueError(
            f"validate drives TorchTitan 0.3's or 0.2.x's trainer; this environment has torchtitan "
            f"{version or 'not installed'} (pip install 'titan-primus[torchtitan]' or 'titan-primus[torchtitan02]')"
        )
    return importlib.import_module(f"{__name__}.{package}.trainer").LINE


def line_seams() -> tuple[str | None, tuple]:
    """(the installed torchtitan's version, the seams of its line: empty where no line fits)."""
    version, package = installed_line()
    if package is None:
        return version, ()
    return version, importlib.import_module(f"{__name__}.{package}.seams").SEAMS
