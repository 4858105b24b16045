"""Pure-PyTorch FP8 emulation: quantize with the real FP8 dtypes, then run the GEMM on the
quantized values and apply the scales, as FP8 kernels do.

Runs on any device and is the numerics oracle for the other backends: it reproduces every
upstream definition of a recipe (scale math, formats, power-of-2 rounding, which operand is cast
how, and the dtype each GEMM's result is rounded to). Linears dequantize and multiply in
float32, then round each GEMM's result to the dtype the kernels produce (``linear._gemm_result``).
Grouped GEMMs multiply the FP8 values held in bfloat16 (exact) with ``torch._grouped_mm`` and take
the scales out after (divide, or multiply by the float32 reciprocal where the recipe says the
kernels do), without a host sync, so they compile fullgraph; the bfloat16
rounding of the unscaled result is exact where scales are powers of two (TorchAO) and within one
bfloat16 ulp otherwise (Primus-Turbo). Every shape runs: dimensions ``torch._grouped_mm`` cannot
take (its strides must be 16-byte multiples) are zero-padded, which changes no amax and no result.
"""

from __future__ import annotations

from ...device import DeviceProfile
from ...fsdp_fp8.gathered import Fp8GatheredWeight
from ...recipes import RECIPE_NAMES, Fp8Recipe, has_definition, make_recipe
from ..base import Fp8Backend, Op, Verdict
from .blocked import blocked_grouped_mm, blocked_linear
from .experts import EmulatedGroupedMM, padded
from .gemm_ops import GEMM_OPS
from .linear import EmulatedLinear

__all__ = ["EmulatedBackend"]


class EmulatedBackend(Fp8Backend):
    name = "emulated"
    reference = True
    tensor_parallel_scales = True
    recipes = RECIPE_NAMES

    def rank(self, device: DeviceProfile) -> int:
        # Chosen automatically only on a CPU: on a GPU, FP8 layers the kernels cannot run stay
        # in high precision rather than train silently (and slowly) in emulation.
        return 100 if device.kind == "cpu" else 0

    def availability(self, device: DeviceProfile) -> Verdict:
        if device.kind != "cpu":
            return Verdict.yes(
                f"pure PyTorch: runs on every device, but on a GPU ({device.arch}) only when requested "
                f"by name (backend='emulated'), never in place of missing FP8 kernels"
            )
        return Verdict.yes("pure PyTorch: runs on every device")

    def supports(
        self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None
    ) -> Verdict:
        return Verdict.yes("every op, recipe and shape")

    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        # Reproduce the numerics the device's preferred FP8 kernels would run: Primus-Turbo's on
        # MI300-class devices (where it defines the recipe), TorchAO's everywhere else.
        # MX runs on Primus-Turbo only on gfx950.
        primus = device.mi300_class and (recipe != "mxfp8" or device.arch == "gfx950")
        definition = "primus_turbo" if primus and has_definition(recipe, "primus_turbo") else "torchao"
        return make_recipe(recipe, definition, device)

    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        return Verdict.yes("the emulation reproduces every recipe definition")

    def bit_exact_with_emulation(self, op: Op, recipe: Fp8Recipe) -> bool:
        return True  # it is the emulation

    def attention(self):
        from .attention import EmulatedAttention

        return EmulatedAttention

    def fp8_gemm_ops(self) -> frozenset:
        return GEMM_OPS

    def takes_gathered_fp8_weight(self, recipe: Fp8Recipe, op: Op = "linear") -> Verdict:
        return Verdict.yes("the emulation takes the gathered FP8 weight as it is")

    def gathered_weight(self, data, scale, dtype, recipe, source_dtype=None):
        return Fp8GatheredWeight.for_recipe(data, scale, dtype, recipe, source_dtype)

    def linear(self, x, weight, bias, recipe, shards=None):
        if recipe.block_scaled:  # block scales never span a TP shard: no amax reduction (TP is refused)
            return blocked_linear(x, weight, bias, recipe)
        return EmulatedLinear.apply(x, weight, bias, recipe, shards)

    def grouped_mm(self, A, B_t, offs, recipe):
        if recipe.block_scaled:
            return blocked_grouped_mm(A, B_t, offs, recipe)
        n = B_t.shape[2]
        out = EmulatedGroupedMM.apply(padded(A, (1,)), padded(B_t, (1, 2)), offs, recipe)
        return out if out.shape[1] == n else out[:, :n]
