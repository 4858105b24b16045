"""Primus-Turbo's shape rules, per build, architecture, recipe and op: what the kernels that will
run accept, and what their ``tl.assume`` statements take for granted (a violated assume is
undefined behaviour on a GPU, and Triton's interpreter raises on it).

Contraction dims known at conversion (K forward, N dgrad) become routing decisions with the
reason; the dense wgrad contracts over the token count, known only per call, so the linear pads
its rows with zeros up to :func:`min_token_rows` (exact for all three GEMMs: zero rows add
nothing to any product, amax or column scale, and their outputs are dropped).

Which kernel runs a GEMM is Primus-Turbo's choice: its autograd Functions name a default backend
(``ops/gemm_fp8.py``, ``ops/grouped_gemm_fp8.py``), and ``PRIMUS_TURBO_GEMM_BACKEND`` /
``PRIMUS_TURBO_GROUPED_GEMM_BACKEND`` / ``PRIMUS_TURBO_AUTO_TUNE=1`` override it
(``core/backend.py``). A rule applies where its kernel may run: the default, a backend the
environment asks for, or, under auto-tuning, any backend.

Each constant mirrored from Primus-Turbo's sources names, in ``MIRRORED``, the file it was read
in, the builds it was read at and what the file states; tests/real_turbo/test_mirrored_constants.py
re-reads each from every build's sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...device import DeviceProfile
from ..base import Op
from .api import VERIFIED_BUILDS, TurboApi

__all__ = ["refusal", "min_token_rows", "dense_backend", "ALIGNMENT", "BLOCK_RECIPES", "MX_MIN_SURFACE", "MIRRORED"]

ALIGNMENT = 16
CK_ALIGNMENT = 32
TRITON_MIN_CONTRACTION = 256
TRITON_MIN_CONTRACTION_ORIGAMI = 512
BLOCKWISE_SIZE = 128
MX_K_ALIGNMENT = 128
MX_MIN_SURFACE = "v0.3.2.dev48"
BLOCK_RECIPES = ("mxfp8", "blockwise")

# The backend each build's own autograd Functions name as default: (surface, recipe) -> dense.
_DENSE_DEFAULT = {
    ("v0.3.1", "tensorwise"): "HIPBLASLT",
    ("v0.3.1", "rowwise"): "HIPBLASLT",
    ("v0.3.1", "blockwise"): "CK",
    ("v0.3.2.dev48", "tensorwise"): "HIPBLASLT",
    ("v0.3.2.dev48", "rowwise"): "TRITON",
    ("v0.3.2.dev48", "blockwise"): "TRITON",
}
# Grouped tensorwise, rowwise and blockwise at every build: the grouped rules below are Triton's.
_GROUPED_DEFAULT = "TRITON"


@dataclass(frozen=True)
class Mirrored:
    """Where a constant above was read: ``files`` under ``primus_turbo/``, at ``builds``."""

    files: tuple[str, ...]
    builds: tuple[str, ...]
    what: str
    """What the files state, which the constant mirrors."""


_GEMM_IMPL = "pytorch/kernels/gemm/gemm_fp8_impl.py"
_GROUPED_KERNEL = "triton/grouped_gemm/grouped_gemm_fp8_kernel.py"
_GROUPED_OPS = "pytorch/ops/grouped_gemm_fp8.py"

MIRRORED = {
    "ALIGNMENT": Mirrored(
        (_GEMM_IMPL,),
        VERIFIED_BUILDS,
        "the MX backends' can_handle: m % 16 and n % 16 (GEMMFP8TurboBackend); for the other granularities "
        "the 16 is hipBLASLt's (C++, not in these sources)",
    ),
    "CK_ALIGNMENT": Mirrored(
        (_GEMM_IMPL,),
        VERIFIED_BUILDS[1:],  # v0.3.1's can_handle checks no shape ("TODO: check shape"): its ck_gemm.cpp raises
        "GEMMFP8CKBackend.can_handle: k % 32 == 0 where the left operand is not transposed (K forward, N dgrad)",
    ),
    "TRITON_MIN_CONTRACTION": Mirrored(
        ("triton/gemm/gemm_fp8_kernel.py", _GROUPED_KERNEL),
        VERIFIED_BUILDS,
        "the dense tensorwise and rowwise, and grouped tensorwise, rowwise and blockwise persistent kernels "
        "state tl.assume(loop_k > 1), loop_k = K // BLOCK_K; BLOCK_K is 128 or 64 (offline_select_fp8 by "
        "layout; 128 on gfx950); the variable-K wgrad kernels and the grouped MX kernel state none",
    ),
    "TRITON_MIN_CONTRACTION_ORIGAMI": Mirrored(
        (_GROUPED_KERNEL, "triton/utils/origami.py"),
        VERIFIED_BUILDS,
        "on gfx950 the grouped tensorwise and rowwise configs take BLOCK_K from the optional origami "
        "package's proposal (blk_k = ok), drawn from block_k_range = [64, 128, 256]",
    ),
    "BLOCKWISE_SIZE": Mirrored(
        (_GROUPED_OPS,), VERIFIED_BUILDS, "FP8GroupedGemmBlockFunc: assert config.block_size in [128]"
    ),
    "MX_K_ALIGNMENT": Mirrored(
        (_GEMM_IMPL,),
        VERIFIED_BUILDS,
        "the MX backends' can_handle: k % 128 == 0 (GEMMFP8TurboBackend; GEMMFP8FlyDSLBackend from v0.3.2.dev48)",
    ),
    "MX_MIN_SURFACE": Mirrored(
        (_GROUPED_OPS,),
        VERIFIED_BUILDS,
        "grouped_gemm_fp8 dispatches MX_BLOCKWISE (FP8GroupedGemmMXFunc) from v0.3.2.dev48; v0.3.1 does not",
    ),
    "_DENSE_DEFAULT": Mirrored(
        ("pytorch/ops/gemm_fp8.py",),
        VERIFIED_BUILDS,
        "default_backend=BackendType.X.value in the autograd Function gemm_fp8 dispatches each granularity to",
    ),
    "_GROUPED_DEFAULT": Mirrored(
        (_GROUPED_OPS,), VERIFIED_BUILDS, "the same in grouped_gemm_fp8's: TRITON for tensorwise, rowwise, blockwise"
    ),
}


def dense_backend(api: TurboApi, recipe: str) -> str:
    """The backend Primus-Turbo's own dense autograd Function names for ``recipe``."""
    surface = "v0.3.1" if api.surface == "v0.3.1" else "v0.3.2.dev48"
    return _DENSE_DEFAULT[surface, recipe]


