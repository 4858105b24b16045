"""Running TorchTitan's real trainer on a machine without an accelerator: what ``titan-primus
validate`` needs on a CPU, the demo and the tests use, and a pip install ships.

- ``launch.py``: TorchTitan 0.3's trainer on a CPU (and TorchTitan main of 2026-08-21);
  ``launch02.py``: TorchTitan 0.2.x's. Each is run as a script, or imported before anything
  from torchtitan (it patches TorchTitan's device choice when first imported).
- ``world.py``: what both set up first (offline Hugging Face, a single-process world, a CPU
  stand-in for torch.cuda's memory calls).
- ``assets/``: the tiny tokenizer and corpus the debug models train on (examples/make_assets.py
  makes them).

Importing this package imports nothing else: it only names the files.
"""

from pathlib import Path

__all__ = ["ASSETS", "CORPUS", "LAUNCHER", "LAUNCHER_02", "TOKENIZER"]

_HERE = Path(__file__).resolve().parent
LAUNCHER = _HERE / "launch.py"
LAUNCHER_02 = _HERE / "launch02.py"
ASSETS = _HERE / "assets"
TOKENIZER = ASSETS / "tokenizer"
CORPUS = ASSETS / "corpus"
