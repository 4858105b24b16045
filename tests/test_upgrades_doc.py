"""docs/upgrades.md's table of upstream symbols is the one the code declares and checks
(titan_primus/diagnostics/contracts.py): a declaration changed without the page fails here."""

from repo_root import ROOT

from titan_primus.diagnostics.contracts import BEGIN, END, contracts, generated_section


def test_the_upgrades_page_lists_every_declared_symbol_as_the_code_declares_it():
    text = (ROOT / "docs" / "upgrades.md").read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == generated_section(), (
        'docs/upgrades.md is stale: python -c "from titan_primus.diagnostics.contracts import write_table; '
        "write_table('docs/upgrades.md')\""
    )
    symbols = {c.symbol for c in contracts()}
    # Every Primus-Turbo op the backend calls by name, and TorchAO's linear and grouped symbols.
    assert {"gemm_fp8_impl", "attention_triton_backward_impl", "attention_aiter_varlen_forward_impl"} <= symbols
    assert "torchao.float8.float8_ops.float8_mm" in symbols
    assert any("_to_fp8_rowwise_then_scaled_grouped_mm" in s for s in symbols)
