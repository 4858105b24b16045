"""Primus-Turbo backend: AMD's FP8 GEMM and grouped-GEMM kernels for MI300-class GPUs.

Drives Primus-Turbo v0.3.1 and later (``release``: the API surface told apart by signatures,
the build named as AMD ships it); ``rules``: the shapes its kernels accept at each build,
``tl.assume`` statements included; ``autograd``: one path for eager and compiled, on its
low-level ops, that keeps no copy of a weight from forward to backward.

Recipe mapping (titan-primus name -> ``Float8QuantConfig``):
- ``tensorwise`` -> ``format=HYBRID, granularity=TENSORWISE`` (e4m3 forward, e5m2 grad_output).
- ``rowwise`` -> ``format=E4M3, granularity=ROWWISE``.
- ``blockwise`` -> ``format=E4M3, granularity=BLOCKWISE, block_size=128``.
- ``mxfp8`` -> ``format=E4M3, granularity=MX_BLOCKWISE, scale_dtype=E8M0, block_size=32``
  (v0.3.2.dev48+, gfx950 only): Primus-Turbo's public ops (their MX quantization and dense GEMMs are
  HIP and FlyDSL kernels), wrapped in titan-primus custom ops whose backward runs the forward
  again from the saved input and weight, so no FP8 copy of the weight outlives the forward. Chosen
  only when requested by name (``MX_ON_REQUEST``): no test here runs it, nor has it run on an MI355X.
- ``rowwise_with_gw_hp`` has no Primus-Turbo equivalent (every Primus-Turbo wgrad is FP8).
"""

from __future__ import annotations

import torch

from ...device import DeviceProfile, detect_device
from ...fsdp_fp8.gathered import Fp8GatheredWeight
from ...grouping import zero_trailing_rows
from ...recipes import RECIPE_NAMES, Fp8Recipe, has_definition, make_recipe
from ..base import Fp8Backend, Op, Verdict
from . import mx
from .autograd import TurboGroupedMM, TurboLinear
from .release import MX_CALLER, TurboApi, api_loaded, describe_build, forget_api, imported, load_api, require_api
from .rules import refusal

__all__ = ["PrimusTurboBackend", "load_api", "describe_build"]


MX_ON_REQUEST = (
    "Primus-Turbo's mxfp8 runs only when asked for by name (backend='primus_turbo'): its MX quantizers "
    "and dense MX GEMMs are FlyDSL and HIP kernels, which no test here can run (neither the interpreter "
    "nor a stand-in runs them), and this path has not yet run on an MI355X (gfx950)"
)
"""Why ``backend="auto"`` passes Primus-Turbo over for ``mxfp8``, until its mx path has run on
gfx950 hardware (backends/primus_turbo/mx.py)."""


