"""Issue 41: the results files' rows are typed records (titan_primus/diagnostics/records.py), and
docs/json-schema.md's row tables are generated from them: a record changed without the page
fails here, and a producer's row with a key no record declares, or lacking one, is refused."""

import pytest
from support.repo_root import ROOT

from titan_primus.diagnostics.records import SCHEMA_TABLES, BenchRow, GpuPeakRow, schema_page, schema_table

PAGE = ROOT / "docs" / "json-schema.md"


def test_the_schema_page_is_generated_from_the_records():
    text = PAGE.read_text()
    assert schema_page(text) == text, (
        'docs/json-schema.md is stale: python -c "from titan_primus.diagnostics.records import write_schema; '
        "write_schema('docs/json-schema.md')\""
    )
    for name, record in SCHEMA_TABLES.items():
        assert f"records.{name} -->\n{schema_table(record)}\n<!-- end generated -->" in text, name


def test_a_table_edited_by_hand_is_stale():
    text = PAGE.read_text()
    edited = text.replace(
        "| `ms` | number or null | mean milliseconds", "| `ms` | number or null | median milliseconds"
    )
    assert edited != text and schema_page(edited) == text


def test_a_row_with_an_undeclared_or_missing_key_is_refused():
    row = dict(op="linear", case="m255", shape="M=255", backend="emulated", recipe="rowwise", definition=None)
    row.update(status="ok", reason="", flops=1, ms=1.0, tflops=1.0, speedup_vs_bf16=None, fraction_of_peak=None)
    assert BenchRow.from_fields(row).to_json() == row
    with pytest.raises(ValueError, match="BenchRow has no field p99_ms: declare it"):
        BenchRow.from_fields({**row, "p99_ms": 1.0})
    del row["flops"]
    with pytest.raises(ValueError, match="flops"):
        BenchRow.from_fields(row)
    bf16 = {"backend": "bf16", "recipe": None, "status": "ok", "reason": "", "peak_bytes": 10}
    assert GpuPeakRow.from_fields(bf16).to_json() == {**bf16, "vs_bf16": None}
