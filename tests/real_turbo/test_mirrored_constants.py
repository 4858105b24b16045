"""Every constant rules.py mirrors from Primus-Turbo (``rules.MIRRORED``), re-read from the sources
of the build under test: the value its files state, and where a value is computed upstream (a
BLOCK_K chosen in a function), the statements it rests on. Text and syntax trees only: no kernel
runs here (test_rules.py runs them at the same edges)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from real_turbo.conftest import BUILD, TURBO
from titan_primus.backends.primus_turbo import load_api, rules
from titan_primus.backends.primus_turbo.api import VERIFIED_BUILDS

SOURCES = Path(TURBO.__file__).parents[1] if TURBO else None  # the build's primus_turbo/
RECIPES = {"tensorwise": "TENSORWISE", "rowwise": "ROWWISE", "blockwise": "BLOCKWISE"}
DENSE_KERNEL = "triton/gemm/gemm_fp8_kernel.py"
GROUPED_KERNEL = "triton/grouped_gemm/grouped_gemm_fp8_kernel.py"
# The persistent kernels the FP8 GEMMs launch over a contraction known at conversion.
ASSUMING = {
    DENSE_KERNEL: {"_fp8_persistent_gemm_kernel", "_fp8_rowwise_persistent_gemm_kernel"},
    GROUPED_KERNEL: {
        "_grouped_fp8_persistent_gemm_kernel",
        "_grouped_fp8_rowwise_persistent_gemm_kernel",
        "_grouped_blockwise_fp8_persistent_gemm_kernel",
    },
}
ASSUME = "tl.assume(loop_k > 1)"
LOOP_K = "loop_k = tl.cdiv(K, BLOCK_SIZE_K)"
EXEMPT = re.compile("variable_k|mxfp8")  # kernels that state no assume: the rules ask no minimum of them
BLOCK_K_NAMES = {"BK", "blk_k", "block_k"}

Read = Callable[[str], str]  # a path under primus_turbo/ -> its text


class Missing(Exception):
    """A statement a constant rests on is gone: (file, what the file says instead, what to re-check)."""


def _read_build(path: str) -> str:
    return (SOURCES / path).read_text()


def _tree(read: Read, path: str) -> ast.Module:
    return ast.parse(read(path))


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}


def _class(tree: ast.AST, name: str) -> ast.ClassDef | None:
    return next((c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == name), None)


def _statements(node: ast.AST) -> set[str]:
    return {ast.unparse(s) for s in ast.walk(node) if isinstance(s, ast.stmt) and not isinstance(s, ast.If)}


def _moduli(node: ast.AST, var: str) -> set[int]:
    """N of every ``var % N == 0`` under ``node``."""
    return {
        c.left.right.value
        for c in ast.walk(node)
        if isinstance(c, ast.Compare)
        and isinstance(c.left, ast.BinOp)
        and isinstance(c.left.op, ast.Mod)
        and ast.unparse(c.left.left) == var
        and isinstance(c.left.right, ast.Constant)
        and ast.unparse(c.comparators[0]) == "0"
    }


def _one(values: set):
    """The value a file states once, None where it states none, else all it states (a mismatch)."""
    return next(iter(values)) if len(values) == 1 else (tuple(sorted(values)) or None)


def _ints(node: ast.expr, index: int | None = None) -> set[int] | None:
    """The int literals ``node`` (its ``index``-th element, for a tuple) can be, or None."""
    if isinstance(node, ast.IfExp):
        body, orelse = _ints(node.body, index), _ints(node.orelse, index)
        return None if body is None or orelse is None else body | orelse
    if index is not None and isinstance(node, ast.Tuple):
        return _ints(node.elts[index])
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return {node.value}
    return None


def _block_k(tree: ast.AST) -> tuple[set[int], list[ast.Assign]]:
    """The literals a BLOCK_K variable (or a ``"BLOCK_SIZE_K"`` config entry) is given, and the
    assignments that give it something else than a literal or a selection function's result."""
    literals, other = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            literals |= {
                v.value
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and k.value == "BLOCK_SIZE_K" and isinstance(v, ast.Constant)
            }
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            for i, name in enumerate(names):
                if not (isinstance(name, ast.Name) and name.id in BLOCK_K_NAMES) or isinstance(node.value, ast.Call):
                    continue
                found = _ints(node.value, i if isinstance(target, ast.Tuple) else None)
                if found is None:
                    other.append(node)
                else:
                    literals |= found
    return literals, other


