"""The key ci/cpu.sh keeps its venvs under: a hash of what decides their contents, venvs.mk (every
pin and pip step, its comments left out) and pyproject.toml's build system and dependency tables.
The rest of the Makefile and of pyproject.toml (targets, tests, tool settings) and venvs.mk's
comments change no venv, so a change there keeps them (a rebuild costs a fresh-clone CI about 3
minutes). Run from the checkout's root."""

import hashlib
import json
import sys
import tomllib
from pathlib import Path

INSTALL_TABLES = ("requires-python", "dependencies", "optional-dependencies")


def venv_key(root: Path) -> str:
    project = tomllib.loads((root / "pyproject.toml").read_text())
    installs = {"build-system": project.get("build-system")}
    installs.update({name: project["project"].get(name) for name in INSTALL_TABLES})
    digest = hashlib.sha256(json.dumps(installs, sort_keys=True).encode())
    lines = (root / "venvs.mk").read_bytes().splitlines(keepends=True)
    digest.update(b"".join(line for line in lines if not line.lstrip().startswith(b"#")))
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    print(venv_key(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