def _may_run(api: TurboApi, default: str, candidates: tuple[str, ...]) -> set[str]:
    """Backends among ``candidates`` that may run a GEMM whose default is ``default``."""
    if "AUTOTUNE" in api.user_backends:
        return set(candidates)
    asked = set(api.user_backends) & set(candidates)
    return asked or {default}


def _dense_kernels(api: TurboApi, recipe: str) -> set[str]:
    default = dense_backend(api, recipe)
    if recipe == "rowwise" and default == "HIPBLASLT":
        default = "CK"  # v0.3.1: hipBLASLt has no rowwise GEMM; the dispatcher falls back to CK
    return _may_run(api, default, ("HIPBLASLT", "CK", "TRITON"))


def min_token_rows(api: TurboApi, recipe: str) -> int:
    """Rows a linear's input is zero-padded to, so the dense wgrad's contraction over tokens
    meets the Triton kernels' ``tl.assume(loop_k > 1)`` (0: no kernel that may run needs it)."""
    if recipe in ("tensorwise", "rowwise") and "TRITON" in _dense_kernels(api, recipe):
        return TRITON_MIN_CONTRACTION
    return 0


def _small(dims: tuple[tuple[str, int | None], ...], minimum: int) -> list[str]:
    return [f"{name}={dim}" for name, dim in dims if dim is not None and dim < minimum]


