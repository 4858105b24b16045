"""Import one build of Primus-Turbo's own Python package on a CPU, as an MI300X (gfx942) or an
MI355X (gfx950) would see it (../shared/reference/primus-turbo-interpreter.md).

One build and one architecture per process: Primus-Turbo registers its ``primus_turbo::`` custom
ops and picks its FP8 formats once, at import. What is supplied, and why:

- the compiled extension ``primus_turbo.pytorch._C`` (and ``_C.deep_ep``, ``_C.runtime``): empty
  modules; the HIP ops it would register are the stand-ins (stand_ins.py);
- the device queries Primus-Turbo makes at import and per call
  (``torch.cuda.get_device_properties(torch.cuda.current_device())``: compute capability 9.4 is
  gfx942, 9.5 gfx950; ``multi_processor_count`` sizes the persistent grids). ``is_available``
  stays False: torch.compile would go looking for a driver, and titan-primus is told the device
  through its profile instead;
- an active Triton driver whose target is ``GPUTarget("hip", arch, 64)``: the FP8 attention
  kernels pick their FP8 types from it (``triton/attention/attention_kernel.py``,
  ``get_tl_f8_bwd_dtype``); the interpreter has no active driver ("0 active drivers");
- ``flydsl`` (imported at module top from v0.4.0; no registry release has what it needs): an
  inert stub. FlyDSL kernels are gfx950-only and never a default on the FP8 GEMM paths;
- ``torch.library.custom_op(..., device_types="cuda")``: "cpu" added, so Primus-Turbo's
  low-level ops run on CPU tensors;
- Triton's interpreter, patched (interpreter.py);
- AITER's flash-attention kernels, which Primus-Turbo's bf16 attention calls (aiter_stand_in.py).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

import torch
from support.repo_root import ROOT

from . import aiter_stand_in, interpreter, stand_ins

ARCHS = {"gfx942": (9, 4, "AMD Instinct MI300X"), "gfx950": (9, 5, "AMD Instinct MI355X")}
COMPUTE_UNITS = 8  # keeps the persistent grids (one program per CU) small under the interpreter


class _Inert(type):
    """Any attribute, call, subscript or subclass of an inert stub is another inert stub."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Inert(cls.__name__, (), {})

    def __getitem__(cls, item):
        return _Inert(cls.__name__, (), {})


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})


class _SourceFinder(importlib.abc.MetaPathFinder):
    """The package ``name`` from the folder ``source`` (a build's sources, not installed), and
    nothing else from that folder; its submodules follow the package's ``__path__``."""

    def __init__(self, name: str, source: Path):
        self.name, self.source = name, str(source)

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.source])


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, *roots: str):
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _fake_device(arch: str) -> None:
    major, minor, name = ARCHS[arch]
    props = types.SimpleNamespace(
        major=major,
        minor=minor,
        name=name,
        gcnArchName=f"{arch}:sramecc+:xnack-",
        multi_processor_count=COMPUTE_UNITS,
        total_memory=192 * 2**30,
        warp_size=64,
    )
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.current_device = lambda: 0