def _assumes(read: Read, path: str) -> ast.Module:
    """The file's tree, once every kernel in ASSUMING[path] states ``loop_k = K // BLOCK_K`` and
    ``tl.assume(loop_k > 1)``."""
    tree = _tree(read, path)
    kernels = _functions(tree)
    for name in sorted(ASSUMING[path]):
        body = _statements(kernels[name]) if name in kernels else set()
        for statement in (LOOP_K, ASSUME):
            if statement not in body:
                raise Missing(
                    path, f"{name} does not state {statement!r}", "which kernels the FP8 GEMMs launch, and their loop"
                )
    return tree


def _dispatch(read: Read, path: str, function: str) -> dict[str, str]:
    """Granularity -> the autograd Function ``function`` (gemm_fp8, grouped_gemm_fp8) applies."""
    dispatcher = _functions(_tree(read, path)).get(function)
    if dispatcher is None:
        raise Missing(path, f"there is no def {function}", "the public op's name")
    routes = {}
    for node in ast.walk(dispatcher):
        test = node.test if isinstance(node, ast.If) else None
        if not (isinstance(test, ast.Compare) and ast.unparse(test.left) == "config.granularity"):
            continue
        granularity = ast.unparse(test.comparators[0]).removeprefix("ScalingGranularity.")
        for call in (c for statement in node.body for c in ast.walk(statement) if isinstance(c, ast.Call)):
            if isinstance(call.func, ast.Attribute) and call.func.attr == "apply":
                routes[granularity] = ast.unparse(call.func.value)
    return routes


def _defaults(read: Read, path: str, function: str) -> dict[str, object]:
    """Recipe -> the ``default_backend=BackendType.X.value`` its autograd Function passes
    (all of them, sorted, where it passes several)."""
    tree, routes, found = _tree(read, path), _dispatch(read, path, function), {}
    for recipe, granularity in RECIPES.items():
        cls = _class(tree, routes.get(granularity, ""))
        if cls is None:
            raise Missing(path, f"{function} applies no autograd Function for {granularity}", "its dispatch")
        backends = {
            name
            for k in ast.walk(cls)
            if isinstance(k, ast.keyword) and k.arg == "default_backend"
            for name in re.findall(r"BackendType\.(\w+)\.value", ast.unparse(k.value))
        }
        found[recipe] = _one(backends)
    return found


def _mx_classes(tree: ast.AST) -> list[ast.FunctionDef]:
    """can_handle of every backend class whose SUPPORTED_GRANULARITIES holds MX_BLOCKWISE."""
    handlers = []
    for cls in (c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)):
        granularities = [
            s for s in cls.body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "SUPPORTED_GRANULARITIES"
        ]
        if granularities and "MX_BLOCKWISE" in ast.unparse(granularities[0].value):
            handlers += [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "can_handle"]
    return handlers


def read_alignment(read: Read):
    handlers = _mx_classes(_tree(read, rules.MIRRORED["ALIGNMENT"].files[0]))
    return _one({n for f in handlers for var in ("m", "n") for n in _moduli(f, var)})


def read_mx_k_alignment(read: Read):
    return _one(
        {n for f in _mx_classes(_tree(read, rules.MIRRORED["MX_K_ALIGNMENT"].files[0])) for n in _moduli(f, "k")}
    )


