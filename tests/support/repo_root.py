"""The clone the test suites run from, where they find its files (examples/, ci/, docs/,
pyproject.toml): every test session imports ``ROOT`` from here."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
"""Where ``support`` and ``real_turbo`` import from: a subprocess's PYTHONPATH entry for them."""
