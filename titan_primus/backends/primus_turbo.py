"""Primus-Turbo backend: AMD's FP8 GEMM and grouped-GEMM kernels for MI300-class GPUs.

Adapts to every Primus-Turbo release from v0.2.0 to v0.4.0 (the API surface it relies on is
recorded per tag in tests/data/primus_turbo_api.json). The release is told apart by its
signatures: ``Float8QuantConfig.scale_dtype`` arrived in v0.3.0, ``grouped_gemm_fp8(out_dtype=)``
in v0.3.1, the low-level ``grouped_gemm_fp8_impl(group_offs_out=)`` in v0.4.0. v0.1.x (config
enums at ``core.float8``) is refused: its ``gemm_fp8`` has no ROWWISE path and its formats
predate HYBRID. Primus-Turbo is imported only after the hardware check says the device is
MI300-class: its import needs a ROCm GPU and its compiled extension.

Recipe mapping (titan-primus name -> ``Float8QuantConfig``):
- ``tensorwise`` -> ``format=HYBRID, granularity=TENSORWISE`` (e4m3 forward, e5m2 grad_output,
  matching TorchAO's tensorwise formats; scales are not rounded to powers of two). v0.2.0 rejects
  HYBRID for tensorwise GEMMs, so there tensorwise routes elsewhere.
- ``rowwise`` -> ``format=E4M3, granularity=ROWWISE``.
- ``rowwise_with_gw_hp`` has no Primus-Turbo equivalent (every Primus-Turbo wgrad is FP8).
- ``blockwise`` -> ``format=E4M3, granularity=BLOCKWISE, block_size=128`` (every tag).
- ``mxfp8`` -> ``format=E4M3, granularity=MX_BLOCKWISE, scale_dtype=E8M0, block_size=32``, v0.4.0
  only and gfx950 only (docs/recipes-blocked.md: earlier tags have no grouped MX GEMM and run
  other MX definitions; ``check_mxfp8_support`` asserts gfx950).

The kernels' own limits, per release, become ``supports`` verdicts (so routing picks the next
backend, with the reason): every FP8 GEMM writes bf16/fp16 only; rowwise dense GEMMs run on CK
up to v0.3.1 (contraction dims divisible by 32); the Triton grouped kernels (default from v0.3.1)
need contraction dims >= 256; v0.3.0's tensorwise grouped GEMM has no device kernel for its
mixed-format backward.

Two execution paths (``execution_paths`` says which one each op takes):
- eager: Primus-Turbo's public ops (``gemm_fp8``, ``grouped_gemm_fp8``) and their autograd.
- under ``torch.compile`` (v0.3.0+): an autograd Function built on the low-level custom ops
  Primus-Turbo's own autograd Functions are built from (``primus_turbo::gemm_fp8_impl``,
  ``grouped_gemm_fp8_impl``, ``grouped_gemm_fp8_variable_k_impl``,
  ``primus_turbo_cpp_extension::quantize_fp8_*`` / ``dequantize_fp8_rowwise``), all registered
  with fake implementations, so it traces into the graph: three FP8 GEMMs per op per step, and
  the FP8 operands and their scales are what backward keeps. The public ops are
  ``torch._dynamo.disable``d from v0.3.1 (a hard error in a fullgraph block).
- under ``torch.compile`` at v0.2.0 (no low-level GEMM ops), and for ``mxfp8`` / ``blockwise``
  at every tag: the public ops wrapped in titan-primus custom ops; their backward re-runs the
  forward under autograd (four FP8 GEMMs per op per step, bf16 inputs saved).

A linear weight FSDP2 all-gathered in FP8 (``enable_fsdp_float8_all_gather``; tensorwise from
v0.3.0, rowwise from v0.3.1) takes the low-level path, eager or compiled: ``gemm_fp8_impl``
receives the gathered payload and ``scale_inv = fl(1 / scale)``, exactly what
``quantize_fp8_*`` would have made of the gathered bf16 weight.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch

from ..device import DeviceProfile
from ..fsdp_fp8 import Fp8GatheredWeight
from ..grouping import group_lens, zero_trailing_rows
from ..recipes import RECIPE_NAMES, Fp8Recipe, has_definition, make_recipe, sixteen_bit
from .base import Fp8Backend, Op, Verdict

__all__ = ["PrimusTurboBackend", "CONFIG_MODULES", "OPS_MODULE", "LOW_LEVEL_OPS", "load_api"]

OPS_MODULE = "primus_turbo.pytorch"
CONFIG_MODULES = ("primus_turbo.pytorch.core.low_precision", "primus_turbo.pytorch.core.float8")
BACKEND_ENUM_MODULE = "primus_turbo.pytorch.core.backend"
LOW_LEVEL_OPS = {  # name -> module defining it (v0.3.0+)
    "gemm_fp8_impl": "primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl",
    "grouped_gemm_fp8_impl": "primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl",
    "grouped_gemm_fp8_variable_k_impl": "primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl",
}
CPP_EXTENSION = "primus_turbo_cpp_extension"
_ALIGNMENT = 16
_CK_ALIGNMENT = 32
_TRITON_GROUPED_MIN_K = 256
_QUANT = {"tensorwise": ("HYBRID", "TENSORWISE"), "rowwise": ("E4M3", "ROWWISE")}
_BLOCKWISE_SIZE = 128
_BLOCK_RECIPES = ("mxfp8", "blockwise")
_MX_SIZE = 32
_MX_MIN_RELEASE = "v0.4.0"
_MX_K_ALIGNMENT = 128
INSTALL_HINT = "build it from source against ROCm (github.com/AMD-AGI/Primus-Turbo)"


class UnsupportedRelease(Exception):
    """An importable Primus-Turbo this adapter does not drive."""


@dataclass(frozen=True)
class _LowLevelOps:
    """The low-level custom ops and the enum values they take as ints."""

    gemm: object
    grouped: object
    grouped_variable_k: object
    quantize_tensorwise: object
    quantize_rowwise: object
    dequantize_rowwise: object | None
    """v0.3.1+; None where backward copies are quantized from the high-precision tensors."""
    granularity: dict  # recipe -> ScalingGranularity value
    dense_backend: dict  # recipe -> BackendType value Primus-Turbo's own dense GEMM defaults to
    grouped_backend: int


@dataclass(frozen=True)
class _TurboApi:
    release: str
    """The oldest recorded tag with this API surface: v0.2.0, v0.3.0, v0.3.1 or v0.4.0."""
    gemm_fp8: object
    grouped_gemm_fp8: object
    configs: dict
    float8_e4m3: torch.dtype
    float8_e5m2: torch.dtype
    low_level: _LowLevelOps | None

    def at_least(self, tag: str) -> bool:
        return _version_key(self.release) >= _version_key(tag)

    @property
    def definition(self) -> str:
        return "primus_turbo" if self.at_least("v0.3.1") else "primus_turbo_v0.2"

    @property
    def ck_rowwise_dense(self) -> bool:
        """Rowwise dense GEMMs run on CK (v0.2.0 hard-coded, v0.3.0 default, v0.3.1 fallback:
        hipBLASLt has no rowwise); v0.4.0 defaults to Triton."""
        return not self.at_least("v0.4.0")

    @property
    def triton_grouped(self) -> bool:
        return self.at_least("v0.3.1")

    def formats(self, recipe: str) -> tuple[torch.dtype, torch.dtype]:
        """(forward, grad_output) FP8 dtypes of Format.HYBRID / Format.E4M3."""
        return (self.float8_e4m3, self.float8_e5m2 if recipe == "tensorwise" else self.float8_e4m3)


def _version_key(tag: str) -> tuple[int, ...]:
    return tuple(int(p) for p in tag.removeprefix("v").split("."))


def _import_optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _schema_arguments(op) -> list[str]:
    """Argument names of a ``torch.library.custom_op`` (its registered schema)."""
    return [a.name for a in op._opoverload._schema.arguments]


def _load_low_level(config_module: ModuleType, release: str) -> _LowLevelOps | None:
    found = {}
    for name, module_name in LOW_LEVEL_OPS.items():
        module = _import_optional(module_name)
        found[name] = getattr(module, name, None) if module else None
    backend_enum = _import_optional(BACKEND_ENUM_MODULE)
    if None in found.values() or backend_enum is None:
        return None  # v0.2.0
    cpp = getattr(torch.ops, CPP_EXTENSION)
    granularity = config_module.ScalingGranularity
    BackendType = backend_enum.BackendType
    # The kernels Primus-Turbo's own autograd Functions end up on (ops/gemm_fp8.py,
    # ops/grouped_gemm_fp8.py at each tag), so both paths run the same ones: v0.3.1's rowwise
    # asks for hipBLASLt, which has no rowwise, and falls back to CK; CK is named directly here.
    rowwise_dense = BackendType.CK if _version_key(release) < _version_key("v0.4.0") else BackendType.TRITON
    grouped = BackendType.CK if release == "v0.3.0" else BackendType.TRITON
    return _LowLevelOps(
        gemm=found["gemm_fp8_impl"],
        grouped=found["grouped_gemm_fp8_impl"],
        grouped_variable_k=found["grouped_gemm_fp8_variable_k_impl"],
        quantize_tensorwise=cpp.quantize_fp8_tensorwise,
        quantize_rowwise=cpp.quantize_fp8_rowwise,
        dequantize_rowwise=cpp.dequantize_fp8_rowwise if _version_key(release) >= _version_key("v0.3.1") else None,
        granularity={"tensorwise": granularity.TENSORWISE.value, "rowwise": granularity.ROWWISE.value},
        dense_backend={"tensorwise": BackendType.HIPBLASLT.value, "rowwise": rowwise_dense.value},
        grouped_backend=grouped.value,
    )


def _load_api_uncached() -> _TurboApi:
    turbo = importlib.import_module(OPS_MODULE)
    config_module = _import_optional(CONFIG_MODULES[0])
    if config_module is None:
        if _import_optional(CONFIG_MODULES[1]) is not None:
            raise UnsupportedRelease(
                "Primus-Turbo v0.1.x (config enums in core.float8) is not supported: its gemm_fp8 has no "
                "ROWWISE path; upgrade Primus-Turbo to >= v0.2.0"
            )
        raise ImportError(f"none of {', '.join(CONFIG_MODULES)} imports")
    Float8QuantConfig = config_module.Float8QuantConfig
    configs = {
        recipe: Float8QuantConfig(
            format=getattr(config_module.Format, fmt),
            granularity=getattr(config_module.ScalingGranularity, granularity),
        )
        for recipe, (fmt, granularity) in _QUANT.items()
    }
    grouped = turbo.ops.grouped_gemm_fp8
    if "scale_dtype" not in inspect.signature(Float8QuantConfig).parameters:
        release = "v0.2.0"
    elif "out_dtype" not in inspect.signature(grouped).parameters:
        release = "v0.3.0"
    else:
        release = "v0.3.1"
    low_level = _load_low_level(config_module, release)
    if low_level and release == "v0.3.1" and "group_offs_out" in _schema_arguments(low_level.grouped):
        release = "v0.4.0"
        low_level = _load_low_level(config_module, release)
    configs.update(_block_configs(config_module, release))
    return _TurboApi(
        release=release,
        gemm_fp8=turbo.ops.gemm_fp8,
        grouped_gemm_fp8=grouped,
        configs=configs,
        float8_e4m3=turbo.float8_e4m3,
        float8_e5m2=turbo.float8_e5m2,
        low_level=low_level,
    )


def _block_configs(config_module: ModuleType, release: str) -> dict:
    """The ``Float8QuantConfig`` of each block-scaled recipe this release runs (its
    ``__post_init__`` asserts block_size for BLOCKWISE, and block 32 with E8M0 for MX_BLOCKWISE)."""
    Float8QuantConfig, Format = config_module.Float8QuantConfig, config_module.Format
    granularity = config_module.ScalingGranularity
    configs = {"blockwise": Float8QuantConfig(format=Format.E4M3, granularity=granularity.BLOCKWISE,
                                              block_size=_BLOCKWISE_SIZE)}
    if _version_key(release) >= _version_key(_MX_MIN_RELEASE):
        configs["mxfp8"] = Float8QuantConfig(format=Format.E4M3, granularity=granularity.MX_BLOCKWISE,
                                             scale_dtype=config_module.ScaleDtype.E8M0, block_size=_MX_SIZE)
    return configs


def _block_refusal(recipe: str, device: DeviceProfile, release: str, k: int | None, n: int | None) -> str | None:
    """Why Primus-Turbo ``release`` cannot run block-scaled ``recipe`` here, or None
    (docs/recipes-blocked.md has the upstream rules per tag)."""
    if recipe == "mxfp8":
        if _version_key(release) < _version_key(_MX_MIN_RELEASE):
            return (f"Primus-Turbo {release} has no grouped MX GEMM and its dense MX GEMM runs another definition "
                    f"(1x32 weights or backward from dequantized copies); upgrade Primus-Turbo to >= {_MX_MIN_RELEASE}")
        if device.arch != "gfx950":
            return (f"Primus-Turbo's MX GEMMs need MX hardware (check_mxfp8_support: gfx950 or newer); "
                    f"this is {device.arch}; use recipe 'blockwise' here")
        dims = (("K", k, _MX_K_ALIGNMENT), ("N", n, _ALIGNMENT))
        rule = f"K divisible by {_MX_K_ALIGNMENT} (its hipBLASLt MX path) and N by {_ALIGNMENT}"
    else:
        dims = (("K", k, _BLOCKWISE_SIZE), ("N", n, _BLOCKWISE_SIZE))
        rule = f"K and N divisible by its {_BLOCKWISE_SIZE} block"
    bad = [f"{name}={dim}" for name, dim, multiple in dims if dim is not None and dim % multiple]
    if bad:
        return f"Primus-Turbo's {recipe} GEMMs need {rule} ({', '.join(bad)})"
    return None


_LOADED: list = []
"""[the loaded API or why it cannot be used], once loaded. A plain global rather than a cache
decorator so that torch.compile traces the lookup instead of the loading."""


def load_api() -> _TurboApi | str:
    """The installed Primus-Turbo's API, or why it cannot be used. Loaded once; a new backend
    instance (``registry.refresh``) loads it anew. The custom ops and autograd Functions below
    read it here, so they need no registry."""
    if not _LOADED:
        try:
            _LOADED.append(_load_api_uncached())
        except UnsupportedRelease as e:
            _LOADED.append(str(e))
        except Exception as e:  # its import can fail in many ways without a GPU / _C extension
            _LOADED.append(f"Primus-Turbo is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}")
    return _LOADED[0]


def _require_api() -> _TurboApi:
    api = load_api()
    if isinstance(api, str):
        raise RuntimeError(api)
    return api


class PrimusTurboBackend(Fp8Backend):
    name = "primus_turbo"
    recipes = RECIPE_NAMES  # rowwise_with_gw_hp is refused in supports(), with the reason

    def __init__(self):
        _LOADED.clear()  # a fresh backend (registry.refresh) reads the environment anew

    @cached_property
    def _api(self) -> _TurboApi | str:
        """The loaded API, or why it cannot be used."""
        return load_api()

    def rank(self, device: DeviceProfile) -> int:
        return 300 if device.mi300_class else 0

    def availability(self, device: DeviceProfile) -> Verdict:
        if not device.mi300_class:
            return Verdict.no(
                f"Primus-Turbo runs only on AMD MI300-class GPUs (gfx942, gfx950); this is {device.arch}"
            )
        if isinstance(self._api, str):
            return Verdict.no(self._api)
        return Verdict.yes(f"Primus-Turbo {self._api.release} API on {device.arch}")

    def supports(self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None) -> Verdict:
        if not has_definition(recipe, "primus_turbo"):
            return Verdict.no(
                f"Primus-Turbo has no {recipe!r} recipe (its wgrad is always FP8); "
                f"use recipe 'rowwise' to run on Primus-Turbo"
            )
        api = self._api
        if isinstance(api, str):
            return Verdict.no(api)
        if recipe == "tensorwise" and not api.at_least("v0.3.0"):
            return Verdict.no(
                "Primus-Turbo v0.2.x rejects Format.HYBRID (e5m2 grads) for tensorwise GEMMs; "
                "upgrade Primus-Turbo to >= v0.3.0 or use recipe 'rowwise'"
            )
        if op == "grouped_mm" and recipe == "tensorwise" and api.release == "v0.3.0":
            return Verdict.no(
                "Primus-Turbo v0.3.0 has no device kernel for a tensorwise (HYBRID) grouped backward: it falls "
                "back to one hipBLASLt launch per expert reading group_lens on the host; upgrade Primus-Turbo "
                "to >= v0.3.1 or use recipe 'rowwise'"
            )
        if recipe in _BLOCK_RECIPES:
            refusal = _block_refusal(recipe, device, api.release, k, n)
            if refusal:
                return Verdict.no(refusal)
        bad = [f"{name}={dim}" for name, dim in (("K", k), ("N", n)) if dim is not None and dim % _ALIGNMENT]
        if bad:
            return Verdict.no(f"Primus-Turbo's FP8 GEMMs need K and N divisible by {_ALIGNMENT} ({', '.join(bad)})")
        if op == "linear" and recipe == "rowwise" and api.ck_rowwise_dense:
            # v0.2.0 pads the forward's K to 128 in Python; its dgrad (over N) is not padded.
            dims = (("N", n),) if api.release == "v0.2.0" else (("K", k), ("N", n))
            bad = [f"{name}={dim}" for name, dim in dims if dim is not None and dim % _CK_ALIGNMENT]
            if bad:
                return Verdict.no(
                    f"Primus-Turbo {api.release} runs rowwise dense GEMMs on CK, which needs each contraction "
                    f"dim (K forward, N dgrad) divisible by {_CK_ALIGNMENT} ({', '.join(bad)}); "
                    f"Primus-Turbo >= v0.4.0 runs them on Triton"
                )
        # The tensorwise, rowwise and blockwise Triton grouped kernels state it; v0.4.0's MX one
        # (_grouped_mxfp8_persistent_gemm_kernel in triton/grouped_gemm/grouped_gemm_fp8_kernel.py) does not.
        if op == "grouped_mm" and api.triton_grouped and recipe != "mxfp8":
            small = [f"{name}={dim}" for name, dim in (("K", k), ("N", n)) if dim is not None and dim < _TRITON_GROUPED_MIN_K]
            if small:
                return Verdict.no(
                    f"Primus-Turbo's Triton grouped FP8 kernels assume at least two 128-wide K blocks "
                    f"(tl.assume(loop_k > 1)): contraction dims (K forward, N dgrad) under "
                    f"{_TRITON_GROUPED_MIN_K} are undefined behaviour there ({', '.join(small)})"
                )
        return Verdict.yes()

    def _definition(self) -> str:
        return self._api.definition if isinstance(self._api, _TurboApi) else "primus_turbo"

    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        return make_recipe(recipe, self._definition(), device)

    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        if recipe.definition != self._definition():
            return Verdict.no(
                f"the installed Primus-Turbo runs the {self._definition()} definition of {recipe.name!r}, "
                f"not the {recipe.definition} one"
            )
        return Verdict.yes()

    def execution_paths(self) -> dict[str, str] | None:
        """How each op runs, eager and compiled (None when Primus-Turbo is not usable)."""
        api = self._api
        if isinstance(api, str):
            return None
        public = "Primus-Turbo's public ops (gemm_fp8 / grouped_gemm_fp8) and their autograd"
        if api.low_level:
            compiled = ("Primus-Turbo's low-level custom ops (gemm_fp8_impl, grouped_gemm_fp8_impl, "
                        "grouped_gemm_fp8_variable_k_impl, quantize_fp8_*): 3 FP8 GEMMs per op, FP8 operands saved")
        else:
            compiled = (f"the public ops inside a titan-primus custom op (Primus-Turbo {api.release} has no "
                        f"low-level GEMM ops): backward re-runs the forward, 4 FP8 GEMMs per op, bf16 inputs saved")
        blocked = ("the public ops inside a titan-primus custom op: backward re-runs the forward, "
                   "4 FP8 GEMMs per op, bf16 inputs saved")
        return {"eager": public, "compiled": compiled, "compiled, mxfp8 / blockwise": blocked}

    def takes_gathered_fp8_weight(self, recipe: Fp8Recipe, op: Op = "linear") -> Verdict:
        api = self._api
        why = None
        if isinstance(api, str):
            why = api
        elif not api.low_level:
            why = (f"Primus-Turbo {api.release} has no low-level GEMM op (gemm_fp8_impl) to feed an FP8 "
                   f"weight to, and its gemm_fp8 quantizes every input itself; upgrade to >= v0.3.0")
        elif not self.accepts(recipe):
            why = self.accepts(recipe).reason
        elif recipe.name not in _QUANT:
            why = f"Primus-Turbo's {recipe.name!r} GEMMs are not wired to a pre-quantized weight"
        elif recipe.name == "rowwise" and api.low_level.dequantize_rowwise is None:
            why = (f"Primus-Turbo {api.release} quantizes backward's column copy of the weight from the "
                   f"high-precision weight, not from its FP8 copy (that arrived in v0.3.1)")
        if why:
            return Verdict.no(f"the primus_turbo backend cannot take a pre-quantized weight: {why}")
        kernel, other = ("gemm_fp8_impl", "x") if op == "linear" else ("grouped_gemm_fp8_impl", "A")
        return Verdict.yes(f"Primus-Turbo {api.release}'s {kernel} takes the gathered FP8 weight and its "
                           f"scale_inv; only {other} is quantized")

    def gathered_weight(self, data, scale, dtype, recipe, source_dtype=None):
        return Fp8GatheredWeight(data, scale, dtype, recipe.reciprocal_scales, source_dtype)

    def linear(self, x, weight, bias, recipe, shards=None):  # no TP scales: TP is refused
        api = _require_api()
        if isinstance(weight, Fp8GatheredWeight):
            # FSDP2 gathered it in FP8 (only where takes_gathered_fp8_weight said so): the
            # public ops would quantize it again, the low-level ops take it as it is.
            out = _LowLevelLinear.apply(x, weight, recipe.name)
        elif not torch.compiler.is_compiling():
            out = _gemm(api, x, weight, recipe.name)
        elif api.low_level and not recipe.block_scaled:
            out = _LowLevelLinear.apply(x, weight, recipe.name)
        else:
            out = torch.ops.titan_primus.primus_turbo_linear(x, weight, recipe.name)
        # Bias stays out of the FP8 GEMM: added in the activations' precision.
        return out if bias is None else out + bias.to(out.dtype)

    def grouped_mm(self, A, B_t, offs, recipe):
        api = _require_api()
        # Rows past offs[-1] (TorchTitan's padding) must stay out of every amax (tensorwise, and
        # the column scales of the wgrad): zero them in the input; its backward drops their
        # gradient (left unwritten by the dgrad kernel before v0.4.0).
        A = zero_trailing_rows(A, offs)
        if isinstance(B_t, Fp8GatheredWeight):  # FSDP2 gathered it in FP8: as for linear
            out = _LowLevelGroupedMM.apply(A, B_t, offs, recipe.name)
        elif not torch.compiler.is_compiling():
            out = _grouped_mm(api, A, B_t, offs, recipe.name)
        elif api.low_level and not recipe.block_scaled:
            out = _LowLevelGroupedMM.apply(A, B_t, offs, recipe.name)
        else:
            out = torch.ops.titan_primus.primus_turbo_grouped_mm(A, B_t, offs, recipe.name)
        # v0.4.0 zeroes the output rows past the groups itself; the mask stays for its backward,
        # which keeps those rows' incoming gradient out of grad_output's amaxes (the kernels
        # still take them in).
        return zero_trailing_rows(out, offs)


def _group_offs(offs: torch.Tensor) -> torch.Tensor:
    """Primus-Turbo's ``group_offs`` ([0, cumsum(group_lens)], int64) from TorchTitan's end
    offsets, without a host sync (Primus-Turbo would recompute it from group_lens)."""
    return torch.cat([offs.new_zeros(1), offs]).to(torch.int64)


def _gemm(api: _TurboApi, x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    out = api.gemm_fp8(x, weight, trans_a=False, trans_b=True, out_dtype=sixteen_bit(x.dtype),
                       config=api.configs[recipe])
    return out.to(x.dtype)


def _grouped_mm(api: _TurboApi, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    if api.at_least("v0.3.1"):
        # A contiguous [E, K, N] B_t is taken as it is (trans_b=False); TorchTitan's transposed
        # view of [E, N, K] weights as its contiguous transpose (trans_b=True): no copy either way.
        # MX grouped GEMMs take the NT layout only (FP8GroupedGemmMXFunc asserts trans_b).
        b, trans_b = _b_layout(B_t, nt_only=recipe == "mxfp8")
        return api.grouped_gemm_fp8(A, b, group_lens(offs), group_offs=_group_offs(offs), trans_b=trans_b,
                                    out_dtype=torch.bfloat16, config=api.configs[recipe])
    # Before v0.3.1 the output dtype follows A, and A and B must be bf16/fp16.
    b, trans_b = _b_layout(B_t.to(torch.bfloat16))
    return api.grouped_gemm_fp8(A.to(torch.bfloat16), b, group_lens(offs), group_offs=_group_offs(offs),
                                trans_b=trans_b, config=api.configs[recipe])


def _b_layout(B_t: torch.Tensor, nt_only: bool = False) -> tuple[torch.Tensor, bool]:
    """(b, trans_b) for a [E, K, N] ``B_t`` without a copy where its layout allows one;
    ``nt_only``: always trans_b=True ([E, N, K] b), copying where B_t is a contiguous [E, K, N]."""
    b = B_t.transpose(-2, -1)
    if nt_only:
        return b.contiguous(), True
    if B_t.is_contiguous():
        return B_t, False
    return (b, True) if b.is_contiguous() else (B_t.contiguous(), False)


# ---- compiled path on the low-level ops (v0.3.0+) ------------------------------------------------
# The same algorithm as Primus-Turbo's FP8GemmTensorFunction / FP8GemmRowFunction and the grouped
# FP8GroupedGemmTensorFunc / FP8GroupedGemmRowFunc (ops/gemm_fp8.py, ops/grouped_gemm_fp8.py):
# rowwise forward operands are quantized per row over the contraction dim, and backward takes
# column-wise copies (quantized over the other dim) made in the forward, from the forward FP8
# copy dequantized (v0.3.1+) or from the input itself (v0.3.0). Tensorwise keeps the forward
# copies. Only FP8 data and fp32 scales are saved for backward.


def _quantize(ops: _LowLevelOps, t: torch.Tensor, dtype: torch.dtype, axis: int | None):
    if axis is None:
        return ops.quantize_tensorwise(t, dtype, None)
    return ops.quantize_rowwise(t.contiguous(), dtype, axis, None)


def _weight_operand(ops: _LowLevelOps, weight: torch.Tensor, dtype: torch.dtype, axis: int | None):
    """The forward FP8 weight and its scale_inv: the one FSDP2 gathered (the same cast:
    quantize_fp8_* computes ``scale_inv = 1.0f / scale``, csrc/pytorch/quantization), or quantized here."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight.fp8_data(), weight.scale_inv()
    return _quantize(ops, weight, dtype, axis)


