"""The pluggy plugin manager and the backend registry built from it."""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING

import pluggy

from . import hookspec

if TYPE_CHECKING:  # importing titan_primus.backends imports every built-in backend: only lazily
    from .backends.base import Fp8Backend

__all__ = ["plugin_manager", "backends", "get_backend", "register", "unregister", "refresh"]

DISABLE_AUTOLOAD_ENV = "TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD"


@cache
def plugin_manager() -> pluggy.PluginManager:
    from . import backends as builtin

    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    pm.register(builtin, name="titan_primus.builtin")
    if not os.environ.get(DISABLE_AUTOLOAD_ENV):
        pm.load_setuptools_entrypoints(hookspec.PROJECT)
    return pm


@cache
def backends() -> dict[str, Fp8Backend]:
    """Every registered backend by name, built-ins first."""
    from .backends.base import Fp8Backend

    pm = plugin_manager()
    found: dict[str, Fp8Backend] = {}
    owner: dict[str, str] = {}
    # get_hookimpls() lists plugins in the order they were registered (pluggy calls them in the
    # reverse order): built-ins first, so that routing, which keeps this order among backends of
    # equal rank, gives a tie to a built-in.
    for impl in pm.hook.titan_primus_register_backends.get_hookimpls():
        for backend in impl.function():
            if not isinstance(backend, Fp8Backend):
                raise TypeError(f"plugin {impl.plugin_name!r} returned {backend!r}, which is not an Fp8Backend")
            if backend.name in found:
                raise ValueError(
                    f"backend name {backend.name!r} is registered by both {owner[backend.name]!r} "
                    f"and {impl.plugin_name!r}; rename one of them"
                )
            found[backend.name] = backend
            owner[backend.name] = impl.plugin_name
    references = [name for name, backend in found.items() if backend.reference]
    if len(references) > 1:
        raise ValueError(
            f"backends {', '.join(repr(n) for n in references)} ({', '.join(owner[n] for n in references)}) all "
            "declare reference = True; only the exact emulation every backend is compared with may"
        )
    return found


def reference_backend() -> Fp8Backend | None:
    """The registered backend that is the exact reference (``Fp8Backend.reference``), or None."""
    return next((b for b in backends().values() if b.reference), None)


def get_backend(name: str) -> Fp8Backend:
    registered = backends()
    if name not in registered:
        raise ValueError(f"unknown FP8 backend {name!r}; registered backends: {', '.join(registered)}")
    return registered[name]


_generation = 0


def generation() -> int:
    """Bumped by every :func:`refresh`: caches built from the registry (routing's) key on it."""
    return _generation


def refresh() -> None:
    """Forget cached backends, and with them every routing decision made from them (after plugins
    or the environment changed)."""
    global _generation
    backends.cache_clear()  # backend instances are rebuilt, so their lazy import checks rerun
    _generation += 1


def register(plugin: object, name: str | None = None) -> str:
    """Register a plugin object (a module or instance with hook implementations) at run time."""
    pm = plugin_manager()
    registered = pm.register(plugin, name=name)
    refresh()
    try:
        backends()  # validate now: a clashing or malformed plugin is refused, not left half-registered
    except Exception:
        pm.unregister(plugin)
        refresh()
        raise
    return registered


def unregister(plugin: object | None = None, name: str | None = None) -> None:
    plugin_manager().unregister(plugin, name=name)
    refresh()
