"""STAND-INS for Primus-Turbo's compiled HIP ops (``torch.ops.primus_turbo_cpp_extension``): the
only part of Primus-Turbo the real-code tier does not run. Everything else (the Python package,
its autograd Functions, backend dispatcher, low-level custom ops and Triton kernels) is
Primus-Turbo's own code from ../shared/primus-turbo/<build>.

Schemas: ``csrc/pytorch/bindings_pytorch.cpp`` at each build (AMD-AGI/Primus-Turbo). Numerics:
- quantization (``csrc/pytorch/quantization/quantization.cpp``, kernels in
  ``csrc/include/primus_turbo/device/quant_utils.cuh``): input bf16/fp16/fp32, contiguous;
  amax in fp32 (whole tensor, or along ``axis`` with the scale's ``axis`` dim kept as 1);
  ``scale = fp8_max / max(amax, 1e-12)`` and ``scale_inv = 1 / scale``, each a correctly
  rounded fp32 division; ``q = saturate(x * scale)`` cast to the FP8 dtype; returns
  ``[q, scale_inv]``. fp8_max: 448 (e4m3fn), 240 (e4m3fnuz), 57344 (e5m2, e5m2fnuz).
- dequantization (same file): ``q * scale_inv`` in fp32, cast to ``dest_dtype``.
- ``hipblaslt_gemm_fp8`` (``csrc/pytorch/gemm/hipblaslt_gemm.cpp``): FP8 A and B, contiguous, 2-D;
  TENSORWISE scalar fp32 scale inverses (MX_BLOCKWISE is not stood in for); layouts NT, NN, TN
  (TT refused); with ``transC`` the operands swap and the result is ``(op(A) @ op(B)).T``; 16-bit output unless ``out`` is given;
  ``D = op(A) @ op(B) * sA * sB (+ beta * out)`` accumulated in fp32.
- ``ck_gemm_fp8`` (``csrc/pytorch/gemm/ck_gemm.cpp``): 16-bit output only; TENSORWISE (scalar
  scales), ROWWISE (RowColQuant: one scale per row of op(a), one per column of op(b)) or
  BLOCKWISE (ABQuantGrouped: one scale per 128-long contraction block and per row, or 128-row
  block, of op(a), and per column, or 128-column block, of op(b); the scales of a transposed
  ``a`` and an untransposed ``b`` are transposed first); contraction dim divisible by 32 when
  ``a`` is not transposed, and for BLOCKWISE K and N by 128.
- ``grouped_gemm_compute_offs`` (``csrc/pytorch/grouped_gemm/utils/grouped_gemm_utils.cpp``):
  ``[0, cumsum(group_lens)]``, int64.
- ``transpose_2d`` (``csrc/pytorch/transpose/transpose.cpp``, from v0.3.2.dev48): a contiguous
  transpose.

The blockwise quantization HIP ops are left undefined on purpose: Primus-Turbo checks for them
with ``hasattr`` and takes its Triton blockwise kernels. Every op has a Meta kernel, as the real
extension registers (``TORCH_LIBRARY_IMPL(primus_turbo_cpp_extension, Meta, m)``).
"""

from __future__ import annotations

import torch

from titan_primus.backends.primus_turbo.api import VERIFIED_BUILDS

NAMESPACE = "primus_turbo_cpp_extension"
_EPS = 1e-12
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_BLOCK = 128

_HIPBLASLT_FP8 = (
    "(Tensor A, Tensor scaleA_inv, Tensor B, Tensor scaleB_inv, ScalarType out_dtype, "
    "bool transA, bool transB, bool transC, str granularity"
)
SCHEMAS = {
    "quantize_fp8_tensorwise": "(Tensor input, ScalarType dest_dtype, Tensor? scale_opt=None) -> Tensor[]",
    "quantize_fp8_rowwise": "(Tensor input, ScalarType dest_dtype, int axis, Tensor? scale_opt=None) -> Tensor[]",
    "dequantize_fp8_tensorwise": "(Tensor input, Tensor scale_inv, ScalarType dest_dtype) -> Tensor",
    "dequantize_fp8_rowwise": "(Tensor input, Tensor scale_inv, int axis, ScalarType dest_dtype) -> Tensor",
    "grouped_gemm_compute_offs": "(Tensor group_lens) -> Tensor",
    "hipblaslt_gemm_fp8": _HIPBLASLT_FP8 + ") -> Tensor",
    "ck_gemm_fp8": (
        "(Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, bool transA, bool transB, "
        "ScalarType out_dtype, str granularity) -> Tensor"
    ),
}
SCHEMAS_FROM = {  # build -> schema changes from that build on
    "v0.3.2.dev48": {"transpose_2d": "(Tensor input, int dim0, int dim1) -> Tensor"},
    "v0.4.1.dev26": {"hipblaslt_gemm_fp8": _HIPBLASLT_FP8 + ", float beta=0.0, Tensor(a!)? out=None) -> Tensor"},
}
BUILDS = VERIFIED_BUILDS


