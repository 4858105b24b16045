"""A seam: one place where titan-primus patches an internal of TorchTitan (or of torch, for the
trainer's sake), declared as data. Each line's ``seams.py`` holds all of that line's patches, each
with its :class:`Seam` record (the target, the upstream release it was written against, why), so
``titan-primus doctor`` can list them and say whether each target exists in the installed
TorchTitan before anything is patched. Every patch is idempotent: :func:`replace_once` marks what
it installs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Seam", "replace_once"]

_MARK = "__titan_primus_seam__"


@dataclass(frozen=True)
class Seam:
    """``target`` is ``"module:attribute"`` or ``"module:Class.attribute"``; ``verified`` the
    upstream release the patch was written and tested against."""

    name: str
    target: str
    verified: str
    why: str

    def owner_and_attribute(self) -> tuple[Any, str]:
        """(the object holding the target, its attribute name); imports the target's module."""
        module, _, path = self.target.partition(":")
        *owners, attribute = path.split(".")
        owner = importlib.import_module(module)
        for name in owners:
            owner = getattr(owner, name)
        return owner, attribute

    def missing(self) -> str | None:
        """Why the target is not in the installed packages, or None when it is there."""
        try:
            owner, attribute = self.owner_and_attribute()
        except (ImportError, AttributeError) as e:
            return f"{type(e).__name__}: {e}"
        except Exception as e:  # importing a TorchTitan module can fail on its own dependencies
            return f"importing it failed: {type(e).__name__}: {e}"
        return (
            None
            if hasattr(owner, attribute)
            else f"{self.target.rpartition('.')[0] or self.target.partition(':')[0]} has no {attribute}"
        )

    def row(self) -> dict[str, Any]:
        missing = self.missing()
        return {
            "name": self.name,
            "target": self.target,
            "verified": self.verified,
            "present": missing is None,
            "missing": missing,
            "why": self.why,
        }


def replace_once(seam: Seam, wrap: Callable[[Any], Any]) -> Any:
    """Replace ``seam``'s target with ``wrap(original)``, once per process: what it installed is
    marked with the seam's name, and a second call leaves it (returns the installed object)."""
    owner, attribute = seam.owner_and_attribute()
    current = getattr(owner, attribute)
    if getattr(current, _MARK, None) == seam.name:
        return current
    replacement = wrap(current)
    setattr(replacement, _MARK, seam.name)
    setattr(owner, attribute, replacement)
    return replacement
