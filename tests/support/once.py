"""A costly result (a trainer or ``validate`` run) made once per pytest session and shared by every
xdist worker."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["once_per_session"]

_ONCE: dict[str, Any] = {}


def once_per_session(name: str, make: Callable[[], Any]) -> Any:
    """``make()``'s result (JSON data) run once per pytest session, whichever xdist worker asks
    first: the others wait on a file lock and read it. Also once per worker: a module-scoped
    fixture is set up again when its module's tests reach a worker apart (an ``xdist_group`` keeps
    them on one worker, not next to each other), which ran tests/integrations/torchtitan/v0_2's quick validate twice.
    The result goes through JSON either way (dict keys become strings)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one per session, the same in every worker
    if run is None:
        if name not in _ONCE:
            _ONCE[name] = json.loads(json.dumps(make()))
        return _ONCE[name]
    path = Path(tempfile.gettempdir()) / f"titan-primus-{run}-{name}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(make()))
    return json.loads(path.read_text())