def _column_copy(ops: _LowLevelOps, t, q, scale_inv, dtype, row_axis: int, col_axis: int):
    source = t if ops.dequantize_rowwise is None else ops.dequantize_rowwise(q, scale_inv, row_axis, t.dtype)
    return _quantize(ops, source, dtype, col_axis)


class _LowLevelLinear(torch.autograd.Function):
    """x [M, K] @ weight [N, K].T on Primus-Turbo's low-level ops; ``weight`` may be one FSDP2
    gathered in FP8 (then only x is quantized, and rowwise backward re-quantizes the gathered
    copy dequantized, as it does its own forward copy)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: str):
        api = _require_api()
        ops, (fwd, _) = api.low_level, api.formats(recipe)
        rowwise = recipe == "rowwise"
        row, col = (-1, -2) if rowwise else (None, None)
        granularity, backend, out_dtype = ops.granularity[recipe], ops.dense_backend[recipe], sixteen_bit(x.dtype)
        xq, sx = _quantize(ops, x, fwd, row)
        wq, sw = _weight_operand(ops, weight, fwd, row)
        out = ops.gemm(xq, sx, False, wq, sw, True, out_dtype, False, granularity, backend)
        if rowwise:
            xq, sx = _column_copy(ops, x, xq, sx, fwd, row, col)
            wq, sw = _column_copy(ops, weight, wq, sw, fwd, row, col)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, weight.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xq, sx, wq, sw = ctx.saved_tensors
        api = _require_api()
        ops, (_, bwd) = api.low_level, api.formats(ctx.recipe)
        row, col = (-1, -2) if ctx.recipe == "rowwise" else (None, None)
        granularity, backend = ops.granularity[ctx.recipe], ops.dense_backend[ctx.recipe]
        # The gradient of the kernel's 16-bit output, as Primus-Turbo's own autograd (the eager
        # path) receives it when fp32 activations get a bf16 result upcast.
        out_dtype = sixteen_bit(grad.dtype)
        grad = grad.to(out_dtype)
        gq, sg = _quantize(ops, grad, bwd, row)
        grad_x = ops.gemm(gq, sg, False, wq, sw, False, out_dtype, False, granularity, backend)  # [M, K]
        if row is not None:
            gq, sg = _quantize(ops, grad, bwd, col)
        grad_w = ops.gemm(xq, sx, True, gq, sg, False, out_dtype, True, granularity, backend)  # [N, K]
        x_dtype, w_dtype = ctx.dtypes
        return grad_x.to(x_dtype), grad_w.to(w_dtype), None


class _LowLevelGroupedMM(torch.autograd.Function):
    """A [R, K] x B_t [E, K, N] per group of rows (offs: int32 end offsets) -> [R, N] bf16;
    ``B_t`` may be expert weights FSDP2 gathered in FP8 (then only A is quantized)."""

    @staticmethod
    def forward(ctx, A, B_t, offs, recipe: str):
        api = _require_api()
        ops, (fwd, _) = api.low_level, api.formats(recipe)
        rowwise = recipe == "rowwise"
        b, trans_b = _b_layout(B_t)
        b_row, b_col = (-1, -2) if trans_b else (-2, -1)  # over K, over N
        lens, goffs = group_lens(offs), _group_offs(offs)
        granularity, backend = ops.granularity[recipe], ops.grouped_backend
        aq, sa = _quantize(ops, A, fwd, -1 if rowwise else None)
        bq, sb = _weight_operand(ops, b, fwd, b_row if rowwise else None)
        out = ops.grouped(aq, bq, sa, sb, lens, goffs, False, trans_b, torch.bfloat16, granularity, None, backend)
        if rowwise:
            aq, sa = _column_copy(ops, A, aq, sa, fwd, -1, -2)  # per k over all rows of all groups
            bq, sb = _column_copy(ops, b, bq, sb, fwd, b_row, b_col)
        ctx.save_for_backward(aq, sa, bq, sb, lens, goffs)
        ctx.recipe, ctx.trans_b, ctx.dtypes = recipe, trans_b, (A.dtype, B_t.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        aq, sa, bq, sb, lens, goffs = ctx.saved_tensors
        api = _require_api()
        ops, (_, bwd) = api.low_level, api.formats(ctx.recipe)
        rowwise = ctx.recipe == "rowwise"
        granularity, backend, trans_b = ops.granularity[ctx.recipe], ops.grouped_backend, ctx.trans_b
        gq, sg = _quantize(ops, grad, bwd, -1 if rowwise else None)
        grad_A = ops.grouped(gq, bq, sg, sb, lens, goffs, False, not trans_b, torch.bfloat16, granularity, None, backend)
        if rowwise:
            gq, sg = _quantize(ops, grad, bwd, -2)
        grad_b = ops.grouped_variable_k(aq, gq, sa, sg, lens, goffs, True, False, trans_b, torch.bfloat16,
                                        granularity, None, backend)
        grad_B_t = grad_b.transpose(-2, -1) if trans_b else grad_b
        A_dtype, B_dtype = ctx.dtypes
        return grad_A.to(A_dtype), grad_B_t.to(B_dtype), None, None


# ---- compiled path at v0.2.0: the public ops as opaque custom ops ----------------------------------
# Their backward re-runs the forward under autograd (one extra FP8 GEMM per op in backward):
# v0.2.0 has no low-level GEMM ops to build a traceable backward from.


@contextlib.contextmanager
def _autograd_inside_custom_op():
    """A custom op's kernel runs with autograd dispatch excluded; re-include it so the backward
    can differentiate through Primus-Turbo's own autograd Function."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _vjp(fn, grad: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with _autograd_inside_custom_op():
        leaves = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, grad)


