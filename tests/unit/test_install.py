"""Installing titan-primus into AMD's MI300X images replaces nothing of their ROCm stack.

The environment is a virtualenv holding distributions named and versioned as AMD's rocm/primus
v26.5 image ships them (only their metadata: pip decides from that alone). pip resolves the
project's install into it (``pip install --dry-run --report``) against a local "registry" that
offers newer releases of everything the image has, as PyPI does, so any requirement the image's
builds do not meet shows up as a replacement. pip runs with no index, no configuration and no
network: the result is the same on any machine.

The project enters as a wheel whose metadata is pyproject.toml's [project] table, written the way
setuptools writes it (Requires-Dist, with ``extra == "..."`` markers for the extras).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version
from support.repo_root import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# rocm/primus:v26.5 (Primus release notes): PyTorch 2.12.0+rocm7.15, torchao 0.15.0+git,
# Primus-Turbo 0.3.2.dev48, TorchTitan 0.2.2. A ROCm torch requires pytorch-triton-rocm, which
# provides the `triton` module; 3.7.0 is the Triton torch 2.12.0 pins (its registry wheel requires
# triton==3.7.0). The git hash is a stand-in; the dependencies of torchtitan and Primus-Turbo are
# the image's business and left out.
AMD_IMAGE = {
    "torch": ("2.12.0+rocm7.15", ['pytorch-triton-rocm==3.7.0; platform_system == "Linux"']),
    "pytorch-triton-rocm": ("3.7.0", []),
    "torchao": ("0.15.0+git6f27c8f", []),
    "primus_turbo": ("0.3.2.dev48", []),
    "torchtitan": ("0.2.2", []),
}
ROCM_STACK = {"torch", "torchao", "triton", "pytorch-triton-rocm", "primus-turbo", "torchtitan"}

# What a registry offers: newer releases of the image's stack (torch's CUDA build requires the
# registry's triton, as torch 2.14.1's does) and the project's other dependencies.
REGISTRY = {
    "torch": [("2.14.1", ['triton==3.8.0; platform_system == "Linux"'])],
    "triton": [("3.8.0", [])],
    "torchao": [("0.18.0", [])],
    "torchtitan": [("0.2.2", []), ("0.3.0", [])],
    "pluggy": [("1.7.0", [])],
    "tqdm": [("4.67.1", [])],
    "pytest": [("9.0.1", ["pluggy>=1.5"])],
    "pytest-xdist": [("3.8.0", ["execnet>=2.1", "pytest>=7"])],
    "execnet": [("2.1.2", [])],
    "pyyaml": [("6.0.3", [])],
    "matplotlib": [("3.10.7", [])],
}

# The requirements before this project declared its measured minimums: what replaced the stack.
REPLACING_REQUIREMENTS = [
    "torch>=2.14",
    "torchtitan>=0.2.2,<0.4",
    "torchao>=0.17",
    "pluggy>=1.5",
    "tqdm>=4.60",
    "triton; platform_system == 'Linux'",
]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata(name: str, version: str, requires: list[str], extras: dict[str, list[str]] | None = None) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    for extra, reqs in (extras or {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for r in reqs:
            requirement, _, marker = r.partition(";")
            condition = f"({marker.strip()}) and extra == {extra!r}" if marker else f"extra == {extra!r}"
            lines.append(f"Requires-Dist: {requirement.strip()}; {condition}")
    return "\n".join(lines) + "\n"


def _write_wheel(directory: Path, name: str, version: str, requires: list[str], extras=None) -> None:
    stem = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{stem}.dist-info/METADATA", _metadata(name, version, requires, extras))
        wheel.writestr(
            f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{stem}.dist-info/RECORD", "")


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


@pytest.fixture(scope="module")
def amd_image(tmp_path_factory) -> Path:
    """A virtualenv whose installed distributions are the image's."""
    env = tmp_path_factory.mktemp("amd-image")
    venv.create(env, with_pip=False)
    for name, (version, requires) in AMD_IMAGE.items():
        info = _site_packages(env) / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(_metadata(name, version, requires))
        (info / "INSTALLER").write_text("pip\n")
    return env


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """Local find-links: the registry's releases, this project, and the project with the
    requirements it had before (as another distribution)."""
    directory = tmp_path_factory.mktemp("registry")
    for name, releases in REGISTRY.items():
        for version, requires in releases:
            _write_wheel(directory, name, version, requires)
    _write_wheel(
        directory, PROJECT["name"], PROJECT["version"], PROJECT["dependencies"], PROJECT["optional-dependencies"]
    )
    _write_wheel(directory, "former-titan-primus", PROJECT["version"], REPLACING_REQUIREMENTS)
    return directory