class PrimusTurboBackend(Fp8Backend):
    name = "primus_turbo"
    checked_at_conversion = True
    recipes = RECIPE_NAMES  # rowwise_with_gw_hp is refused in supports(), with the reason

    def __init__(self):
        forget_api()  # a fresh backend (registry.refresh) reads the installation anew, when it needs it

    def _api_for(self, device: DeviceProfile | None) -> TurboApi | str:
        """The loaded API, or why it cannot be used. Primus-Turbo is imported past the hardware
        check only: ``device`` MI300-class; without a device (what the backend is asked outside
        routing), the detected one, unless a hardware check has loaded it already or this process
        has imported it (the real-code tier)."""
        if device is None and not (api_loaded() or imported()):
            device = detect_device()
        if device is not None and not device.mi300_class:
            return f"Primus-Turbo runs only on AMD MI300-class GPUs (gfx942, gfx950); this is {device.arch}"
        return load_api()

    @property
    def _api(self) -> TurboApi | str:
        return self._api_for(None)

    def rank(self, device: DeviceProfile) -> int:
        return 300 if device.mi300_class else 0

    def installed(self) -> str:
        api = load_api() if api_loaded() else None
        return f"Primus-Turbo {api.build}" if api is not None and not isinstance(api, str) else ""

    def availability(self, device: DeviceProfile) -> Verdict:
        api = self._api_for(device)
        if isinstance(api, str):
            return Verdict.no(api)
        return Verdict.yes(f"Primus-Turbo {api.build} on {device.arch}")

    def supports(
        self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None
    ) -> Verdict:
        if not has_definition(recipe, "primus_turbo"):
            return Verdict.no(
                f"Primus-Turbo has no {recipe!r} recipe (its wgrad is always FP8); "
                f"use recipe 'rowwise' to run on Primus-Turbo"
            )
        api = self._api_for(device)
        if isinstance(api, str):
            return Verdict.no(api)
        why = (api.differs.get(MX_CALLER) if recipe == "mxfp8" else None) or refusal(api, device, op, recipe, k, n)
        return Verdict.no(why) if why else Verdict.yes()

    def chosen_automatically(self, op: Op, recipe: str, device: DeviceProfile) -> Verdict:
        if recipe == "mxfp8":
            return Verdict.no(MX_ON_REQUEST)
        return Verdict.yes()

    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        return make_recipe(recipe, "primus_turbo", device)

    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        if recipe.definition != "primus_turbo":
            return Verdict.no(
                f"Primus-Turbo runs the primus_turbo definition of {recipe.name!r}, not the {recipe.definition} one"
            )
        return Verdict.yes()

    def attention(self):
        from .attention import TurboAttention

        return TurboAttention

    def execution_paths(self) -> dict[str, str] | None:
        """How each op runs (None when Primus-Turbo is not usable)."""
        if isinstance(self._api, str):
            return None
        return {
            "tensorwise / rowwise / blockwise, eager and compiled": (
                "Primus-Turbo's low-level custom ops (gemm_fp8_impl, grouped_gemm_fp8_impl, "
                "grouped_gemm_fp8_variable_k_impl, its quantizers), the algorithm of its own autograd "
                "Functions: 3 FP8 GEMMs per op, FP8 activations saved, the weight's FP8 operands made "
                "again in backward"
            ),
            "mxfp8": (
                "Primus-Turbo's public ops inside a titan-primus custom op: backward runs the forward "
                "again from the saved input and weight (4 FP8 GEMMs per op)"
            ),
        }

    def fp8_gemm_ops(self) -> frozenset:
        """Primus-Turbo's low-level GEMM custom ops (every recipe but mxfp8, eager and compiled)
        and the custom ops the mxfp8 path wraps its public ops in."""
        api = self._api
        if isinstance(api, str):
            return frozenset()
        return frozenset(
            {
                api.gemm._opoverload,
                api.grouped._opoverload,
                api.grouped_variable_k._opoverload,
                torch.ops.titan_primus.primus_turbo_mx_linear.default,
                torch.ops.titan_primus.primus_turbo_mx_grouped_mm.default,
            }
        )

    def takes_gathered_fp8_weight(self, recipe: Fp8Recipe, op: Op = "linear") -> Verdict:
        api = self._api
        why = None
        if isinstance(api, str):
            why = api
        elif not self.accepts(recipe):
            why = self.accepts(recipe).reason
        elif recipe.name not in ("tensorwise", "rowwise", "blockwise"):
            why = f"Primus-Turbo's {recipe.name!r} GEMMs are its public ops, which quantize the weight themselves"
        if why:
            return Verdict.no(f"the primus_turbo backend cannot take a pre-quantized weight: {why}")
        kernel, other = ("gemm_fp8_impl", "x") if op == "linear" else ("grouped_gemm_fp8_impl", "A")
        return Verdict.yes(
            f"Primus-Turbo {api.build}'s {kernel} takes the gathered FP8 weight and its "
            f"scale_inv; only {other} is quantized"
        )

    def gathered_weight(self, data, scale, dtype, recipe, source_dtype=None):
        return Fp8GatheredWeight.for_recipe(data, scale, dtype, recipe, source_dtype)

    def linear(self, x, weight, bias, recipe, shards=None):  # no TP scales: TP is refused
        if recipe.name == "mxfp8":
            out = mx.linear(x, weight)
        else:
            rows = x.shape[0]
            minimum = require_api().min_rows[recipe.name]
            if rows < minimum:
                # The wgrad contracts over tokens: zero rows up to the Triton kernels' minimum
                # (exact: they add nothing to any product or scale, and their outputs are dropped).
                x = torch.cat([x, x.new_zeros(minimum - rows, x.shape[1])])
            out = TurboLinear.apply(x, weight, recipe.name)[:rows]
        # Bias stays out of the FP8 GEMM: added in the activations' precision.
        return out if bias is None else out + bias.to(out.dtype)

    def grouped_mm(self, A, B_t, offs, recipe):
        # Rows past offs[-1] (TorchTitan's padding) must stay out of every amax (tensorwise, and
        # the column scales of the wgrad): zero them in the input; its backward drops their
        # gradient (left unwritten by the dgrad kernel before v0.4.0).
        A = zero_trailing_rows(A, offs)
        if recipe.name == "mxfp8":
            out = mx.grouped_mm(A, B_t, offs)
        else:
            out = TurboGroupedMM.apply(A, B_t, offs, recipe.name)
        # The kernels leave output rows past the groups unwritten before v0.4.0; the mask also
        # keeps those rows' incoming gradient out of grad_output's amaxes.
        return zero_trailing_rows(out, offs)
