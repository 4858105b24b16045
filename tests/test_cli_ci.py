"""Lint of the CI workflows in ci/: valid YAML; every titan-primus subcommand and flag, make
target and pytest marker they call exists; and they are hardened: actions pinned to commits, read
permission only, no persisted credentials, container images pinned by digest."""

import fnmatch
import re
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


def steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actions_are_pinned_to_commits(path):
    """A tag can be moved to other code; a commit cannot."""
    for step in steps(yaml.safe_load(path.read_text())):
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]), f"{path.name}: {step['uses']} is not pinned to a commit"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflows_hold_least_permissions_and_no_credentials(path):
    workflow = yaml.safe_load(path.read_text())
    assert workflow.get("permissions") == {"contents": "read"}, f"{path.name}: the workflow must grant contents: read only"
    for name, job in workflow["jobs"].items():
        assert "permissions" not in job, f"{path.name}: job {name} widens the workflow's permissions"
    checkouts = [step for step in steps(workflow) if step.get("uses", "").startswith("actions/checkout@")]
    for step in checkouts:
        assert step.get("with", {}).get("persist-credentials") is False, f"{path.name}: checkout leaves the token in .git/config"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_container_images_are_pinned_by_digest_through_a_variable(path):
    """A container job's image is a repository variable only (no tag as fallback), and a job it
    needs refuses the variable unless it names the image by digest."""
    jobs = yaml.safe_load(path.read_text())["jobs"]
    for name, job in jobs.items():
        if "container" not in job:
            continue
        image = job["container"]["image"] if isinstance(job["container"], dict) else job["container"]
        variable = re.fullmatch(r"\$\{\{\s*vars\.(\w+)\s*\}\}", image)
        assert variable, f"{path.name}: job {name} takes its image from {image!r}, not from a variable alone"
        needs = job.get("needs", [])
        checks = [step for needed in ([needs] if isinstance(needs, str) else needs) for step in jobs[needed]["steps"]
                  if f"vars.{variable[1]}" in str(step.get("env", {})) and "@sha256:" in step.get("run", "")]
        assert checks, f"{path.name}: no job that {name} needs checks that {variable[1]} is pinned by digest"


def test_every_mi300_test_runs_in_the_mi300x_workflow():
    """mi300x.yml names the files it collects (the image has TorchTitan 0.2.2, which the 0.3
    modules cannot be collected beside): every file with mi300 tests must be among them."""
    workflow = yaml.safe_load((ROOT / "ci" / "mi300x.yml").read_text())
    runs = [argv for script in run_scripts(workflow) for argv in commands(script) if pytest_marker_expression(argv) == "mi300"]
    patterns = [arg for argv in runs for arg in argv if arg.startswith("tests/")]
    marker = re.compile(r"^\s*@pytest\.mark\.mi300\b|(pytestmark\s*=|marks=).*\bpytest\.mark\.mi300\b", re.M)
    marked = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if marker.search(p.read_text())]
    assert marked
    for path in marked:
        assert any(fnmatch.fnmatch(str(path.relative_to(ROOT)), pattern) for pattern in patterns), f"{path.name} is not collected by mi300x.yml"


def test_ci_run_runs_what_the_cpu_workflow_runs():
    """.ci/run (CI on a fresh clone) and ci/cpu.yml run the same make targets, `make test` first."""
    workflow = yaml.safe_load((ROOT / "ci" / "cpu.yml").read_text())
    in_workflow = [argv for script in run_scripts(workflow) for argv in commands(script) if argv[0] == "make"]
    in_ci_run = [argv for argv in commands((ROOT / ".ci" / "run").read_text()) if argv[0] == "make"]
    assert in_ci_run == in_workflow and in_ci_run[0] == ["make", "test"]
