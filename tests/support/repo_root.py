"""The clone the test suites run from, where they find its files (examples/, ci/, docs/,
pyproject.toml): tests/ and tests_tt02/ import ``ROOT`` from here (tests_tt02/conftest.py, which
puts tests/ on the path, finds it by itself)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
