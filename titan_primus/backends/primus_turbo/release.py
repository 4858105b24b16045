"""Which Primus-Turbo is installed: its API surface, told apart by signatures, and its build.

titan-primus drives Primus-Turbo from v0.3.1 on, the releases whose Python and Triton code its
test tier runs (tests/real_turbo: v0.3.1, v0.3.2.dev48, v0.4.0, v0.4.1.dev26). Two API
surfaces matter, each named by the oldest build that has it:

- ``v0.3.1``: ``grouped_gemm_fp8(out_dtype=)``; dense rowwise GEMMs on hipBLASLt falling back
  to CK, dense blockwise on CK (``ops/gemm_fp8.py``);
- ``v0.3.2.dev48`` (AMD's rocm/primus v26.5 ships it; v0.4.0 and v0.4.1.dev26 run the same FP8
  Python code): ``grouped_gemm_fp8_impl(group_offs_out=)`` and ``FP8GemmTensorFunction`` taking
  pre-quantized ``a_t`` / ``b_t``; dense rowwise and blockwise GEMMs default to Triton; gfx950
  tensorwise backward runs NT-layout GEMMs on transposed FP8 copies; grouped MX GEMMs.

Older releases are refused with the reason: their Python code cannot be run here, so a rule
about them would be a guess.

Primus-Turbo is imported only after the hardware check says the device is MI300-class (its
import needs a ROCm GPU and its compiled extension), or where this process has imported it
already (the real-code tier does, tests/real_turbo): building the registry, routing for another
device and listing the save ops of selective activation checkpointing never import it
(``PrimusTurboBackend``, tests/unit/test_routing.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from dataclasses import replace
from types import ModuleType

from .api import SURFACES, VERIFIED_BUILDS, TurboApi, describe_build, newer_than_verified
from .rules import min_token_rows

logger = logging.getLogger("titan_primus")

__all__ = [
    "SURFACES",
    "TurboApi",
    "UnsupportedRelease",
    "api_loaded",
    "called_by_name_problem",
    "called_modules",
    "forget_api",
    "imported",
    "load_api",
    "describe_build",
    "INSTALL_HINT",
]

OLDEST = SURFACES[0]
INSTALL_HINT = "build it from source against ROCm (github.com/AMD-AGI/Primus-Turbo)"

CONFIG_MODULE = "primus_turbo.pytorch.core.low_precision"
BACKEND_MODULE = "primus_turbo.pytorch.core.backend"
GEMM_OPS_MODULE = "primus_turbo.pytorch.ops.gemm_fp8"
QUANT_MODULE = "primus_turbo.pytorch.kernels.quantization.quantization_impl"
GEMM_IMPL_MODULE = "primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl"
PUBLIC_OPS_MODULE = "primus_turbo.pytorch.ops"
GROUPED_IMPL_MODULE = "primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl"
ATTENTION_IMPL_MODULES = (
    "primus_turbo.pytorch.kernels.attention.attention_triton_impl",
    "primus_turbo.pytorch.kernels.attention.attention_aiter_impl",
)


class UnsupportedRelease(Exception):
    """An importable Primus-Turbo this adapter does not drive."""


def _import_optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _surface(enums: ModuleType, gemm_ops: ModuleType, grouped_impl) -> str:
    if (
        not hasattr(enums, "Float8QuantConfig")
        or "scale_dtype" not in inspect.signature(enums.Float8QuantConfig).parameters
    ):
        raise UnsupportedRelease(_too_old("its Float8QuantConfig has no scale_dtype (v0.2.x)"))
    grouped = importlib.import_module("primus_turbo.pytorch").ops.grouped_gemm_fp8
    if "out_dtype" not in inspect.signature(grouped).parameters:
        raise UnsupportedRelease(_too_old("its grouped_gemm_fp8 has no out_dtype (v0.3.0)"))
    newer = (
        "group_offs_out" in [a.name for a in grouped_impl._opoverload._schema.arguments],
        "a_t" in inspect.signature(gemm_ops.FP8GemmTensorFunction.forward).parameters,
    )
    if all(newer):
        return "v0.3.2.dev48"
    if any(newer):
        raise UnsupportedRelease(
            f"this Primus-Turbo build has part of the v0.3.2.dev48 API only "
            f"(grouped_gemm_fp8_impl(group_offs_out=), FP8GemmTensorFunction(a_t=): {newer}); "
            f"use a release or an AMD image build"
        )
    return "v0.3.1"


# The argument names titan-primus passes, by keyword, to each Primus-Turbo function or custom op,
# with the titan-primus file that calls it; the same at every verified build. A build that renamed
# or removed one is refused at load (Primus-Turbo imports every one of these modules with
# ``primus_turbo.pytorch``), before any step, with the function and the names, and so is one that
# adds an argument without a default; one that adds an argument with a default passes.
_AUTOGRAD = "titan_primus/backends/primus_turbo/autograd.py"
ATTENTION_FP8_CALLER = "titan_primus/backends/primus_turbo/attention_fp8.py"
ATTENTION_BF16_CALLER = "titan_primus/backends/primus_turbo/attention_bf16.py"
MX_CALLER = "titan_primus/backends/primus_turbo/mx.py"
CALLED_BY_NAME = {
    "gemm_fp8_impl": (_AUTOGRAD, (
        "a", "a_scale_inv", "trans_a", "b", "b_scale_inv", "trans_b", "out_dtype", "trans_c", "granularity",
        "default_backend",
    )),
    "grouped_gemm_fp8_impl": (_AUTOGRAD, (
        "a", "b", "a_scales", "b_scales", "group_lens", "group_offs", "trans_a", "trans_b", "out_dtype",
        "granularity", "num_cu", "default_backend",
    )),
    "grouped_gemm_fp8_variable_k_impl": (_AUTOGRAD, (
        "a", "b", "a_scales", "b_scales", "group_lens", "group_offs", "trans_a", "trans_b", "trans_c", "out_dtype",
        "granularity", "num_cu", "default_backend",
    )),
    # The public ops mxfp8 runs (v0.3.2.dev48+ on gfx950; the same arguments at every build).
    "gemm_fp8": (MX_CALLER, ("a", "b", "trans_a", "trans_b", "out_dtype", "config")),
    "grouped_gemm_fp8": (MX_CALLER, ("a", "b", "group_lens", "group_offs", "trans_b", "out_dtype", "config")),
    "quantize_fp8_tensorwise_impl": (_AUTOGRAD, ("x", "out_dtype")),
    "quantize_fp8_rowwise_impl": (_AUTOGRAD, ("x", "out_dtype", "axis")),
    "dequantize_fp8_rowwise_impl": (_AUTOGRAD, ("x", "out_dtype", "axis", "scale_inv")),
    "quant_fp8_blockwise_for_weight_impl": (_AUTOGRAD, ("w", "dtype", "block_size")),
    "quant_fp8_blockwise_dual_impl": (_AUTOGRAD, ("x", "dtype", "block_size")),
    "quant_fp8_blockwise_segment_m_row_col_impl": (_AUTOGRAD, (
        "x", "dtype", "block_size", "group_lens", "group_offs", "gemm_other_dim",
    )),
    "attention_triton_forward_impl": (ATTENTION_FP8_CALLER, (
        "q", "k", "v", "p_scale", "q_descale", "k_descale", "v_descale", "dropout_p", "softmax_scale", "causal",
        "window_size_left", "window_size_right", "bias", "alibi_slopes", "return_softmax", "use_fp8",
    )),
    "attention_triton_backward_impl": (ATTENTION_FP8_CALLER, (
        "do", "q", "k", "v", "o", "q_descale", "k_descale", "v_descale", "p_scale", "softmax_lse_delta", "dq",
        "dk", "dv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
        "window_size_left", "window_size_right", "alibi_slopes", "use_fp8",
    )),
    "attention_aiter_varlen_forward_impl": (ATTENTION_BF16_CALLER, (
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
        "softmax_scale", "causal", "window_size_left", "window_size_right", "bias", "alibi_slopes", "return_lse",
        "return_softmax",
    )),
    "attention_aiter_varlen_backward_impl": (ATTENTION_BF16_CALLER, (
        "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
        "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
        "window_size_right", "alibi_slopes", "deterministic", "rng_state", "is_v3_atomic_fp32", "how_v3_bf16_cvt",
    )),
}  # fmt: skip


def _parameters(fn) -> dict[str, bool]:
    """A custom op's schema arguments, or a plain function's parameters: {name: whether it must be
    passed (no default)}."""
    op = getattr(fn, "_opoverload", None)
    if op is not None:
        return {a.name: not a.has_default_value() for a in op._schema.arguments}
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {
        name: p.default is inspect.Parameter.empty and p.kind not in variadic
        for name, p in inspect.signature(fn).parameters.items()
    }


def called_modules() -> tuple[ModuleType, ...]:
    """The Primus-Turbo modules holding the functions and ops of :data:`CALLED_BY_NAME`."""
    names = (GEMM_IMPL_MODULE, GROUPED_IMPL_MODULE, QUANT_MODULE, *ATTENTION_IMPL_MODULES, PUBLIC_OPS_MODULE)
    return tuple(importlib.import_module(name) for name in names)


def called_by_name_problem(name: str, modules: tuple[ModuleType, ...]) -> str | None:
    """How Primus-Turbo's ``name`` (in ``modules``) differs from the way titan-primus calls it, or
    None: gone, without an argument titan-primus passes by name, or with a new one it must be
    given (the first call would fail inside a training step)."""
    _, needed = CALLED_BY_NAME[name]
    fn = next((getattr(m, name) for m in modules if hasattr(m, name)), None)
    if fn is None:
        return f"{name} is not there (titan-primus calls it)"
    parameters = _parameters(fn)
    missing = [n for n in needed if n not in parameters]
    if missing:
        return f"{name} takes no argument {', '.join(missing)}, which titan-primus passes by name"
    unpassed = [n for n, required in parameters.items() if required and n not in needed]
    if unpassed:
        return f"{name} requires {', '.join(unpassed)}, which titan-primus does not pass"
    return None


def _differing_calls(modules: tuple[ModuleType, ...], version: str) -> dict[str, str]:
    """{titan-primus file: why} for each file whose Primus-Turbo calls differ in this build. The
    GEMMs' (autograd.py: every recipe but mxfp8) are the backend's core: a difference there refuses
    the build here; the others refuse only what their file runs (mxfp8, FP8 or bf16 attention)."""
    differs = {}
    for name, (caller, _) in CALLED_BY_NAME.items():
        problem = called_by_name_problem(name, modules)
        if problem and caller not in differs:
            differs[caller] = (
                f"Primus-Turbo {version}: {problem} ({caller}; verified at {', '.join(VERIFIED_BUILDS)}): "
                f"use a verified build, or a titan-primus that supports this one"
            )
    if _AUTOGRAD in differs:
        raise UnsupportedRelease(differs.pop(_AUTOGRAD))
    return differs


def _too_old(why: str) -> str:
    return (
        f"this Primus-Turbo is older than {OLDEST} ({why}); titan-primus drives {OLDEST} and later, "
        f"the releases its tests run Primus-Turbo's own code for; upgrade Primus-Turbo"
    )


def _user_backends(backend_module: ModuleType) -> tuple[str, ...]:
    manager, precision = backend_module.GlobalBackendManager, backend_module.PrecisionType.FP8
    names, autotune = set(), manager.auto_tune_enabled()
    for asked in (manager.get_gemm_backend(precision), manager.get_grouped_gemm_backend(precision)):
        # A BackendType, or (from v0.4.1.dev26) a BackendChoice(backend, auto_tune).
        backend = getattr(asked, "backend", asked)
        autotune |= bool(getattr(asked, "auto_tune", False))
        if backend is not None:
            names.add(backend.name)
    return tuple(sorted(names)) + (("AUTOTUNE",) if autotune else ())


def _load() -> TurboApi:
    if _import_optional(CONFIG_MODULE) is None and _import_optional("primus_turbo.pytorch.core.float8"):
        raise UnsupportedRelease(_too_old("its config enums live in core.float8 (v0.1.x)"))
    turbo = importlib.import_module("primus_turbo.pytorch")
    enums = importlib.import_module(CONFIG_MODULE)
    backend_module = importlib.import_module(BACKEND_MODULE)
    grouped_impl = importlib.import_module(GROUPED_IMPL_MODULE)
    surface = _surface(enums, importlib.import_module(GEMM_OPS_MODULE), grouped_impl.grouped_gemm_fp8_impl)
    version = str(getattr(importlib.import_module("primus_turbo"), "__version__", "unknown"))
    differs = _differing_calls(called_modules(), version)
    if newer_than_verified(version):  # once per load, in the log of the conversion that loads it
        logger.warning("titan-primus: Primus-Turbo %s", describe_build(version))
    api = TurboApi(
        surface=surface,
        version=version,
        enums=enums,
        backend_type=backend_module.BackendType,
        quant=importlib.import_module(QUANT_MODULE),
        gemm=importlib.import_module(GEMM_IMPL_MODULE).gemm_fp8_impl,
        grouped=grouped_impl.grouped_gemm_fp8_impl,
        grouped_variable_k=grouped_impl.grouped_gemm_fp8_variable_k_impl,
        float8_e4m3=turbo.float8_e4m3,
        float8_e5m2=turbo.float8_e5m2,
        user_backends=_user_backends(backend_module),
        origami=importlib.util.find_spec("origami") is not None,
        differs=differs,
    )
    return replace(
        api, min_rows={recipe: min_token_rows(api, recipe) for recipe in ("tensorwise", "rowwise", "blockwise")}
    )


_LOADED: list = []
"""[the loaded API or why it cannot be used], once loaded. A plain global rather than a cache
decorator so that torch.compile traces the lookup instead of the loading."""


def load_api(fresh: bool = False) -> TurboApi | str:
    """The installed Primus-Turbo's API, or why it cannot be used. Loaded once; ``fresh`` reads
    the installation and the environment anew (a new backend instance does)."""
    if fresh:
        _LOADED.clear()
    if not _LOADED:
        try:
            _LOADED.append(_load())
        except UnsupportedRelease as e:
            _LOADED.append(str(e))
        except Exception as e:  # its import can fail in many ways without a GPU / _C extension
            _LOADED.append(f"Primus-Turbo is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}")
    return _LOADED[0]


def forget_api() -> None:
    """Forget the loaded API: the next :func:`load_api` reads the installation and the environment
    anew (a new backend instance, from ``registry.refresh``, does this without importing)."""
    _LOADED.clear()


def api_loaded() -> bool:
    """Whether :func:`load_api` has run since the last :func:`forget_api`."""
    return bool(_LOADED)


def imported() -> bool:
    """Whether this process has imported Primus-Turbo already (importing it again costs nothing)."""
    return "primus_turbo" in sys.modules


def require_api() -> TurboApi:
    api = load_api()
    if isinstance(api, str):
        raise RuntimeError(api)
    return api
