"""The real-code tier: titan-primus against Primus-Turbo's own Python and Triton code.

One Primus-Turbo build and one architecture per process (Primus-Turbo registers its custom ops
and picks its FP8 formats at import): ``make test-turbo`` runs this folder once per build and
architecture, with

- ``TITAN_PRIMUS_TURBO_BUILD``: a folder name under the sources (v0.3.1, v0.3.2.dev48, v0.4.0,
  v0.4.1.dev26);
- ``TITAN_PRIMUS_TURBO_ARCH``: gfx942 (MI300X, FNUZ FP8) or gfx950 (MI355X, OCP FP8);
- ``TITAN_PRIMUS_TURBO_SOURCES``: the folder holding the builds, default ``../shared/primus-turbo``
  beside the repository (or beside the nearest folder above it that has one);
- ``TRITON_INTERPRET=1``, set before Triton is imported.

Where the sources are absent every test here is skipped with that reason; with ``CI`` set, pytest
stops instead, naming the variable and the folder, and a run in which no test ran exits 5.
"""

from __future__ import annotations

import os

import pytest

from real_turbo import loader

BUILD = os.environ.get("TITAN_PRIMUS_TURBO_BUILD", "")
ARCH = os.environ.get("TITAN_PRIMUS_TURBO_ARCH", "gfx942")
loader.require_sources_on_ci()
TURBO, _ = loader.from_environment()

# The recipes Primus-Turbo's own code runs under the interpreter. Its mxfp8 path (gfx950, from
# v0.3.2.dev48) quantizes with FlyDSL kernels (``flydsl/quantization/mxfp8_quant_flydsl.py``
# asserts a CUDA tensor) and HIP ops (``grouped_quantize_mxfp8_dual``), neither of which runs on a
# CPU nor has a stand-in here: mxfp8 on Primus-Turbo is unverified until the MI355X workflow.
RECIPES = ("tensorwise", "rowwise", "blockwise")
NOT_RUN_HERE = {
    "mxfp8": "Primus-Turbo quantizes mxfp8 with FlyDSL and HIP kernels that do not run on a CPU (no stand-in)"
}

# The costliest tests (a training step of a converted model, shape sweeps, selective-AC GEMM
# counts) run on one architecture per build, alternating, so each build and each architecture is
# covered; the rest run on both.
ONE_ARCH = {"v0.3.1": "gfx942", "v0.3.2.dev48": "gfx950", "v0.4.0": "gfx942", "v0.4.1.dev26": "gfx950"}
one_arch = pytest.mark.skipif(
    ONE_ARCH.get(BUILD) != ARCH,
    reason=f"runs on {ONE_ARCH.get(BUILD)} for build {BUILD} (costly; each build runs it on one arch)",
)


pytest_report_header = loader.report_header
pytest_collection_modifyitems = loader.skip_without_sources
pytest_runtest_logreport = loader.count_executed
pytest_sessionfinish = loader.fail_when_nothing_ran


@pytest.fixture
def device():
    """titan-primus's profile of the architecture Primus-Turbo was imported for."""
    import titan_primus as tp

    return tp.device_profile(ARCH)


@pytest.fixture
def hardware(device):
    """Where the MI300 tests' bodies run in this tier (test_hardware_bodies.py): CPU tensors,
    routing asked about this architecture, ``aot_eager`` for torch.compile (the interpreter
    generates no Triton code), group lengths that look like a GPU's (``group_lens.is_cuda`` is
    asserted by Primus-Turbo's public grouped op)."""
    from support.helpers import Hardware

    from real_turbo.calls import CudaLooking

    return Hardware("cpu", device, "aot_eager", lambda lens: lens.as_subclass(CudaLooking))
