"""The TorchTitan line a test session runs on (its venv has one installed):
tests/integrations/torchtitan/ collects that line's folder (``v0_2/`` or ``v0_3/``) beside the
tests common to both, which take it as the ``line`` fixture."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import version
from types import ModuleType

__all__ = ["Line", "installed_line"]

_ADAPTERS = {"0.2": ("titan_primus.torchtitan02", "torchtitan02"), "0.3": ("titan_primus.torchtitan", "torchtitan")}


@dataclass(frozen=True)
class Line:
    torchtitan: str
    """The installed TorchTitan's version."""
    name: str
    """"0.2" or "0.3" (TorchTitan's main, the 0.3 adapter's canary, counts as 0.3)."""
    adapter: str
    """The adapter package users import on this line."""
    extra: str
    """titan-primus's pip extra for this line."""
    other_adapter: str

    @property
    def folder(self) -> str:
        """Its package under titan_primus/integrations/torchtitan/ and its tests' folder."""
        return "v" + self.name.replace(".", "_")

    @property
    def seams(self) -> ModuleType:
        return importlib.import_module(f"titan_primus.integrations.torchtitan.{self.folder}.seams")

    @property
    def launch(self) -> ModuleType:
        """The CPU launcher, whose import applies its seams."""
        return importlib.import_module(f"titan_primus.integrations.torchtitan.{self.folder}.launch")


def installed_line() -> Line:
    torchtitan = version("torchtitan")
    name = "0.2" if torchtitan.startswith("0.2.") else "0.3"
    (adapter, extra), (other, _) = _ADAPTERS[name], next(v for k, v in _ADAPTERS.items() if k != name)
    return Line(torchtitan, name, adapter, extra, other)
