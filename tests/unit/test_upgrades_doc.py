"""docs/upgrades.md's table of upstream symbols is the one the code declares and checks
(titan_primus/diagnostics/contracts.py): a declaration changed without the page fails here."""

from support.repo_root import ROOT

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


def test_every_private_torch_name_and_torchtitan_import_of_this_line_is_there():
    """The table's torch rows are read from the package's syntax trees (every attribute chain or
    import through torch with a private part), its TorchTitan rows from each line's imports: each
    resolves in the installed torch and, for the installed line, TorchTitan (but for the imports
    the line probes first: TorchTitan main's Grain loader)."""
    from titan_primus.diagnostics.contracts import private_uses, resolve, torchtitan_imports
    from titan_primus.integrations.torchtitan import installed_line

    private = private_uses()
    assert {"torch._grouped_mm", "torch.ops.aten._to_copy.default", "torch.utils._pytree.tree_map_only"} <= set(private)
    assert not any(a.startswith(f"{b}.") for a in private for b in private)  # the longest names only
    imports = torchtitan_imports(installed_line()[1])
    assert "torchtitan.models.common.moe.GroupedExperts" in imports
    required = [name for name, (_, optional) in imports.items() if not optional]
    missing = []
    for name in [*private, *required]:
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing


def test_doctor_checks_every_contract_against_what_is_installed_and_names_one_that_differs(monkeypatch):
    """Issue 42: ``titan-primus doctor`` checks the whole table against the installed packages:
    here every TorchAO, torch and TorchTitan 0.3 row is there (the 0.2.x line's rows are another
    line's; Primus-Turbo is not loaded on a CPU); with a TorchAO symbol renamed away that row differs,
    named with what was found, the file that uses it and the verified release, and doctor still
    exits 0."""
    import contextlib
    import io
    from collections import Counter

    import torchao.float8.float8_ops as float8_ops

    from titan_primus import cli, registry
    from titan_primus.diagnostics.contracts import contract_states

    states = contract_states()
    assert len(states) == len(contracts())
    by_upstream = {
        upstream: Counter(s["state"] for s in states if s["upstream"] == upstream)
        for upstream in ("Primus-Turbo", "TorchAO", "TorchTitan", "torch")
    }
    assert set(by_upstream["Primus-Turbo"]) == {"not loaded here"}, by_upstream
    assert set(by_upstream["TorchAO"]) == {"ok"} and by_upstream["torch"]["differs"] == 0, by_upstream
    assert {s["state"] for s in states if s["line"] == "v0_2"} == {"other line"}
    assert {s["state"] for s in states if s["line"] == "v0_3"} <= {"ok", "absent (optional)"}

    monkeypatch.delattr(float8_ops, "float8_mm")
    registry.refresh()
    (renamed,) = [s for s in contract_states() if s["state"] == "differs"]
    assert renamed["symbol"] == "torchao.float8.float8_ops.float8_mm" and "float8_mm" in renamed["found"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["doctor"]) == 0
    assert "1 differs" in out.getvalue() and "titan_primus/backends/torchao/linear.py" in out.getvalue()
