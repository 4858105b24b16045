"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), made to run Primus-Turbo's FP8 kernels
faithfully (../shared/reference/primus-turbo-interpreter.md, items 7-9; triton 3.8).

Nothing here changes what a kernel computes on a GPU; each patch closes a gap between the
interpreter and the hardware's semantics:

- ``x: tl.int32 = 0`` (an annotated assignment) stays a Python int in the interpreter, where
  compiled Triton makes it a tensor; the grouped kernels then call ``.to`` on it.
- ``@triton.autotune`` benchmarks through the active GPU driver; here every config reports the
  same time without running (hundreds of configs would each run under the interpreter), so the
  first config wins, deterministically. Where a config's BLOCK_K decides a ``tl.assume``, the
  rule covers every config of the list (titan_primus/backends/primus_turbo/rules.py).
- Float conversions: the interpreter truncates fp32 -> bf16/fp16 (``cast_impl`` passes no
  rounding mode), drops the mantissa carry in fp32 -> fp8 and ignores NaN codes in fp8 -> float
  (triton-lang/triton #8322). A GPU rounds to nearest even; torch's casts do the same, so every
  float conversion goes through them.
- ``tl.fma`` is a multiply then an add, rounded twice, in the interpreter; a GPU fuses them
  (one rounding; the FP8 attention backward accumulates dK and dV with it). fp32 operands are
  fused here through float64, where their product is exact (the emulation does the same:
  titan_primus/backends/emulated/attention.py).
"""

from __future__ import annotations

import ast

import numpy as np
import torch
import triton.language as tl
from triton.runtime import autotuner, interpreter

_TORCH_OF = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
    "fp8e4nv": torch.float8_e4m3fn,
    "fp8e5": torch.float8_e5m2,
    "fp8e4b8": torch.float8_e4m3fnuz,
    "fp8e5b16": torch.float8_e5m2fnuz,
}
_BITS = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_TORCH_BITS = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}
_SIGNED = {8: np.uint8, 16: np.int16, 32: np.int32, 64: np.int64}


def _is_float(dtype) -> bool:
    return getattr(dtype, "name", None) in _TORCH_OF


def _convert(data: np.ndarray, src, dst) -> np.ndarray:
    """Convert the raw bits of ``src`` elements to ``dst`` with torch's round-to-nearest-even."""
    bits, out_bits = src.primitive_bitwidth, dst.primitive_bitwidth
    raw = torch.from_numpy(np.ascontiguousarray(data).view(_SIGNED[bits]))
    values = raw.view(_TORCH_OF[src.name]).to(_TORCH_OF[dst.name])
    out = values.view(_TORCH_BITS[out_bits]).numpy().view(_BITS[out_bits])
    return out.reshape(data.shape)


def _cast(self, src, dst_type):
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    if _is_float(src_ty) and _is_float(dst_ty) and src_ty.name != dst_ty.name:
        data = _convert(src.data, src_ty, dst_ty).view(interpreter._get_np_dtype(dst_type))
        return interpreter.TensorHandle(data, dst_ty)
    return _original_cast(self, src, dst_type)


def _fp_to_fp(self, src, dst_type, rounding_mode):
    src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
    data = _convert(src.data, src_ty, dst_ty).view(interpreter._get_np_dtype(dst_type))
    return interpreter.TensorHandle(data, dst_ty)


def _to_float32(handle) -> np.ndarray:
    ty = handle.dtype.scalar
    if ty.primitive_bitwidth == 8 and ty.is_floating():
        return _convert(handle.data, ty, tl.float32).view(np.float32)
    return handle.data


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    # fp8 operands decoded exactly (NaN codes included); products accumulated in d's dtype.
    product = np.matmul(_to_float32(a), _to_float32(b), dtype=d.data.dtype)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


def _fma(self, x, y, z):
    if z.data.dtype != np.float32:
        return _original_fma(self, x, y, z)
    fused = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
    return interpreter.TensorHandle(fused.astype(np.float32), z.dtype.scalar)


def _visit_annotated_assign(self, node):
    if node.value is None:
        return node
    assign = ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno, col_offset=node.col_offset)
    return self.visit_Assign(assign)


def _bench_equal(self, *args, config, **meta):
    return [1.0, 1.0, 1.0]


_original_cast = interpreter.InterpreterBuilder.cast_impl
_original_fma = interpreter.InterpreterBuilder.create_fma


def install() -> None:
    """Patch the interpreter (idempotent)."""
    builder = interpreter.InterpreterBuilder
    if builder.cast_impl is _cast:
        return
    builder.cast_impl = _cast
    for name in (
        "create_fp_ext",
        "create_fp_trunc",
        "create_si_to_fp",
        "create_ui_to_fp",
        "create_fp_to_si",
        "create_fp_to_ui",
    ):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder.create_fp_to_fp = _fp_to_fp
    builder.create_dot = _dot
    builder.create_fma = _fma
    interpreter.ASTTransformer.visit_AnnAssign = _visit_annotated_assign
    autotuner.Autotuner._bench = _bench_equal
