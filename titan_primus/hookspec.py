"""Hook specifications: the whole plugin surface of titan-primus, in one module.

Plugins are discovered from the ``titan_primus`` entry-point group (set
``TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD=1`` to turn that off) or registered at run time with
:func:`titan_primus.registry.register`. Implement a hook with the ``hookimpl`` marker::

    # my_backend/plugin.py, declared in pyproject.toml as
    # [project.entry-points.titan_primus] my_backend = "my_backend.plugin"
    from titan_primus.hookspec import hookimpl

    @hookimpl
    def titan_primus_register_backends():
        return [MyBackend()]

A backend is an :class:`titan_primus.backends.base.Fp8Backend`. Routing under ``backend="auto"``
asks every registered backend for its ``rank`` on the device and takes the highest-ranked one that
is available and supports the op and recipe, so a plugin that knows it is better somewhere says so
with a higher rank there (the built-ins rank: primus_turbo 300 on MI300-class, torchao 200 where
there is FP8 hardware, emulated 100 everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .backends.base import Fp8Backend

PROJECT = "titan_primus"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def titan_primus_register_backends() -> Sequence["Fp8Backend"]:
    """Return the FP8 backends this plugin provides.

    Called once when the registry is built (and again after a plugin is registered or
    unregistered at run time). Backend names must be unique across all plugins; a clash is an
    error naming both plugins. Constructing a backend must be cheap and must not import heavy
    optional dependencies: do that lazily in ``availability``.
    """
