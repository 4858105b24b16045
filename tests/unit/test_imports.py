"""The package's import graph, read statically (ast over titan_primus/): no import circle among its
modules, function-level and TYPE_CHECKING imports counted too, and the library never imports its CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import titan_primus

PACKAGE_DIR = Path(titan_primus.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("titan_primus",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The titan_primus modules ``name`` imports anywhere in its file: module level, inside
    functions, under TYPE_CHECKING. ``from pkg import sub`` counts as importing ``pkg.sub``
    where ``sub`` is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_graph_is_read():
    # The reader must see relative, function-level and TYPE_CHECKING imports, or the checks below
    # could pass on an empty graph.
    assert "titan_primus.backends.base" in GRAPH["titan_primus.backends.primus_turbo.rules"]
    assert "titan_primus.torchtitan" in GRAPH["titan_primus"]  # inside __getattr__
    assert "titan_primus.backends.primus_turbo.mx" in GRAPH["titan_primus.backends.primus_turbo"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert _cycles(GRAPH) == []


def test_the_library_never_imports_its_cli():
    offenders = {
        name: sorted(t for t in targets if t == "titan_primus.cli" or t.startswith("titan_primus.cli."))
        for name, targets in GRAPH.items()
        if not (name == "titan_primus.cli" or name.startswith("titan_primus.cli."))
    }
    assert {name: found for name, found in offenders.items() if found} == {}


INTEGRATION = "titan_primus.integrations.torchtitan"


def _external_imports(path: Path) -> set[str]:
    """The top-level packages outside titan_primus that ``path`` imports anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_only_the_torchtitan_integration_imports_torchtitan():
    """Issue 41: one subtree per framework. The public adapter packages (titan_primus.torchtitan,
    titan_primus.torchtitan02, titan_primus.config_registry) re-export it and import no TorchTitan."""
    assert "torchtitan" in _external_imports(MODULES[f"{INTEGRATION}.v0_3.converter"])  # the reader sees them
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if not (name == INTEGRATION or name.startswith(f"{INTEGRATION}.")) and "torchtitan" in _external_imports(path)
    )
    assert offenders == []


def test_no_torchtitan_line_imports_the_other():
    lines = ("v0_2", "v0_3")
    crossings = {
        name: sorted(
            t for t in GRAPH[name] for other in lines if other != line and t.startswith(f"{INTEGRATION}.{other}")
        )
        for line in lines
        for name in MODULES
        if name.startswith(f"{INTEGRATION}.{line}")
    }
    assert {name: found for name, found in crossings.items() if found} == {}


BACKEND_NAMES = {"emulated", "torchao", "primus_turbo"}


def _backend_name_comparisons(path: Path) -> list[str]:
    """``x == "torchao"``, ``x in ("emulated", ...)`` and the like in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = [o for o in operands if isinstance(o, ast.Constant)]
        constants += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
        if any(isinstance(c, ast.Constant) and c.value in BACKEND_NAMES for c in constants):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_backend_name_is_compared_outside_backends():
    """Issue 41: what a backend can do is asked of it (capabilities), never read from its name."""
    backends = [p for name, p in MODULES.items() if name.startswith("titan_primus.backends.")]
    assert any(_backend_name_comparisons(p) for p in backends)  # the reader sees them where they belong
    outside = [
        hit
        for name, path in MODULES.items()
        if not name.startswith("titan_primus.backends.")
        for hit in _backend_name_comparisons(path)
    ]
    assert outside == []
