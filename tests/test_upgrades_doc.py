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
