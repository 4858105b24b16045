"""TorchAO backend: ``torchao.float8``'s linear autograd function (its forward GEMM called as
``torch._scaled_mm``, see ``linear.linear_function``), and
``_to_fp8_rowwise_then_scaled_grouped_mm`` for MoE grouped GEMMs; for ``mxfp8`` the MXFP8
training GEMMs of ``torchao.prototype.moe_training`` (SM100; on a CPU, by name, TorchAO's own
emulated MX mode), for ``blockwise`` ``torchao.prototype.blockwise_fp8_training`` (SM90).

Everything TorchAO is imported lazily, and names that moved between TorchAO releases are looked
up through the candidate lists below.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from functools import cached_property

import torch

from ...device import DeviceProfile
from ...grouping import mask_trailing_rows_of_grad, padded_groups, zero_trailing_rows
from ...recipes import RECIPE_NAMES, Fp8Recipe, make_recipe
from ..base import Fp8Backend, Op, StockPath, Verdict
from .linear import linear_configs, linear_function, linear_symbol, missing_linear_symbols, without_onednn

__all__ = ["TorchAOBackend"]

# (module, attribute) candidates, newest first.
GROUPED_MM_NAMES = (
    ("torchao.prototype.moe_training", "_to_fp8_rowwise_then_scaled_grouped_mm"),  # 0.17+
    ("torchao.prototype.moe_training.fp8_grouped_mm", "_to_fp8_rowwise_then_scaled_grouped_mm"),
)
# Where TorchAO's rowwise grouped GEMM measured no faster than bf16's torch._grouped_mm, forward
# + backward, by GPU model (a key found in the device's name): docs/measurements.md, "NVIDIA H200".
SLOWER_GROUPED_MM = {
    "H200": (
        "TorchAO's rowwise FP8 grouped GEMM measured 1.00x bf16 compiled and 0.83x to 0.90x eager on an H200 "
        "(DeepSeek-V3 expert shapes: 65536 rows x 7168 -> 2048, 8 experts; torch 2.11, TorchAO 0.18, 2026-12-03)"
    ),
}
_ALIGNMENT = 16  # FP8 tensor-core kernels need K, N (and grouped-GEMM group sizes) % 16 == 0
# Block-scaled recipes: every dimension a block runs along must hold whole blocks (to_mx asserts
# the last dim % 32; the blockwise quantizers and F.scaled_mm need multiples of 128).
_BLOCK = {"mxfp8": 32, "blockwise": 128}


def _first_attr(candidates: tuple[tuple[str, str], ...]):
    errors = []
    for module, attr in candidates:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            errors.append(f"{module}.{attr}: {e}")
    raise ImportError("; ".join(errors))


def _sm(device: DeviceProfile) -> int:
    """NVIDIA compute capability as an int (90, 100, ...); 0 elsewhere."""
    return int(device.arch[2:]) if device.kind == "cuda" and device.arch[2:].isdigit() else 0


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` (zeros change no block amax);
    ``t`` itself where it has whole multiples (``F.pad`` copies even when it adds nothing)."""
    missing = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, missing)) if missing else t


