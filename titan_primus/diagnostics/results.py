"""The results file every diagnostic writes and ``titan-primus report`` reads (docs/json-schema.md):
one JSON object, ``schema_version``, ``kind`` ("parity", "bench", "memory" for ``bench --memory``,
"validate"), ``environment`` (:func:`titan_primus.diagnostics.environment.environment`),
``settings``, ``results`` (a list of rows) and ``summary``. SQNR values that are not finite are
written as the strings "inf" (bitwise equal) and "-inf" (non-finite output), so every file is
strict JSON. The rows are written through the typed records of :mod:`.records`. Loading checks the
schema: any problem is one :class:`ResultsFileError`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .records import ResultRow, ValidateResult

__all__ = [
    "SCHEMA_VERSION",
    "ResultsFileError",
    "db_value",
    "document",
    "format_db",
    "load_document",
    "parse_db",
    "prepare_output",
    "write_document",
]


class ResultsFileError(ValueError):
    """A results file is missing, unreadable, or not in the documented schema."""


def prepare_output(path: str | None) -> None:
    """Create the parent folder of an output file up front, so a long run cannot end in a failed write."""
    if path:
        Path(path).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)


SCHEMA_VERSION = 1
RESULT_KINDS = ("parity", "bench", "memory", "validate")
_TOP_LEVEL_KEYS = ("schema_version", "kind", "environment", "settings", "results", "summary")


def document(kind: str, environment: dict, settings: dict, results: list[dict], summary: dict) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "environment": environment,
        "settings": settings,
        "results": results,
        "summary": summary,
    }


def write_document(path: str, doc: dict) -> None:
    prepare_output(path)
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")


def load_document(path: str) -> dict:
    """Read and check a results file; any problem is one ResultsFileError naming the file."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ResultsFileError(f"{path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise ResultsFileError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    missing = [key for key in _TOP_LEVEL_KEYS if key not in doc]
    if missing:
        raise ResultsFileError(f"{path}: not a titan-primus results file (missing {', '.join(missing)})")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ResultsFileError(
            f"{path}: schema_version {doc['schema_version']!r}; this titan-primus reads version {SCHEMA_VERSION}"
        )
    if doc["kind"] not in RESULT_KINDS:
        raise ResultsFileError(f"{path}: kind {doc['kind']!r} is not one of {', '.join(RESULT_KINDS)}")
    if doc["kind"] == "validate":  # one result per config, its runs and verdicts (validate.py)
        _check_validate_results(path, doc["results"])
        return doc
    for i, row in enumerate(doc["results"]):
        absent = [key for key in ResultRow.REQUIRED if key not in row]
        if absent:
            raise ResultsFileError(f"{path}: results[{i}] lacks {', '.join(absent)}")
    return doc


def _check_validate_results(path: str, results: list) -> None:
    for i, result in enumerate(results):
        absent = [key for key in ValidateResult.REQUIRED if key not in result]
        if absent:
            raise ResultsFileError(f"{path}: results[{i}] lacks {', '.join(absent)}")
        for role, run in result["runs"].items():
            if "steps" not in run:
                raise ResultsFileError(f"{path}: results[{i}].runs.{role} lacks steps")


def db_value(x: float) -> float | str:
    """An SQNR for JSON: a number, or "inf"/"-inf"."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def parse_db(v: float | str) -> float:
    return float(v)


def format_db(v: float | str | None) -> str:
    if v is None:
        return "-"
    x = parse_db(v)
    return f"{x:.1f}" if math.isfinite(x) else ("inf" if x > 0 else "-inf")
