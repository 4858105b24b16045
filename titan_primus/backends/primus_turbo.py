"""Primus-Turbo backend: AMD's FP8 GEMM and grouped-GEMM kernels for MI300-class GPUs.

Adapts to every Primus-Turbo release from v0.2.0 to v0.4.0 (the API surface it relies on is
recorded per tag in tests/data/primus_turbo_api.json) and to both homes of its config enums
(``core.float8`` in v0.1.x, ``core.low_precision`` from v0.2.0). The release is told apart by its
signatures: ``Float8QuantConfig.scale_dtype`` arrived in v0.3.0, ``grouped_gemm_fp8(out_dtype=)``
in v0.3.1 (v0.4.0 kept v0.3.1's signatures). Primus-Turbo is imported only after the hardware
check says the device is MI300-class: its import needs a ROCm GPU and its compiled extension.

Recipe mapping (titan-primus name -> ``Float8QuantConfig``):
- ``tensorwise`` -> ``format=HYBRID, granularity=TENSORWISE`` (e4m3 forward, e5m2 grad_output,
  matching TorchAO's tensorwise formats; scales are not rounded to powers of two)
- ``rowwise`` -> ``format=E4M3, granularity=ROWWISE``
  Primus-Turbo v0.2.0 rejects HYBRID for tensorwise GEMMs, so there tensorwise routes elsewhere.
- ``rowwise_with_gw_hp`` has no Primus-Turbo equivalent (every Primus-Turbo wgrad is FP8): the
  backend reports it unsupported, so routing falls back to TorchAO or the emulation, and a
  strict converter refuses it.
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
from ..grouping import group_lens, zero_trailing_rows
from ..recipes import Fp8Recipe, has_definition, make_recipe
from .base import Fp8Backend, Op, Verdict

__all__ = ["PrimusTurboBackend", "CONFIG_MODULES", "OPS_MODULE"]

OPS_MODULE = "primus_turbo.pytorch"
CONFIG_MODULES = ("primus_turbo.pytorch.core.low_precision", "primus_turbo.pytorch.core.float8")
_ALIGNMENT = 16
_QUANT = {"tensorwise": ("HYBRID", "TENSORWISE"), "rowwise": ("E4M3", "ROWWISE")}
INSTALL_HINT = "build it from source against ROCm (github.com/AMD-AGI/Primus-Turbo)"


@dataclass(frozen=True)
class _TurboApi:
    gemm_fp8: object
    grouped_gemm_fp8: object
    configs: dict
    hybrid_tensorwise: bool
    """v0.3.0+: Format.HYBRID works with TENSORWISE (v0.2.0 raises ValueError)."""
    v031_or_later: bool
    """v0.3.1+: grouped_gemm_fp8 takes out_dtype, and rowwise backward re-quantizes from FP8."""

    @property
    def definition(self) -> str:
        return "primus_turbo" if self.v031_or_later else "primus_turbo_v0.2"


def _load_api() -> _TurboApi:
    turbo = importlib.import_module(OPS_MODULE)
    config_module: ModuleType | None = None
    for name in CONFIG_MODULES:
        try:
            config_module = importlib.import_module(name)
            break
        except ImportError:
            continue
    if config_module is None:
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
    return _TurboApi(
        gemm_fp8=turbo.ops.gemm_fp8,
        grouped_gemm_fp8=grouped,
        configs=configs,
        hybrid_tensorwise="scale_dtype" in inspect.signature(Float8QuantConfig).parameters,
        v031_or_later="out_dtype" in inspect.signature(grouped).parameters,
    )


class PrimusTurboBackend(Fp8Backend):
    name = "primus_turbo"

    @cached_property
    def _api(self) -> _TurboApi | str:
        """The loaded API, or why it could not be loaded."""
        try:
            return _load_api()
        except Exception as e:  # its import can fail in many ways without a GPU / _C extension
            return f"Primus-Turbo is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"

    def rank(self, device: DeviceProfile) -> int:
        return 300 if device.mi300_class else 0

    def availability(self, device: DeviceProfile) -> Verdict:
        if not device.mi300_class:
            return Verdict.no(
                f"Primus-Turbo runs only on AMD MI300-class GPUs (gfx942, gfx950); this is {device.arch}"
            )
        if isinstance(self._api, str):
            return Verdict.no(self._api)
        return Verdict.yes(f"Primus-Turbo kernels on {device.arch}")

    def supports(self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None) -> Verdict:
        if not has_definition(recipe, "primus_turbo"):
            return Verdict.no(
                f"Primus-Turbo has no {recipe!r} recipe (its wgrad is always FP8); "
                f"use recipe 'rowwise' to run on Primus-Turbo"
            )
        if recipe == "tensorwise" and isinstance(self._api, _TurboApi) and not self._api.hybrid_tensorwise:
            return Verdict.no(
                "Primus-Turbo v0.2.x rejects Format.HYBRID (e5m2 grads) for tensorwise GEMMs; "
                "upgrade Primus-Turbo to >= v0.3.0 or use recipe 'rowwise'"
            )
        bad = [f"{name}={dim}" for name, dim in (("K", k), ("N", n)) if dim is not None and dim % _ALIGNMENT]
        if bad:
            return Verdict.no(f"Primus-Turbo's FP8 GEMMs need K and N divisible by {_ALIGNMENT} ({', '.join(bad)})")
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

    def _loaded(self) -> _TurboApi:
        api = self._api
        if isinstance(api, str):
            raise RuntimeError(api)
        return api

    def linear(self, x, weight, bias, recipe, shards=None):  # no TP scales: TP is refused
        if torch.compiler.is_compiling():
            out = torch.ops.titan_primus.primus_turbo_linear(x, weight, recipe.name)
        else:  # eager: Primus-Turbo's own autograd, no recomputation
            out = _gemm(self._loaded(), x, weight, recipe.name)
        # Bias stays out of the FP8 GEMM: added in the activations' precision.
        return out if bias is None else out + bias.to(out.dtype)

    def grouped_mm(self, A, B_t, offs, recipe):
        # Its output is torch.empty and rows past sum(group_lens) are never written before v0.4
        # (upstream issue #397): mask them in the input (so their gradient is dropped and they
        # stay out of every amax) and in the output.
        A = zero_trailing_rows(A, offs)
        if torch.compiler.is_compiling():
            out = torch.ops.titan_primus.primus_turbo_grouped_mm(A, B_t, offs, recipe.name)
        else:
            out = _grouped_mm(self._loaded(), A, B_t, offs, recipe.name)
        return zero_trailing_rows(out, offs)


def _gemm(api: _TurboApi, x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    return api.gemm_fp8(x, weight, trans_a=False, trans_b=True, out_dtype=x.dtype, config=api.configs[recipe])


def _grouped_mm(api: _TurboApi, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    # Before v0.3.1 the output dtype follows A, and A and B must be bf16/fp16.
    extra = {"out_dtype": torch.bfloat16} if api.v031_or_later else {}
    return api.grouped_gemm_fp8(
        A.to(torch.bfloat16),
        B_t.transpose(-2, -1).to(torch.bfloat16).contiguous(),  # [E, N, K], as trans_b=True expects
        group_lens(offs),
        trans_b=True,
        config=api.configs[recipe],
        **extra,
    )


# Under torch.compile the Primus-Turbo ops are opaque custom ops. Since v0.3.1 Primus-Turbo
# decorates them torch._dynamo.disable, which is a hard error inside a fullgraph-compiled
# TorchTitan block; a custom op with a fake implementation is traced as one node instead, and
# the rest of the block still compiles. Their backward re-runs the forward under autograd
# (one extra FP8 GEMM per op in backward): Primus-Turbo's backward is reachable only through
# the autograd graph of its forward call. Eager mode calls Primus-Turbo directly.


def _api() -> _TurboApi:
    from ..registry import get_backend

    return get_backend(PrimusTurboBackend.name)._loaded()


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
    return _gemm(_api(), x, weight, recipe)


@_linear_op.register_fake
def _(x, weight, recipe):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("titan_primus::primus_turbo_linear_backward", mutates_args=())
def _linear_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor]:
    api = _api()
    return _vjp(lambda x, w: _gemm(api, x, w, recipe), grad, x, weight)


@_linear_backward_op.register_fake
def _(grad, x, weight, recipe):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("titan_primus::primus_turbo_grouped_mm", mutates_args=())
def _grouped_op(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    return _grouped_mm(_api(), A, B_t, offs, recipe)


@_grouped_op.register_fake
def _(A, B_t, offs, recipe):
    return A.new_empty((A.shape[0], B_t.shape[2]), dtype=torch.bfloat16)


@torch.library.custom_op("titan_primus::primus_turbo_grouped_mm_backward", mutates_args=())
def _grouped_backward_op(
    grad: torch.Tensor, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor]:
    api = _api()
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