class StandInError(RuntimeError):
    """A PRIMUS_TURBO_CHECK of the HIP op failed (the real op raises too)."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise StandInError(f"PRIMUS_TURBO_CHECK failed (stand-in): {what}")


def _quantize(x: torch.Tensor, dest_dtype: torch.dtype, axis: int | None):
    _check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), "input is bf16, fp16 or fp32")
    _check(dest_dtype in _FP8, "is_torch_fp8(dest_dtype)")
    _check(x.is_contiguous(), "input must be contiguous")
    xf = x.float()
    amax = xf.abs().amax() if axis is None else xf.abs().amax(dim=axis, keepdim=True)
    fp8_max = torch.finfo(dest_dtype).max
    # Tensor / tensor: one correctly rounded fp32 division each (a Python float divided by a
    # tensor is computed as reciprocal times the float, rounding twice).
    scale = torch.full_like(amax, fp8_max) / torch.clamp(amax, min=_EPS)
    scale_inv = torch.ones_like(scale) / scale
    return [(xf * scale).clamp(-fp8_max, fp8_max).to(dest_dtype), scale_inv]


def quantize_fp8_tensorwise(input, dest_dtype, scale_opt=None):
    _check(scale_opt is None, "the stand-in models dynamic scaling only")
    return _quantize(input, dest_dtype, None)


def quantize_fp8_rowwise(input, dest_dtype, axis, scale_opt=None):
    _check(scale_opt is None, "the stand-in models dynamic scaling only")
    return _quantize(input, dest_dtype, axis)


def dequantize_fp8_tensorwise(input, scale_inv, dest_dtype):
    _check(input.dtype in _FP8, "is_torch_fp8(input)")
    return (input.float() * scale_inv).to(dest_dtype)


def dequantize_fp8_rowwise(input, scale_inv, axis, dest_dtype):
    _check(input.dtype in _FP8, "is_torch_fp8(input)")
    return (input.float() * scale_inv).to(dest_dtype)


def grouped_gemm_compute_offs(group_lens):
    return torch.cat([group_lens.new_zeros(1), group_lens.cumsum(0)]).to(torch.int64)


def transpose_2d(input, dim0, dim1):
    return input.transpose(dim0, dim1).contiguous()


def _logical(t: torch.Tensor, trans: bool) -> torch.Tensor:
    return t.t() if trans else t


def _scaled_product(A, B, sa, sb) -> torch.Tensor:
    """fp32 ``A @ B`` with per-tensor or per-row-of-A / per-column-of-B scale inverses."""
    sa = sa.reshape(-1, 1) if sa.numel() > 1 else sa.reshape(())
    sb = sb.reshape(1, -1) if sb.numel() > 1 else sb.reshape(())
    return (A.float() @ B.float()) * sa * sb


def hipblaslt_gemm_fp8(
    A, scaleA_inv, B, scaleB_inv, out_dtype, transA, transB, transC, granularity, beta=0.0, out=None
):
    _check(A.dtype in _FP8 and B.dtype in _FP8, "A and B must be FP8 Tensor.")
    _check(granularity == "TENSORWISE", f"granularity {granularity}: only TENSORWISE is stood in for")
    _check(scaleA_inv.dtype == torch.float32 and scaleB_inv.dtype == torch.float32, "fp32 scale inverses")
    _check(scaleA_inv.numel() == 1 and scaleB_inv.numel() == 1, "TENSORWISE scale inverses are scalars")
    _check(A.is_contiguous() and B.is_contiguous(), "A and B must be contiguous")
    _check(A.dim() == 2 and B.dim() == 2, "A, B must be 2D tensors")
    if out is None:
        _check(beta == 0.0, "beta != 0 requires an `out` Tensor to accumulate into.")
        _check(out_dtype in _SIXTEEN_BIT, "is_16bit_floating_point_dtype(out_dtype)")
    if transC:
        A, B, scaleA_inv, scaleB_inv = B, A, scaleB_inv, scaleA_inv
        transA, transB = not transB, not transA
    _check(not (transA and transB), "Not support layout.")
    OA, OB = _logical(A, transA), _logical(B, transB)
    _check(OA.shape[1] == OB.shape[0], "tensor size mismatch")
    result = _scaled_product(OA, OB, scaleA_inv, scaleB_inv)  # with transC: (op(A) @ op(B)).T
    if out is None:
        return result.to(out_dtype).contiguous()
    out.copy_((result + beta * out.float()).to(out.dtype))
    return out


def _block_scales(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, contraction blocks] from one scale per row or per 128 rows."""
    return scales if scales.shape[0] == rows else scales.repeat_interleave(_BLOCK, 0)[:rows]


