"""The tiny tokenizer and corpus TorchTitan's debug models train on here (``assets/``, made by
examples/make_assets.py): what ``titan-primus validate``, the demo and the tests give the CPU
launchers. Importing this module imports nothing else: it only names the files."""

from pathlib import Path

__all__ = ["ASSETS", "CORPUS", "TOKENIZER"]

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER = ASSETS / "tokenizer"
CORPUS = ASSETS / "corpus"