def read_ck_alignment(read: Read):
    """k % N == 0 under ``if not trans_lhs:`` in GEMMFP8CKBackend.can_handle (its BLOCKWISE if aside)."""
    cls = _class(_tree(read, rules.MIRRORED["CK_ALIGNMENT"].files[0]), "GEMMFP8CKBackend")
    tests = (
        [n for n in ast.walk(cls) if isinstance(n, ast.If) and ast.unparse(n.test) == "not trans_lhs"] if cls else []
    )
    return _one({n for t in tests for s in t.body if not isinstance(s, ast.If) for n in _moduli(s, "k")})


def read_triton_min_contraction(read: Read):
    """Two BLOCK_K steps of the largest BLOCK_K literal, per kernel file (origami's aside)."""
    minima = set()
    for path in rules.MIRRORED["TRITON_MIN_CONTRACTION"].files:
        tree = _assumes(read, path)
        exempt = [f for name, f in _functions(tree).items() if EXEMPT.search(name) and ASSUME in _statements(f)]
        if exempt:
            raise Missing(
                path,
                f"{exempt[0].name} states {ASSUME!r}",
                "the grouped wgrad's rows (min_token_rows pads the linear's only) and mxfp8's grouped rule",
            )
        literals, other = _block_k(tree)
        if path == rules.MIRRORED["TRITON_MIN_CONTRACTION_ORIGAMI"].files[0]:
            other = [a for a in other if not _takes_origami(a)]  # TRITON_MIN_CONTRACTION_ORIGAMI's
        if other or not literals:
            statement = repr(ast.unparse(other[0])) if other else "no literal"
            raise Missing(path, f"BLOCK_K is set from {statement}", "how BLOCK_K is chosen")
        minima.add(2 * max(literals))
    return _one(minima)


def _takes_origami(assignment: ast.Assign) -> bool:
    return re.search(r"\bok\b", ast.unparse(assignment.value)) is not None


def _in_gfx950(tree: ast.AST) -> set[int]:
    """Line numbers of every statement inside an ``if is_gfx950():`` body."""
    return {
        s.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "is_gfx950()"
        for b in n.body
        for s in ast.walk(b)
        if isinstance(s, ast.stmt)
    }


def read_triton_min_contraction_origami(read: Read):
    """Two BLOCK_K steps of origami's largest, once the grouped configs take its BLOCK_K, on gfx950 only."""
    kernel, origami = rules.MIRRORED["TRITON_MIN_CONTRACTION_ORIGAMI"].files
    tree = _assumes(read, kernel)
    taken = [a for a in _block_k(tree)[1] if _takes_origami(a)]
    if not taken or {a.lineno for a in taken} - _in_gfx950(tree):
        raise Missing(
            kernel, "origami's BLOCK_K (blk_k = ok) is taken outside 'if is_gfx950():', or nowhere", "where it is taken"
        )
    select = _functions(_tree(read, origami)).get("origama_select_params")
    ranges = select and [
        a.value for a in ast.walk(select) if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == "block_k_range"
    ]
    if not ranges:
        raise Missing(origami, "origama_select_params sets no block_k_range", "origami's BLOCK_K proposals")
    return 2 * max(_ints(e).pop() for e in ranges[0].elts)


def read_blockwise_size(read: Read):
    tree = _tree(read, rules.MIRRORED["BLOCKWISE_SIZE"].files[0])
    asserted = [
        a.test.comparators[0]
        for a in ast.walk(tree)
        if isinstance(a, ast.Assert)
        and isinstance(a.test, ast.Compare)
        and ast.unparse(a.test.left) == "config.block_size"
        and isinstance(a.test.ops[0], ast.In)
        and isinstance(a.test.comparators[0], ast.List)
    ]
    return _one({ast.literal_eval(e) for c in asserted for e in c.elts})


