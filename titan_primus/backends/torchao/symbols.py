"""TorchAO's names as the TorchAO backend takes them: from a table of ``name -> module`` (the
one place each is looked up), so a TorchAO that moved or renamed one is refused naming it."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping

__all__ = ["absent_symbols", "symbol"]


def symbol(table: Mapping[str, str], name: str):
    return getattr(importlib.import_module(table[name]), name)


def absent_symbols(table: Mapping[str, str], names: Iterable[str] | None = None) -> list[str]:
    """``module.name`` of each of ``names`` (all of ``table`` by default) the installed TorchAO lacks."""
    absent = []
    for name in table if names is None else names:
        try:
            symbol(table, name)
        except (ImportError, AttributeError):
            absent.append(f"{table[name]}.{name}")
    return absent
