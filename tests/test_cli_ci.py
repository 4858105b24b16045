"""Lint of the CI workflows in ci/: valid YAML, and every titan-primus subcommand and flag, make
target and pytest marker they call exists."""

import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from titan_primus.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / "ci").glob("*.yml"))
# Shell operators that end one command and start the next (or a redirection target).
_SEPARATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>"}


def run_scripts(workflow: dict) -> list[str]:
    return [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]


def commands(script: str) -> list[list[str]]:
    """Each simple command of a shell script as argv, environment assignments dropped."""
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in [*lexer, ";"]:
            if token in _SEPARATORS:
                if current:
                    found.append(current)
                current = []
            elif current or "=" not in token:
                current.append(token)
    return found


def make_targets() -> set[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    rules = [line for line in lines if line[:1] not in ("", "#", "\t", " ") and ":" in line and "=" not in line]
    return {line.split(":")[0] for line in rules}


def pytest_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def pytest_marker_expression(argv: list[str]) -> str | None:
    """The -m expression of a pytest command (``python -m pytest -m EXPR``), if any."""
    if "pytest" not in argv:
        return None
    options = argv[argv.index("pytest") + 1:]
    return options[options.index("-m") + 1] if "-m" in options else None


def marker_names(expression: str) -> set[str]:
    return {word for word in expression.replace("(", " ").replace(")", " ").split() if word not in ("and", "or", "not")}


def test_the_three_workflows_exist():
    assert [p.name for p in WORKFLOWS] == ["cpu.yml", "cuda.yml", "mi300x.yml"]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_calls_only_what_exists(path):
    workflow = yaml.safe_load(path.read_text())
    assert workflow["jobs"], "no jobs"
    parser = build_parser()
    for script in run_scripts(workflow):
        for argv in commands(script):
            program = Path(argv[0]).name
            if program == "titan-primus":
                try:
                    parser.parse_args(argv[1:])
                except SystemExit:
                    pytest.fail(f"{path.name}: titan-primus does not accept {shlex.join(argv[1:])!r}")
            elif program == "make":
                assert set(argv[1:]) <= make_targets(), f"{path.name}: unknown make target in {argv}"
            expression = pytest_marker_expression(argv)
            if expression is not None:
                assert marker_names(expression) <= pytest_markers(), f"{path.name}: unknown marker in {expression!r}"


@pytest.mark.parametrize("name, required, marker", [("mi300x.yml", "primus_turbo", "mi300"), ("cuda.yml", "torchao", "cuda")])
def test_gpu_workflows_require_their_backend_and_keep_the_json(name, required, marker):
    workflow = yaml.safe_load((ROOT / "ci" / name).read_text())
    argvs = [argv for script in run_scripts(workflow) for argv in commands(script)]
    assert any(Path(a[0]).name == "titan-primus" and a[1] == "doctor" for a in argvs)
    assert marker in [pytest_marker_expression(a) for a in argvs]
    parity = [a for a in argvs if Path(a[0]).name == "titan-primus" and a[1] == "parity"]
    assert parity and all(a[a.index("--require") + 1] == required and "--json" in a for a in parity)
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    assert any(step.get("uses", "").startswith("actions/upload-artifact") and step.get("if") == "always()" for step in steps)


def test_cpu_workflow_runs_the_readme_test_command():
    workflow = yaml.safe_load((ROOT / "ci" / "cpu.yml").read_text())
    assert ["make", "test"] in [argv for script in run_scripts(workflow) for argv in commands(script)]