def _block_product(A, B, sa, sb) -> torch.Tensor:
    """fp32 ``A [M, Kc] @ B [Kc, N]``, each 128-long contraction block scaled by ``sa[m, c] *
    sb[n, c]`` (CK's ABQuantGrouped)."""
    sa, sb = _block_scales(sa, A.shape[0]), _block_scales(sb, B.shape[1])
    out = torch.zeros(A.shape[0], B.shape[1])
    for c in range(sa.shape[1]):
        block = slice(c * _BLOCK, (c + 1) * _BLOCK)
        out += (A[:, block].float() @ B[block].float()) * sa[:, c : c + 1] * sb[:, c]
    return out


def ck_gemm_fp8(a, b, a_scales, b_scales, transA, transB, out_dtype, granularity):
    _check(a.dtype in _FP8 and b.dtype in _FP8, "is_8bit_floating_point_dtype(a, b)")
    _check(out_dtype in _SIXTEEN_BIT, "out_dtype must be kBFloat16 or kHalf")
    _check(
        granularity in ("TENSORWISE", "ROWWISE", "BLOCKWISE"),
        "granularity must be 'TENSORWISE', 'ROWWISE', or 'BLOCKWISE'",
    )
    OA, OB = _logical(a, transA), _logical(b, transB)
    k, n = OA.shape[1], OB.shape[1]
    if not transA:
        _check(k % 32 == 0, f"For NT or NN layout, k must be a multiple of 32, got k={k}")
    if granularity != "BLOCKWISE":
        return _scaled_product(OA, OB, a_scales.contiguous(), b_scales.contiguous()).to(out_dtype)
    if not transA:
        _check(
            k % 128 == 0 and n % 128 == 0 and k >= 128, "For BLOCKWISE granularity, k and n must be multiples of 128"
        )
    # a_scales [rows of op(a) or their 128-blocks, k-blocks]; b_scales [columns of op(b) or their
    # 128-blocks, k-blocks], after the transposes ck_gemm.cpp applies for BLOCKWISE.
    a_scales = a_scales.t() if transA else a_scales
    b_scales = b_scales.t() if not transB else b_scales
    return _block_product(OA, OB, a_scales, b_scales).to(out_dtype)


def _quantize_meta(input, dest_dtype, axis=None, scale_opt=None):
    shape = [] if axis is None else [1 if d == axis % input.dim() else n for d, n in enumerate(input.shape)]
    return [input.new_empty(input.shape, dtype=dest_dtype), input.new_empty(shape, dtype=torch.float32)]


def _gemm_meta(A, B, transA, transB, transC, out_dtype):
    m = A.shape[1] if transA else A.shape[0]
    n = B.shape[0] if transB else B.shape[1]
    return A.new_empty((n, m) if transC else (m, n), dtype=out_dtype)


_METAS = {
    "quantize_fp8_tensorwise": lambda input, dest_dtype, scale_opt=None: _quantize_meta(input, dest_dtype),
    "quantize_fp8_rowwise": _quantize_meta,
    "dequantize_fp8_tensorwise": lambda input, scale_inv, dest_dtype: input.new_empty(input.shape, dtype=dest_dtype),
    "dequantize_fp8_rowwise": lambda input, scale_inv, axis, dest_dtype: input.new_empty(input.shape, dtype=dest_dtype),
    "grouped_gemm_compute_offs": lambda group_lens: group_lens.new_empty(group_lens.shape[0] + 1, dtype=torch.int64),
    "transpose_2d": lambda input, dim0, dim1: input.transpose(dim0, dim1).contiguous(),
    "hipblaslt_gemm_fp8": lambda A, sA, B, sB, out_dtype, transA, transB, transC, granularity, beta=0.0, out=None: (
        out if out is not None else _gemm_meta(A, B, transA, transB, transC, out_dtype)
    ),
    "ck_gemm_fp8": lambda a, b, sa, sb, transA, transB, out_dtype, granularity: _gemm_meta(
        a, b, transA, transB, False, out_dtype
    ),
}
_LIBRARIES: list = []  # a Library unregisters its ops when collected


def schemas(build: str) -> dict[str, str]:
    """The stood-in ops' schemas at ``build`` (one of BUILDS)."""
    found = dict(SCHEMAS)
    for since, changes in SCHEMAS_FROM.items():
        if BUILDS.index(build) >= BUILDS.index(since):
            found.update(changes)
    return found


def register(build: str) -> None:
    """Define the stood-in ops with ``build``'s schemas, CPU and Meta kernels (once a process)."""
    if _LIBRARIES:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in schemas(build).items():
        lib.define(name + schema)
        lib.impl(name, globals()[name], "CPU")
        lib.impl(name, _METAS[name], "Meta")
    _LIBRARIES.append(lib)