@torch.library.custom_op("titan_primus::primus_turbo_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    return _gemm(_require_api(), x, weight, recipe)


@_linear_op.register_fake
def _(x, weight, recipe):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("titan_primus::primus_turbo_linear_backward", mutates_args=())
def _linear_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor]:
    api = _require_api()
    return _vjp(lambda x, w: _gemm(api, x, w, recipe), grad, x, weight)


@_linear_backward_op.register_fake
def _(grad, x, weight, recipe):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("titan_primus::primus_turbo_grouped_mm", mutates_args=())
def _grouped_op(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    return _grouped_mm(_require_api(), A, B_t, offs, recipe)


@_grouped_op.register_fake
def _(A, B_t, offs, recipe):
    return A.new_empty((A.shape[0], B_t.shape[2]), dtype=torch.bfloat16)


@torch.library.custom_op("titan_primus::primus_turbo_grouped_mm_backward", mutates_args=())
def _grouped_backward_op(
    grad: torch.Tensor, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor]:
    api = _require_api()
    return _vjp(lambda a, b: _grouped_mm(api, a, b, offs, recipe), grad, A, B_t)


@_grouped_backward_op.register_fake
def _(grad, A, B_t, offs, recipe):
    return torch.empty_like(A), torch.empty_like(B_t)


def _save_inputs(ctx, inputs, output):
    *tensors, ctx.recipe = inputs
    ctx.save_for_backward(*tensors)


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    return (*_linear_backward_op(grad, x, weight, ctx.recipe), None)


def _grouped_backward(ctx, grad):
    A, B_t, offs = ctx.saved_tensors
    grad_A, grad_B = _grouped_backward_op(grad, A, B_t, offs, ctx.recipe)
    return grad_A, grad_B, None, None


_linear_op.register_autograd(_linear_backward, setup_context=_save_inputs)
_grouped_op.register_autograd(_grouped_backward, setup_context=_save_inputs)