def read_mx_min_surface(read: Read):
    """Whether this build's grouped_gemm_fp8 dispatches MX_BLOCKWISE."""
    return "MX_BLOCKWISE" in _dispatch(read, rules.MIRRORED["MX_MIN_SURFACE"].files[0], "grouped_gemm_fp8")


def read_dense_default(read: Read):
    return _defaults(read, rules.MIRRORED["_DENSE_DEFAULT"].files[0], "gemm_fp8")


def read_grouped_default(read: Read):
    return _defaults(read, rules.MIRRORED["_GROUPED_DEFAULT"].files[0], "grouped_gemm_fp8")


# name -> (what the build's files state, what rules says of this build)
CHECKS: dict[str, tuple[Callable[[Read], object], Callable[[], object]]] = {
    "ALIGNMENT": (read_alignment, lambda: rules.ALIGNMENT),
    "CK_ALIGNMENT": (read_ck_alignment, lambda: rules.CK_ALIGNMENT),
    "TRITON_MIN_CONTRACTION": (read_triton_min_contraction, lambda: rules.TRITON_MIN_CONTRACTION),
    "TRITON_MIN_CONTRACTION_ORIGAMI": (
        read_triton_min_contraction_origami,
        lambda: rules.TRITON_MIN_CONTRACTION_ORIGAMI,
    ),
    "BLOCKWISE_SIZE": (read_blockwise_size, lambda: rules.BLOCKWISE_SIZE),
    "MX_K_ALIGNMENT": (read_mx_k_alignment, lambda: rules.MX_K_ALIGNMENT),
    "MX_MIN_SURFACE": (read_mx_min_surface, lambda: load_api().at_least(rules.MX_MIN_SURFACE)),
    "_DENSE_DEFAULT": (read_dense_default, lambda: {r: rules.dense_backend(load_api(), r) for r in RECIPES}),
    "_GROUPED_DEFAULT": (read_grouped_default, lambda: dict.fromkeys(RECIPES, rules._GROUPED_DEFAULT)),
}


def problem(name: str, read: Read = _read_build) -> str | None:
    """Why ``rules.<name>`` does not match what the build's files state, or None."""
    entry = rules.MIRRORED[name]
    where = f"primus_turbo/{' and '.join(entry.files)} at Primus-Turbo {BUILD}"
    reader, expected = CHECKS[name]
    try:
        stated = reader(read)
    except Missing as e:
        path, instead, recheck = e.args
        return (
            f"rules.{name} ({entry.what}): at Primus-Turbo {BUILD}, in primus_turbo/{path}, {instead}: "
            f"re-check {recheck}"
        )
    if stated is None and BUILD in entry.builds:
        return (
            f"{where} does not state rules.{name} ({entry.what}), yet MIRRORED[{name!r}].builds holds {BUILD}: "
            f"find where it moved"
        )
    if stated is not None and BUILD not in entry.builds:
        return (
            f"{where} states {stated!r} for rules.{name} ({entry.what}), yet MIRRORED[{name!r}].builds lacks "
            f"{BUILD}: check the value and add the build"
        )
    if stated is not None and stated != expected():
        return (
            f"rules.{name} means {expected()!r} at {BUILD}, but reading {where} gives {stated!r} "
            f"({entry.what}): re-read it and update rules.{name}, MIRRORED[{name!r}] and the refusals that use it"
        )
    return None


def test_every_mirrored_constant_is_checked_and_read_at_verified_builds():
    assert set(CHECKS) == set(rules.MIRRORED)
    for name, entry in rules.MIRRORED.items():
        assert hasattr(rules, name) and set(entry.builds) <= set(VERIFIED_BUILDS), name


@pytest.mark.parametrize("name", sorted(rules.MIRRORED))
def test_mirrored_constant_matches_this_build(name):
    why = problem(name)
    assert why is None, why