class TorchAOBackend(Fp8Backend):
    name = "torchao"
    checked_at_conversion = True
    recipes = RECIPE_NAMES

    @cached_property
    def _import_error(self) -> str | None:
        try:
            importlib.import_module("torchao.float8.float8_linear")
        except ImportError as e:
            return f"TorchAO is not importable ({e}); pip install 'torchao>=0.15'"
        return missing_linear_symbols()

    @cached_property
    def _grouped_mm_import_error(self) -> str | None:
        try:
            self._grouped_mm_fn
        except ImportError as e:
            if importlib.util.find_spec("triton") is None:
                return "TorchAO's FP8 grouped GEMM is written in Triton, which is not installed"
            version = importlib.import_module("torchao").__version__
            if _release(version) < (0, 17):
                return (
                    f"TorchAO {version} has no FP8 rowwise grouped GEMM (_to_fp8_rowwise_then_scaled_grouped_mm, "
                    f"from torchao 0.17; {e}): pip install 'torchao>=0.17'"
                )
            # A TorchAO that should have it: the symbol moved upstream, and a newer TorchAO is no fix.
            return (
                f"TorchAO {version} lacks its FP8 rowwise grouped GEMM where titan-primus's TorchAO grouped GEMM "
                f"takes it (titan_primus/backends/torchao/__init__.py; verified on TorchAO {VERIFIED_TORCHAO_GROUPED}: "
                f"{e}): install a TorchAO from {VERIFIED_TORCHAO_GROUPED}, or a titan-primus that supports this one"
            )
        return None

    def rank(self, device: DeviceProfile) -> int:
        return 200 if device.fp8_hardware else 0

    def installed(self) -> str:
        return "" if self._import_error else f"TorchAO {importlib.import_module('torchao').__version__}"

    def availability(self, device: DeviceProfile) -> Verdict:
        if self._import_error:
            return Verdict.no(self._import_error)
        if not device.fp8_hardware:
            return Verdict.yes(
                f"{device.name} has no FP8 units: TorchAO runs there only when requested by name, "
                f"as a reference (its CPU _scaled_mm path is slow; the emulation is the fast CPU path)"
            )
        return Verdict.yes(f"TorchAO FP8 kernels on {device.arch}")

    def supports(
        self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None
    ) -> Verdict:
        if recipe in _BLOCK:
            return self._supports_blocked(op, recipe, device, k, n)
        if op == "grouped_mm":
            if not device.fp8_hardware or device.kind == "cpu":
                return Verdict.no(
                    f"TorchAO's FP8 grouped GEMM needs its Triton kernels and torch._scaled_grouped_mm, "
                    f"which exist only on CUDA SM89+ or ROCm gfx942+ (this is {device.arch})"
                )
            if recipe != "rowwise":
                return Verdict.no(f"TorchAO implements only the rowwise recipe for grouped GEMMs, not {recipe!r}")
            if self._grouped_mm_import_error:
                return Verdict.no(self._grouped_mm_import_error)
        bad = [f"{name}={dim}" for name, dim in (("K", k), ("N", n)) if dim is not None and dim % _ALIGNMENT]
        if bad:
            return Verdict.no(f"TorchAO's FP8 GEMMs need K and N divisible by {_ALIGNMENT} ({', '.join(bad)})")
        return Verdict.yes()

    def _supports_blocked(self, op: Op, recipe: str, device: DeviceProfile, k, n) -> Verdict:
        sm = _sm(device)
        if recipe == "mxfp8":
            # MXFP8 GEMMs (cuBLAS / CUTLASS with E8M0 scales) exist only on SM100; upstream
            # TorchTitan gates its MXFP8 converters the same way. On a CPU (never chosen
            # automatically) TorchAO's KernelPreference.EMULATED runs its own MX numerics.
            if sm < 100 and not (device.kind == "cpu" and op == "linear"):
                return Verdict.no(
                    f"TorchAO's MXFP8 kernels need NVIDIA SM100 (this is {device.arch})"
                    + (
                        "; its emulated MX grouped GEMM needs groups padded to 32 on the host"
                        if device.kind == "cpu"
                        else ""
                    )
                )
        elif op == "grouped_mm":
            return Verdict.no(
                "TorchAO 0.18's blockwise grouped GEMM runs real FP8 kernels only with the optional "
                "DeepGEMM package and silently emulates otherwise; titan-primus does not route to it"
            )
        elif sm != 90:
            return Verdict.no(
                f"TorchAO's blockwise (1x128 / 128x128) GEMM runs on NVIDIA SM90 only (F.scaled_mm "
                f"blockwise scaling; this is {device.arch})"
            )
        block = _BLOCK[recipe]
        bad = [f"{name}={dim}" for name, dim in (("K", k), ("N", n)) if dim is not None and dim % block]
        if bad:
            return Verdict.no(f"TorchAO's {recipe} GEMMs need K and N divisible by {block} ({', '.join(bad)})")
        return Verdict.yes()

    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        resolved = make_recipe(recipe, "torchao", device)
        if not resolved.block_scaled:
            # Built (and TorchAO imported) at routing time, so compiled code only looks them up:
            # TorchAO imported while dynamo traces fails inside its own class definitions.
            self._configs(resolved)
        return resolved

    @cached_property
    def _linear_configs(self) -> dict:
        return {}

    def _configs(self, recipe: Fp8Recipe):
        """TorchAO's linear autograd function, Float8LinearConfig and LinearMMConfig for
        ``recipe``, built once."""
        key = (recipe.name, recipe.e4m3, recipe.e5m2)
        if key not in self._linear_configs:
            self._linear_configs[key] = (linear_function(), *linear_configs(recipe))
        return self._linear_configs[key]

    def fp8_gemm_ops(self) -> frozenset:
        # torch._scaled_mm / _scaled_grouped_mm (and F.scaled_mm's _v2 forms) on every path that
        # runs FP8 kernels; the blockwise GEMM is a Triton custom op, registered when its module
        # imports (it needs Triton). TorchAO's CPU-only emulated MX linear multiplies with aten.mm.
        aten = torch.ops.aten
        ops = {aten._scaled_mm.default, aten._scaled_grouped_mm.default}
        ops |= {
            getattr(aten, name).default for name in ("_scaled_mm_v2", "_scaled_grouped_mm_v2") if hasattr(aten, name)
        }
        if not self._import_error:
            try:
                importlib.import_module("torchao.prototype.blockwise_fp8_training.kernels")
                ops.add(torch.ops.torchao.blockwise_scaled_mm.default)
            except (ImportError, AttributeError):
                pass
        return frozenset(ops)

    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        if recipe.definition != "torchao":
            return Verdict.no(
                f"TorchAO runs the torchao definition of {recipe.name!r}, not the {recipe.definition} one"
            )
        return Verdict.yes()

    def slower_than_bf16(self, op: Op, recipe: Fp8Recipe, device: DeviceProfile) -> str | None:
        if op != "grouped_mm" or recipe.name != "rowwise":
            return None
        return next((found for key, found in SLOWER_GROUPED_MM.items() if key in device.name.upper()), None)

    def stock_path(self, op: Op, recipe: Fp8Recipe) -> tuple[StockPath | None, Verdict]:
        from .stock import stock_path

        return stock_path(op, recipe)

    def takes_gathered_fp8_weight(self, recipe: Fp8Recipe, op: Op = "linear") -> Verdict:
        if op == "grouped_mm":
            return Verdict.no(
                "TorchAO's grouped GEMM (_to_fp8_rowwise_then_scaled_grouped_mm) quantizes B_t itself: "
                "it has no entry for a pre-quantized weight"
            )
        if recipe.block_scaled:
            return Verdict.no(
                "TorchAO's block-scaled linears (fp8_blockwise_mm, mx_mm) quantize the weight themselves: "
                "they have no entry for a pre-quantized weight"
            )
        return Verdict.yes("TorchAO takes it as its own Float8TrainingTensor and skips the weight cast")

    def gathered_weight(self, data, scale, dtype, recipe, source_dtype=None):
        Float8TrainingTensor, GemmInputRole = (linear_symbol(n) for n in ("Float8TrainingTensor", "GemmInputRole"))
        *_, mm_config = self._configs(recipe)
        return Float8TrainingTensor(data, scale, dtype, mm_config, GemmInputRole.WEIGHT)

    def linear(self, x, weight, bias, recipe, shards=None):  # no TP scales: TP is refused
        if recipe.block_scaled:
            out = self._blocked_linear(x, weight, recipe)
            return out if bias is None else out + bias.to(out.dtype)
        matmul, config, mm_config = self._configs(recipe)

        def run(x, weight):
            # Output in x's dtype (TorchAO takes it from the input), grads in the inputs' dtypes.
            return matmul.apply(x, weight.t(), mm_config, config)

        # Compiled code never reaches oneDNN's slow path: inductor lowers the FP8 GEMMs itself.
        eager_cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        out = without_onednn(run, x, weight) if eager_cpu else run(x, weight)
        return out if bias is None else out + bias.to(out.dtype)

    def _blocked_linear(self, x, weight, recipe):
        # Both upstream functions also block along the token dimension (wgrad) and assert whole
        # blocks there: pad the rows with zeros (no block amax changes) and drop them after.
        rows, out_dtype = x.shape[0], x.dtype
        # Both upstream functions take one dtype for x and weight, and keep both for backward:
        # x comes in the weight's dtype (an activation-sized cast, as autocast makes it), never
        # the weight in x's (a weight-sized copy kept from forward to backward).
        x = _pad_rows(x, _BLOCK[recipe.name]).to(weight.dtype)
        if recipe.name == "blockwise":
            from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

            return fp8_blockwise_mm.apply(x, weight, 128, out_dtype, False)[:rows]
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (
            MXFP8Dim0CastKernelChoice,
            MXFP8Dim1CastKernelChoice,
            ScaleCalculationMode,
        )
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        if x.is_cuda:  # SM100 kernels, as _to_mxfp8_then_scaled_mm picks them
            kernels = (KernelPreference.AUTO, MXFP8Dim0CastKernelChoice.TRITON, MXFP8Dim1CastKernelChoice.CUDA)
        else:  # TorchAO's emulated MX: its to_mx casts, dequantize, high-precision mm
            kernels = (KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH)
        e4m3 = torch.float8_e4m3fn
        return mx_mm.apply(x, weight, e4m3, e4m3, e4m3, 32, *kernels, ScaleCalculationMode.RCEIL, False)[:rows].to(
            out_dtype
        )

    @cached_property
    def _grouped_mm_fn(self):
        return _first_attr(GROUPED_MM_NAMES)

    def group_alignment(self, recipe: Fp8Recipe) -> int:
        # torch._scaled_grouped_mm needs 16-byte strides and group starts along the contraction
        # (the weight gradient's, over tokens), and TorchAO 0.18 states "Group sizes must be
        # divisible by 16" (torchao/prototype/moe_training/fp8_grouped_mm.py) with its own padding
        # unimplemented; its MXFP8 grouped GEMM wants groups of whole 32-row blocks.
        return 32 if recipe.name == "mxfp8" else 16

    def grouped_mm(self, A, B_t, offs, recipe):
        alignment = self.group_alignment(recipe)
        if recipe.token_groups_padded_to and recipe.token_groups_padded_to % alignment == 0:
            return self._aligned_grouped_mm(A, B_t, offs, recipe)
        # Each group padded with zero rows: they add nothing to any scale (every amax is over a
        # row, a column of one group's rows, or B_t) nor to any sum, and their outputs are
        # dropped, so the result is bitwise that of the groups as given. No host sync.
        destination, padded_offs, padded_rows = padded_groups(offs, A.shape[0], alignment)
        padded_A = A.new_zeros((padded_rows, A.shape[1])).index_copy(0, destination, A)
        out = self._aligned_grouped_mm(padded_A, B_t, padded_offs, recipe)
        return zero_trailing_rows(out.index_select(0, destination), offs)

    def _aligned_grouped_mm(self, A, B_t, offs, recipe):
        if recipe.name == "mxfp8":  # SM100 only (supports); groups come padded to 32
            from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm

            out = _to_mxfp8_then_scaled_grouped_mm(zero_trailing_rows(A, offs), B_t, offs, out_dtype=torch.bfloat16)
            return zero_trailing_rows(out, offs)
        # It takes float32 or bfloat16 operands only (asserted in fp8_grouped_mm.py); its output
        # is bfloat16 and its gradients bfloat16, cast to the operands' dtypes by autograd.
        A, B_t = (t.bfloat16() if t.dtype == torch.float16 else t for t in (A, B_t))
        # A goes in as it is, so TorchAO keeps the caller's tokens (w1 and w3 of a MoE block share
        # one saved copy, as in stock TorchTitan): rows past offs[-1] enter none of TorchAO 0.18's
        # scales (fp8_grouped_mm.py: rowwise scales of A and grad_output are per row, B_t's over
        # K, and the wgrad's per-group column scales, jagged_float8_scales.py:622-650, loop over
        # each group's rows only), and no GEMM reads them. What the kernels leave in those rows of
        # the output and of grad_A is masked instead (the output's mask also zeroes their
        # incoming gradient).
        # TorchAO asserts a row-major A and a column-major B_t (stride(-2) == 1, its asserts at
        # fp8_grouped_mm.py:109, 112; its B_t quantizer reads that layout). TorchTitan's transposed
        # view of its [E, N, K] expert weights is one and passes as it is; a row-major [E, K, N]
        # B_t has no view TorchAO takes, so it is copied into one, on each call (autograd hands
        # the gradient back in the caller's layout).
        A = mask_trailing_rows_of_grad(A.contiguous(), offs)
        if B_t.stride(-2) != 1:
            B_t = B_t.transpose(-2, -1).contiguous().transpose(-2, -1)
        out = self._grouped_mm_fn(
            A,
            B_t,
            offs,
            out_dtype=torch.bfloat16,
            float8_dtype=recipe.e4m3,
            # Its default (True) asserts "not yet supported"; groups come aligned (grouped_mm).
            pad_token_groups_for_grouped_mm=False,
        )
        return zero_trailing_rows(out, offs)


VERIFIED_TORCHAO_GROUPED = "0.17 to 0.18"


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "0.18.0+cu130" or "0.19.0.dev20261201"."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])
