"""An adapter that cannot be imported says why, by its real cause, and how to fix it.

Runs under either TorchTitan line (``make test`` on 0.3, ``make test-tt02`` on 0.2.x), in
a separate interpreter, with a module made unimportable where a case needs one missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.lines import installed_line

LINE = installed_line()
TORCHTITAN, THIS, EXTRA, OTHER = LINE.torchtitan, LINE.adapter, LINE.extra, LINE.other_adapter

# One interpreter for every case (importing torch and TorchTitan dominates): the cases run from the
# one that imports least of TorchTitan to the one that imports most, and TorchTitan's modules are
# dropped between them so each case imports afresh.
_IMPORTS = """
import json, sys

class Missing:
    name = None

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == self.name:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

missing = Missing()
sys.meta_path.insert(0, missing)
messages = []
for module, missing.name in json.loads(sys.argv[1]):
    # An earlier case may have imported the module now made missing (torch imports triton when
    # it can): hide it for this case, as a fresh interpreter would not have it, then put it back.
    hidden = {n: sys.modules.pop(n) for n in [n for n in sys.modules if n.split(".")[0] == missing.name]}
    try:
        __import__(module)
        messages.append(None)
    except ImportError as e:
        messages.append(str(e))
    for name in [n for n in sys.modules if n.startswith(("torchtitan", "titan_primus.torchtitan"))]:
        del sys.modules[name]
    sys.modules.update(hidden)
print(json.dumps(messages))
"""
CASES = [(THIS, "torchtitan"), (THIS, "triton"), (OTHER, None)]


@pytest.fixture(scope="module")
def messages() -> dict[tuple[str, str | None], str | None]:
    """What importing each adapter raises, with a module made missing."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS, json.dumps(CASES)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return dict(zip(CASES, json.loads(done.stdout.splitlines()[-1])))


def test_the_other_lines_adapter_names_the_installed_line_and_what_to_use(messages):
    message = messages[OTHER, None]
    assert "is the adapter for TorchTitan" in message and f"the installed TorchTitan ({TORCHTITAN}) does not" in message
    assert ("titan_primus.torchtitan02" if LINE.name == "0.2" else "--module titan_primus") in message


def test_a_missing_triton_is_named_as_the_cause_not_the_torchtitan_line(messages):
    """TorchTitan imports triton at import; a CPU-only torch wheel brings none."""
    message = messages[THIS, "triton"]
    assert f"importing TorchTitan {TORCHTITAN} failed inside it, in torchtitan/" in message, message
    assert (
        "ModuleNotFoundError: No module named 'triton'" in message
        and "Fix:" in message
        and "triton" in message.split("Fix:")[1]
    )
    assert "does not" not in message


def test_a_missing_torchtitan_says_which_extra_to_install(messages):
    message = messages[THIS, "torchtitan"]
    assert message.endswith(f"which is not installed: pip install 'titan-primus[{EXTRA}]'"), message


# What each adapter imports from TorchTitan first-hand (TorchTitan's own modules do not), and its
# line module's own symbol: (module, symbol, titan-primus's file that imports it).
_FIRST_HAND = {
    "0.3": [
        (
            "torchtitan.components.quantization.utils",
            "swap_token_dispatcher",
            "titan_primus/integrations/torchtitan/v0_3/converter.py",
        ),
        (
            "torchtitan.protocols.model",
            "ModelConfigConverter",
            "titan_primus/integrations/torchtitan/v0_3/converter.py",
        ),
    ],
    "0.2": [
        ("torchtitan.models.moe.moe", "GroupedExperts", "titan_primus/integrations/torchtitan/v0_2/converter.py"),
        (
            "torchtitan.protocols.model_converter",
            "register_model_converter",
            "titan_primus/integrations/torchtitan/v0_2/converter.py",
        ),
    ],
}
_MOVED = """
import importlib, json, sys

messages = []
for owner, symbol, _ in json.loads(sys.argv[2]):
    delattr(importlib.import_module(owner), symbol)  # as a TorchTitan that moved or renamed it
    try:
        importlib.import_module(sys.argv[1])
        messages.append(None)
    except ImportError as e:
        messages.append(str(e))
    for name in [n for n in sys.modules if n.startswith(("torchtitan", "titan_primus.torchtitan"))]:
        del sys.modules[name]
print(json.dumps(messages))
"""


def test_a_symbol_torchtitan_moved_is_named_with_titan_primus_file_and_the_verified_release():
    """Issue 42: a TorchTitan of the adapter's own line without a symbol the adapter imports read as
    a broken install ("install (or repair) the distribution that provides the module 'torchtitan'"),
    or as the other line, and titan-primus's file was named as TorchTitan's ("torchtitan/converter.py")."""
    cases = _FIRST_HAND[LINE.name]
    done = subprocess.run(
        [sys.executable, "-c", _MOVED, THIS, json.dumps(cases)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    for (owner, symbol, where), message in zip(cases, json.loads(done.stdout.splitlines()[-1])):
        assert (
            message and f"TorchTitan {TORCHTITAN} lacks what titan-primus imports from it, in {where}, line" in message
        )
        assert (
            f"cannot import name '{symbol}' from '{owner}'" in message
            and "this TorchTitan moved or renamed it" in message
        )
        assert "repair" not in message and "does not" not in message, message


_STAND_IN = """
import json, sys
from titan_primus.cli.doctor import render
from titan_primus.diagnostics.environment import diagnose
try:
    import titan_primus.torchtitan
    error = None
except ImportError as e:
    error = str(e)
(row,) = [line for line in render(diagnose()).splitlines() if line.startswith("| torchtitan")]
print(json.dumps({"import_error": error, "doctor": row}))
"""


@pytest.mark.parametrize("version, layout", [("0.4.0", False), ("0.4.0.dev20260821", True)])
def test_a_torchtitan_04_without_the_03_layout_is_refused_in_one_line(tmp_path, version, layout):
    """A stand-in TorchTitan (a package and its metadata, first on the path) of the 0.4 line: without
    0.3's torchtitan.components.quantization (as 0.4.0) the adapter and doctor refuse it by name;
    with it (TorchTitan main of 2026-08-21, the canary's) neither does."""
    package = tmp_path / "torchtitan"
    (package / "components" / "quantization" if layout else package).mkdir(parents=True)
    (package / "__init__.py").write_text("")
    info = tmp_path / f"torchtitan-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchtitan\nVersion: {version}\n")
    done = subprocess.run(
        [sys.executable, "-c", _STAND_IN],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    refusal = (
        f"TorchTitan {version} is not yet supported: titan-primus has adapters for TorchTitan 0.3 and 0.2.x only "
        "(0.4 moved the seams they use, docs/torchtitan04.md); pin TorchTitan 0.3: pip install 'torchtitan>=0.3,<0.4'"
    )
    if layout:
        assert "not yet supported" not in found["import_error"] + found["doctor"], found
    else:
        assert found["import_error"] == refusal and f"| {version}; {refusal}" in found["doctor"], found
