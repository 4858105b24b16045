"""One installed Primus-Turbo as titan-primus sees it: its API surface (named by the oldest build
that has it, ``release`` tells them apart) and the pieces of it titan-primus calls. ``rules``
reads it; ``release`` loads it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType

import torch

__all__ = ["SURFACES", "VERIFIED_BUILDS", "TurboApi", "describe_build", "newer_than_verified"]

SURFACES = ("v0.3.1", "v0.3.2.dev48")

# Builds AMD ships in its images (release notes of rocm/primus), named beside the version.
_KNOWN_BUILDS = {
    "0.3.2.dev48": "AMD rocm/primus v26.5",
    "0.4.1.dev26": "AMD rocm/primus v26.6",
}


# The builds whose own code the tier runs (tests/real_turbo), oldest first.
VERIFIED_BUILDS = ("v0.3.1", "v0.3.2.dev48", "v0.4.0", "v0.4.1.dev26")
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?(?:\+.*)?")


def _order(version: str) -> tuple[int, ...] | None:
    """A sort key of ``version`` (``X.Y.Z`` or ``X.Y.Z.devN``: a dev build comes before its
    release), or None for another form."""
    match = _VERSION.fullmatch(version.removeprefix("v"))
    if not match:
        return None
    major, minor, patch, dev = match.groups()
    return int(major), int(minor), int(patch), 0 if dev else 1, int(dev or 0)


def newer_than_verified(version: str) -> bool:
    """``version`` is a release or dev build after the newest verified build."""
    order = _order(version)
    return order is not None and order > _order(VERIFIED_BUILDS[-1])


def describe_build(version: str) -> str:
    """A build's version as a person reads it: setuptools-scm names a build N commits past tag
    vX.Y.Z as X.Y.(Z+1).devN; ``0.3.2.dev48`` -> ``0.3.2.dev48 (v0.3.1 + 48 commits, AMD
    rocm/primus v26.5)``; a build newer than every verified one says so."""
    notes = []
    match = _VERSION.fullmatch(version)
    if match and match[4] is not None:
        major, minor, patch, commits = (int(g) for g in match.groups())
        base = f"v{major}.{minor}.{patch - 1}" if patch else f"the last tag before {major}.{minor}.0"
        notes.append(f"{base} + {commits} commits")
    if version.split("+")[0] in _KNOWN_BUILDS:
        notes.append(_KNOWN_BUILDS[version.split("+")[0]])
    if newer_than_verified(version):
        notes.append(
            f"newer than the newest verified build {VERIFIED_BUILDS[-1]}: used only where its calls match "
            f"titan-primus's, checked at load, and its kernels pass the numeric self-check at conversion"
        )
    return f"{version} ({', '.join(notes)})" if notes else version


@dataclass(frozen=True)
class TurboApi:
    """The pieces of one installed Primus-Turbo that titan-primus calls."""

    surface: str
    """The oldest build with this API surface: one of SURFACES."""
    version: str
    """``primus_turbo.__version__`` (the build)."""
    enums: ModuleType
    """``core/low_precision.py``: Format, ScalingGranularity, ScalingRecipe, Float8QuantConfig."""
    backend_type: type
    quant: ModuleType
    """``kernels/quantization/quantization_impl.py``: the quantizers its autograd Functions call."""
    gemm: object
    """``primus_turbo::gemm_fp8_impl``."""
    grouped: object
    """``primus_turbo::grouped_gemm_fp8_impl``."""
    grouped_variable_k: object
    """``primus_turbo::grouped_gemm_fp8_variable_k_impl``."""
    float8_e4m3: torch.dtype
    float8_e5m2: torch.dtype
    user_backends: tuple[str, ...]
    """Backends the environment asks Primus-Turbo for (``PRIMUS_TURBO_GEMM_BACKEND``,
    ``PRIMUS_TURBO_GROUPED_GEMM_BACKEND``, ``PRIMUS_TURBO_AUTO_TUNE=1`` as "AUTOTUNE"), read at load."""
    origami: bool
    """The optional ``origami`` package is importable: Primus-Turbo's gfx950 grouped kernels then
    take its tile proposals, BLOCK_K up to 256 (``triton/utils/origami.py``)."""
    min_rows: dict[str, int] = field(default_factory=dict)
    """Rows a linear's input is zero-padded to, per recipe (``rules.min_token_rows``)."""
    differs: dict[str, str] = field(default_factory=dict)
    """{titan-primus file: why} where this build's functions differ from the calls that file makes
    (mxfp8's, attention's: ``release.CALLED_BY_NAME``); what that file runs is refused at routing."""

    def at_least(self, surface: str) -> bool:
        return SURFACES.index(self.surface) >= SURFACES.index(surface)

    @property
    def build(self) -> str:
        return describe_build(self.version)

    def formats(self, recipe: str) -> tuple[torch.dtype, torch.dtype]:
        """(forward, grad_output) FP8 dtypes: Format.HYBRID for tensorwise, else Format.E4M3."""
        return self.float8_e4m3, (self.float8_e5m2 if recipe == "tensorwise" else self.float8_e4m3)