class _HipTarget:
    """The one query Primus-Turbo makes of Triton's active driver: its target."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("hip", arch, 64)

    def get_current_target(self):
        return self.target


def _fake_triton_driver(arch: str) -> None:
    import triton

    triton.runtime.driver.set_active(_HipTarget(arch))


def _empty_extension() -> None:
    for name in ("primus_turbo.pytorch._C", "primus_turbo.pytorch._C.deep_ep", "primus_turbo.pytorch._C.runtime"):
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
    sys.modules["primus_turbo.pytorch._C.deep_ep"].Config = type("Config", (), {})
    sys.modules["primus_turbo.pytorch._C.deep_ep"].EventHandle = type("EventHandle", (), {})
    sys.modules["primus_turbo.pytorch._C"].deep_ep = sys.modules["primus_turbo.pytorch._C.deep_ep"]
    sys.modules["primus_turbo.pytorch._C"].runtime = sys.modules["primus_turbo.pytorch._C.runtime"]


def _custom_ops_on_cpu() -> None:
    original = torch.library.custom_op

    def custom_op(name, fn=None, /, *, mutates_args, device_types=None, schema=None, **kwargs):
        if device_types is not None:
            types_ = [device_types] if isinstance(device_types, str) else list(device_types)
            device_types = types_ + ["cpu"] if "cpu" not in types_ else types_
        return original(name, fn, mutates_args=mutates_args, device_types=device_types, schema=schema, **kwargs)

    torch.library.custom_op = custom_op


def default_sources() -> Path:
    """``shared/primus-turbo`` beside the repository (``../shared/primus-turbo``), or beside the
    nearest folder above it that has one (a clone in a subfolder of the workspace)."""
    for folder in ROOT.parents:
        if (folder / "shared" / "primus-turbo").is_dir():
            return folder / "shared" / "primus-turbo"
    return ROOT.parent / "shared" / "primus-turbo"


@functools.cache
def from_environment():
    """(``primus_turbo.pytorch``, None) for the build and architecture the environment names
    (``TITAN_PRIMUS_TURBO_BUILD``, ``TITAN_PRIMUS_TURBO_ARCH``, ``TITAN_PRIMUS_TURBO_SOURCES``:
    default :func:`default_sources`), or (None, why not). Once per process."""
    build = os.environ.get("TITAN_PRIMUS_TURBO_BUILD", "")
    arch = os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")
    sources = Path(os.environ.get("TITAN_PRIMUS_TURBO_SOURCES", default_sources()))
    if build not in stand_ins.BUILDS:
        return None, f"TITAN_PRIMUS_TURBO_BUILD={build!r}: choose one of {', '.join(stand_ins.BUILDS)}"
    if arch not in ARCHS:
        return None, f"TITAN_PRIMUS_TURBO_ARCH={arch!r}: choose one of {', '.join(ARCHS)}"
    if not (sources / build / "primus_turbo").is_dir():
        return None, (
            f"Primus-Turbo {build} sources not found at {sources / build} "
            f"(set TITAN_PRIMUS_TURBO_SOURCES to the folder holding the builds)"
        )
    return load(sources / build, arch), None


def load(source: Path, arch: str):
    """Import the Primus-Turbo build in ``source`` (a folder holding ``primus_turbo/``) as on
    ``arch``; returns ``primus_turbo.pytorch``. Once per process."""
    if "primus_turbo" in sys.modules:
        raise RuntimeError("a Primus-Turbo build is already imported in this process")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported")
    interpreter.install()
    _fake_device(arch)
    _fake_triton_driver(arch)
    _empty_extension()
    sys.meta_path.insert(0, _InertFinder("flydsl"))
    _custom_ops_on_cpu()
    stand_ins.register(source.name)
    aiter_stand_in.install()
    sys.meta_path.insert(0, _SourceFinder("primus_turbo", source))
    import primus_turbo
    import primus_turbo.pytorch as turbo

    # A built wheel carries its version (setuptools-scm's _version.py); the shared sources do not.
    primus_turbo.__version__ = source.name.removeprefix("v")
    return turbo


def on_ci() -> bool:
    """``CI`` is set (GitHub Actions and most CI services set ``CI=true``; so does ci/cpu.sh)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_sources_on_ci() -> None:
    """At a tier conftest's import: with ``CI`` set, a tier that cannot import its Primus-Turbo
    build stops pytest with the reason (variable and folder), instead of skipping every test and
    passing: CI that skips the tier proves nothing docs/primus-turbo.md claims of Primus-Turbo."""
    turbo, why_not = from_environment()
    if turbo is None and on_ci():
        import pytest

        raise pytest.UsageError(
            f"Primus-Turbo real-code tier: {why_not}. CI is set, so the tier fails instead of skipping "
            f"(ci/primus-turbo.sh fetches the builds; docs/ci.md)"
        )


def report_header(config) -> str:
    """``pytest_report_header`` of a tier folder: what it runs, or why it is skipped."""
    turbo, why_not = from_environment()
    if turbo is None:
        return f"Primus-Turbo real-code tier: skipped ({why_not})"
    arch = os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")
    return f"Primus-Turbo real-code tier: {turbo.__file__}, {arch}, Triton interpreter"


def skip_without_sources(config, items) -> None:
    """``pytest_collection_modifyitems`` of a tier folder: every test skipped, with the reason,
    where the environment names no usable build (never with ``CI`` set: require_sources_on_ci)."""
    import pytest

    turbo, why_not = from_environment()
    if turbo is None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=why_not))


_executed = []


def count_executed(report) -> None:
    """``pytest_runtest_logreport`` of a tier folder: the tests whose body ran (passed or failed)."""
    if report.when == "call" and not report.skipped:
        _executed.append(report.nodeid)


def fail_when_nothing_ran(session, exitstatus) -> None:
    """``pytest_sessionfinish`` of a tier folder: with ``CI`` set, a tier run in which no test ran
    (every one skipped or deselected) exits 5, pytest's "no tests collected", instead of 0."""
    import pytest

    if on_ci() and exitstatus == pytest.ExitCode.OK and not _executed and not hasattr(session.config, "workerinput"):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("Primus-Turbo real-code tier: no test ran; with CI set that is a failure", red=True)
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