def resolve(env: Path, registry: Path, *requirements: str, constraints: list[str] = ()) -> tuple[int, dict | str]:
    """pip's install plan for ``requirements`` in ``env``: (0, report) or (exit code, its output)."""
    isolated = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    isolated |= {"PIP_CONFIG_FILE": os.devnull, "PYTHONNOUSERSITE": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        report, constraint_file = Path(scratch) / "report.json", Path(scratch) / "constraints.txt"
        constraint_file.write_text("".join(f"{c}\n" for c in constraints))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(env / "bin" / "python"),
                "install",
                "--dry-run",
                "--report",
                str(report),
                "--no-index",
                "--find-links",
                str(registry),
                "--constraint",
                str(constraint_file),
                *requirements,
            ],
            capture_output=True,
            text=True,
            env=isolated,
            timeout=120,
        )
        return (
            (0, json.loads(report.read_text()))
            if done.returncode == 0
            else (done.returncode, done.stdout + done.stderr)
        )


def planned(report: dict) -> dict[str, str]:
    return {_normalise(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def _names(requirements) -> set[str]:
    return {_normalise(re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0]) for r in requirements}


def project_needs(*extras: str) -> set[str]:
    """Distributions the project requires for ``extras``, with what those require in turn (the
    registry's metadata: pytest-xdist brings execnet)."""
    needed = _names(PROJECT["dependencies"] + [r for e in extras for r in PROJECT["optional-dependencies"][e]])
    registry = {_normalise(name): releases for name, releases in REGISTRY.items()}
    todo = list(needed)
    while todo:
        for _, requires in registry.get(todo.pop(), []):
            new = _names(requires) - needed
            needed |= new
            todo += new
    return needed


@pytest.mark.parametrize("extras", [(), ("torchtitan02", "test")], ids=lambda e: "+".join(e) or "core")
def test_installing_into_the_amd_image_replaces_nothing(amd_image, registry, extras):
    spec = f"{PROJECT['name']}[{','.join(extras)}]" if extras else PROJECT["name"]
    code, report = resolve(amd_image, registry, spec)
    assert code == 0, report
    plan = planned(report)
    assert plan.pop("titan-primus") == PROJECT["version"]
    replaced = {name: plan[name] for name in plan if name in {_normalise(n) for n in AMD_IMAGE}}
    assert not replaced, f"pip would replace the image's {replaced}"
    assert not set(plan) & ROCM_STACK, f"pip would add {set(plan) & ROCM_STACK} beside the image's ROCm stack"
    assert set(plan) <= project_needs(*extras), f"pip would add {set(plan) - project_needs(*extras)}"


def test_the_torchtitan_0_3_line_is_refused_on_the_image_instead_of_replacing_its_torch(amd_image, registry):
    """TorchTitan 0.3 needs torch 2.14: with the image's torch pinned (as ci/mi300x-image.sh does) pip
    refuses; nothing gets swapped."""
    code, stderr = resolve(
        amd_image, registry, f"{PROJECT['name']}[torchtitan]", constraints=[f"torch=={AMD_IMAGE['torch'][0]}"]
    )
    assert code != 0 and "ResolutionImpossible" in stderr and "torch>=2.14" in stderr, stderr


def test_the_check_sees_a_replacement(amd_image, registry):
    """The requirements the project had before (torch>=2.14, torchao>=0.17, triton) replace the
    image's torch and torchao and add the registry's triton over pytorch-triton-rocm."""
    code, report = resolve(amd_image, registry, "former-titan-primus")
    assert code == 0, report
    assert {"torch", "torchao", "triton"} <= set(planned(report))


def test_the_oldest_stack_ci_tests_is_the_declared_minimum():
    """make test-oldest installs exactly the lower bounds pyproject.toml declares."""
    venvs = (ROOT / "venvs.mk").read_text()
    pins = dict(re.findall(r"^OLDEST_(\w+)\s*:=\s*(\S+)", venvs, re.M))
    declared = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["torchtitan02"]
    lower = {
        _normalise(name): bound
        for name, bound in (re.match(r"([\w-]+)>=([\d.]+)", r).groups() for r in declared if ">=" in r)
    }
    assert {name.lower(): Version(v) for name, v in pins.items()} == {
        name: Version(lower[name]) for name in ("torch", "torchao", "torchtitan")
    }