def _not_divisible(dims: tuple[tuple[str, int | None], ...], multiple: int) -> list[str]:
    return [f"{name}={dim}" for name, dim in dims if dim is not None and dim % multiple]


def _block_refusal(recipe: str, device: DeviceProfile, api: TurboApi, k: int | None, n: int | None) -> str | None:
    if recipe == "mxfp8":
        if not api.at_least(MX_MIN_SURFACE):
            return (
                f"Primus-Turbo {api.build} has no grouped MX GEMM and its dense MX GEMM runs another "
                f"definition; upgrade Primus-Turbo to >= {MX_MIN_SURFACE} (rocm/primus v26.5) or v0.4.0"
            )
        if device.arch != "gfx950":
            return (
                f"Primus-Turbo's MX GEMMs need MX hardware (check_mxfp8_support: gfx950 or newer); "
                f"this is {device.arch}; use recipe 'blockwise' here"
            )
        bad = _not_divisible((("K", k),), MX_K_ALIGNMENT) + _not_divisible((("N", n),), ALIGNMENT)
        rule = f"K divisible by {MX_K_ALIGNMENT} (its hipBLASLt MX path) and N by {ALIGNMENT}"
    else:
        bad = _not_divisible((("K", k), ("N", n)), BLOCKWISE_SIZE)
        rule = f"K and N divisible by its {BLOCKWISE_SIZE} block"
    return f"Primus-Turbo's {recipe} GEMMs need {rule} ({', '.join(bad)})" if bad else None


def refusal(api: TurboApi, device: DeviceProfile, op: Op, recipe: str, k: int | None, n: int | None) -> str | None:
    """Why Primus-Turbo ``api`` cannot run ``op`` with ``recipe`` for contraction K and output N
    on ``device``, or None."""
    if recipe in BLOCK_RECIPES:
        why = _block_refusal(recipe, device, api, k, n)
        if why:
            return why
    dims = (("K", k), ("N", n))
    bad = _not_divisible(dims, ALIGNMENT)
    if bad:
        return f"Primus-Turbo's FP8 GEMMs need K and N divisible by {ALIGNMENT} ({', '.join(bad)})"
    if op == "linear" and recipe in ("tensorwise", "rowwise"):
        kernels = _dense_kernels(api, recipe)
        bad = _not_divisible(dims, CK_ALIGNMENT)
        if "CK" in kernels and bad:
            return (
                f"Primus-Turbo {api.build} may run these dense {recipe} GEMMs on CK, which needs each "
                f"contraction dim (K forward, N dgrad) divisible by {CK_ALIGNMENT} ({', '.join(bad)})"
            )
        small = _small(dims, TRITON_MIN_CONTRACTION)
        if "TRITON" in kernels and small:
            return (
                f"Primus-Turbo {api.build} runs these dense {recipe} GEMMs on Triton kernels that assume at "
                f"least two BLOCK_K steps (tl.assume(loop_k > 1)): contraction dims (K forward, N dgrad) "
                f"under {TRITON_MIN_CONTRACTION} are undefined behaviour there ({', '.join(small)})"
            )
    if op == "grouped_mm" and recipe != "mxfp8":
        minimum = TRITON_MIN_CONTRACTION
        if device.arch == "gfx950" and api.origami and recipe != "blockwise":
            minimum = TRITON_MIN_CONTRACTION_ORIGAMI
        small = _small(dims, minimum)
        if small:
            origami = " (gfx950 with origami installed: BLOCK_K up to 256)" if minimum > TRITON_MIN_CONTRACTION else ""
            return (
                f"Primus-Turbo's Triton grouped FP8 kernels assume at least two BLOCK_K steps "
                f"(tl.assume(loop_k > 1)): contraction dims (K forward, N dgrad) under {minimum} are "
                f"undefined behaviour there{origami} ({', '.join(small)})"
            )
    return None