# A statement of each constant's file changed as an upgrade might change it: the check fails. An edit
# whose text a build lacks is skipped there; every constant has one that applies at every build.
V031_CK = "# TODO: check shape"  # upstream's own text: v0.3.1's GEMMFP8CKBackend.can_handle checks no shape
V031_GROUPED_BLOCKWISE = "elif config.granularity == ScalingGranularity.BLOCKWISE:\n        # BLOCKWISE only accepts"
V031_GROUPED_MX = (
    "elif config.granularity == ScalingGranularity.MX_BLOCKWISE:\n        return FP8GroupedGemmMXFunc.apply()\n    "
)
EDITS = [
    ("ALIGNMENT", "pytorch/kernels/gemm/gemm_fp8_impl.py", "n % 16 == 0", "n % 32 == 0"),
    ("CK_ALIGNMENT", "pytorch/kernels/gemm/gemm_fp8_impl.py", "supported &= k % 32 == 0", "supported &= k % 64 == 0"),
    ("CK_ALIGNMENT", "pytorch/kernels/gemm/gemm_fp8_impl.py", "supported &= k % 32 == 0", "pass"),
    ("CK_ALIGNMENT", "pytorch/kernels/gemm/gemm_fp8_impl.py", V031_CK, "if not trans_lhs: supported &= k % 32 == 0"),
    ("TRITON_MIN_CONTRACTION", DENSE_KERNEL, "BK = 128 if is_tn else 64", "BK = 256 if is_tn else 64"),
    ("TRITON_MIN_CONTRACTION", DENSE_KERNEL, "block_k = 256, 256, 128", "block_k = 256, 256, ok"),
    ("TRITON_MIN_CONTRACTION", DENSE_KERNEL, ASSUME, "tl.assume(loop_k > 0)"),
    (
        "TRITON_MIN_CONTRACTION",
        GROUPED_KERNEL,
        "loop_k = M_g // BLOCK_SIZE_K",
        f"loop_k = M_g // BLOCK_SIZE_K; {ASSUME}",
    ),
    ("TRITON_MIN_CONTRACTION_ORIGAMI", "triton/utils/origami.py", "[64, 128, 256]", "[64, 128, 256, 512]"),
    ("TRITON_MIN_CONTRACTION_ORIGAMI", GROUPED_KERNEL, "if is_gfx950():", "if is_gfx942():"),
    ("BLOCKWISE_SIZE", "pytorch/ops/grouped_gemm_fp8.py", "block_size in [128]", "block_size in [64]"),
    ("MX_K_ALIGNMENT", "pytorch/kernels/gemm/gemm_fp8_impl.py", "k % 128 == 0", "k % 256 == 0"),
    ("MX_MIN_SURFACE", "pytorch/ops/grouped_gemm_fp8.py", "== ScalingGranularity.MX_BLOCKWISE:", "== MX:"),
    (
        "MX_MIN_SURFACE",
        "pytorch/ops/grouped_gemm_fp8.py",
        V031_GROUPED_BLOCKWISE,
        V031_GROUPED_MX + V031_GROUPED_BLOCKWISE,
    ),
    ("_DENSE_DEFAULT", "pytorch/ops/gemm_fp8.py", "BackendType.HIPBLASLT.value", "BackendType.TRITON.value"),
    ("_GROUPED_DEFAULT", "pytorch/ops/grouped_gemm_fp8.py", "BackendType.TRITON.value", "BackendType.CK.value"),
]


@pytest.mark.parametrize(("name", "path", "old", "new"), EDITS, ids=[f"{e[0]}-{i}" for i, e in enumerate(EDITS)])
def test_mirrored_check_fails_on_an_edited_source(name, path, old, new):
    text = _read_build(path)
    if old not in text:
        pytest.skip(f"{old!r} is not in primus_turbo/{path} at {BUILD}")

    def edited(p: str) -> str:
        return text.replace(old, new) if p == path else _read_build(p)

    assert problem(name) is None
    why = problem(name, edited)
    assert why is not None and f"rules.{name}" in why, why
