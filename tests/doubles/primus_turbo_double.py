"""A TEST DOUBLE of Primus-Turbo: not Primus-Turbo, and no evidence about it.

Written from Primus-Turbo's source as read at tags v0.2.0, v0.3.0, v0.3.1 and v0.4.0 (see
tests/data/primus_turbo_api.json, which the tests check this double against), so the titan-primus
adapter can be exercised on a CPU. It implements the numerics independently of titan_primus and
is as strict as the kernels where the adapter depends on it. Every rule below cites the upstream
file it comes from (paths at the tag named; ``ops/`` is ``primus_turbo/pytorch/ops/``,
``kernels/`` is ``primus_turbo/pytorch/kernels/``):

- Quantization (``csrc/pytorch/quantization/quantization.cpp``, every tag): input bf16, fp16 or
  fp32; amax in fp32; ``scale = fp8_max / max(amax, eps)``, ``scale_inv = 1.0f / scale``;
  ``q = saturate(x * scale)``; returns ``[q, scale_inv]``.
- GEMM kernels compute ``(A_fp8 @ B_fp8) * a_scale_inv * b_scale_inv`` with fp32 accumulation and
  write bf16/fp16 only (v0.2.0 ``csrc/pytorch/gemm/ck_gemm.cpp`` / ``hipblaslt_gemm.cpp`` check
  16-bit ``out_dtype``; from v0.3.0 ``kernels/gemm/gemm_fp8_impl.py`` lists no fp32 output in any
  backend's SUPPORTED_DTYPES, so ``core/backend.py`` raises ``ValueError("No compatible backend
  found ...")``).
- CK rowwise dense GEMM: contraction dim divisible by 32 when its left operand is not transposed
  (``csrc/pytorch/gemm/ck_gemm.cpp``, every tag); rowwise dense runs on CK at v0.2.0 (hard-coded;
  ``ops/gemm_fp8.py`` pads forward K to 128, the dgrad contracts over N unpadded), v0.3.0 and
  v0.3.1 (``default_backend=CK`` in ``ops/gemm_fp8.py``); v0.4.0 defaults to Triton.
- Triton grouped GEMM (default from v0.3.1, ``ops/grouped_gemm_fp8.py``): the kernel states
  ``tl.assume(loop_k > 1)`` with BLOCK_SIZE_K 128 (``primus_turbo/triton/grouped_gemm/
  grouped_gemm_fp8_kernel.py``; the BLOCKWISE kernel ``_grouped_blockwise_fp8_persistent_gemm_kernel``
  states it too, the v0.4.0 MX one does not): a contraction dim under 256 is undefined behaviour
  there; the double raises instead of returning garbage.
- Grouped output rows past ``group_offs[-1]`` are ``torch.empty`` garbage before v0.4.0 (NaN here);
  v0.4.0 zeroes them (``kernels/grouped_gemm/grouped_gemm_fp8_impl.py``,
  ``grouped_gemm_output_tail_kernel``).
- At v0.3.0 a grouped GEMM with mixed FP8 operands (HYBRID) has no CK or Triton kernel and falls
  back to hipBLASLt with a warning (``kernels/grouped_gemm/grouped_gemm_fp8_impl.py``,
  ``core/backend.py``).
- The low-level ops Primus-Turbo's autograd Functions are built from, with fake implementations:
  ``primus_turbo::gemm_fp8_impl``, ``grouped_gemm_fp8_impl`` (v0.4.0 adds ``group_offs_out``),
  ``grouped_gemm_fp8_variable_k_impl`` (v0.3.0+), and ``primus_turbo_cpp_extension::
  quantize_fp8_tensorwise`` / ``quantize_fp8_rowwise`` (every tag) / ``dequantize_fp8_rowwise``
  (v0.3.1+). One process holds several releases here, so the ``primus_turbo::`` ops are
  registered under a namespace per release (``primus_turbo_double_v0_4_0::gemm_fp8_impl``...);
  the adapter finds them as upstream does, at ``primus_turbo.pytorch.kernels...``.

- Block-scaled GEMMs (``_BlockGemm`` / ``_BlockGroupedGemm`` below, with their own quantizer):
  BLOCKWISE at every tag (``ops/gemm_fp8.py`` ``FP8GemmBlockFunction``, ``ops/grouped_gemm_fp8.py``
  ``FP8GroupedGemmBlockFunc``; quantizers ``primus_turbo/triton/quantization/quant_blockwise.py``)
  and MX_BLOCKWISE as v0.4.0 implements it (``FP8GemmMXFunction``, ``FP8GroupedGemmMXFunc``;
  E8M0 scales from ``csrc/kernels/quantization/quantization_mxfp8.cu`` ``compute_tile_scale``).

Not modelled: the GPU (``group_lens.is_cuda`` is not asserted), the public ops' pre-quantized
inputs (``QuantizedTensor``, v0.3.1+; a pre-quantized operand reaches the low-level GEMM op only),
the gfx950 NT-layout backward copies (same numerics), MX GEMMs before v0.4.0 (other
definitions; titan-primus does not route them), the block GEMMs' own kernel tiling (the double
multiplies dequantized operands in float32).
"""

from __future__ import annotations

import collections
import enum
import functools
import sys
import types
import warnings
from dataclasses import dataclass

import torch

VERSIONS = ("v0.2.0", "v0.3.0", "v0.3.1", "v0.4.0")
LEGACY_VERSION = "v0.1.1"
"""Config enums at ``core.float8``; ``gemm_fp8`` has no ROWWISE path (``ops/gemm_fp8.py`` at v0.1.1)."""

KERNEL_CALLS: collections.Counter = collections.Counter()
"""Kernel launches by name (``gemm_fp8_impl``, ``quantize_fp8_rowwise``...), whichever path called them."""
GEMM_KERNELS = ("gemm_fp8_impl", "grouped_gemm_fp8_impl", "grouped_gemm_fp8_variable_k_impl")

_EPS = 1e-12


class Format(enum.Enum):
    E4M3 = enum.auto()
    E5M2 = enum.auto()
    E2M1_X2 = enum.auto()
    HYBRID = enum.auto()


class ScalingGranularity(enum.Enum):
    TENSORWISE = enum.auto()
    ROWWISE = enum.auto()
    BLOCKWISE = enum.auto()
    MX_BLOCKWISE = enum.auto()


class ScalingStrategy(enum.Enum):
    DYNAMIC = enum.auto()


class ScaleDtype(enum.Enum):
    FP32 = enum.auto()
    E8M0 = enum.auto()


BackendType = enum.Enum("BackendType", "CK HIPBLASLT AITER TRITON DEEP_EP TURBO FLYDSL")
"""``core/backend.py``: v0.3.0 and v0.3.1 end at TURBO, v0.4.0 appends FLYDSL (same values)."""


def _check_block_config(config) -> None:
    """``Float8QuantConfig.__post_init__`` (``core/low_precision.py``; v0.2.0 has no scale_dtype)."""
    if config.granularity == ScalingGranularity.BLOCKWISE:
        assert config.block_size is not None, "block_size must be set when granularity is BLOCKWISE"
    if config.granularity == ScalingGranularity.MX_BLOCKWISE:
        assert config.block_size in [32], "block_size should be [32] when granularity is MX_BLOCKWISE"
        if hasattr(config, "scale_dtype"):  # v0.3.0+
            assert config.scale_dtype == ScaleDtype.E8M0, (
                f"scale_dtype should be {ScaleDtype.E8M0} when granularity is MX_BLOCKWISE"
            )


@dataclass
class Float8QuantConfigV020:
    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    block_size: int | None = None

    def __post_init__(self):
        _check_block_config(self)


@dataclass
class Float8QuantConfigV030:
    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    scale_dtype: ScaleDtype = ScaleDtype.FP32
    block_size: int | None = None

    def __post_init__(self):
        _check_block_config(self)


class _Release:
    """What differs between releases (see the module docstring for the sources)."""

    def __init__(self, version: str, arch: str):
        if version not in (*VERSIONS, LEGACY_VERSION):
            raise ValueError(f"the double models {VERSIONS} (and {LEGACY_VERSION}'s layout), not {version}")
        self.version = version
        at_least = functools.partial(_at_least, version)
        self.legacy = version == LEGACY_VERSION
        self.hybrid_everywhere = at_least("v0.3.0")
        self.bf16_grouped_inputs_only = not at_least("v0.3.1")
        self.backward_from_fp8 = at_least("v0.3.1")
        self.dispatcher = at_least("v0.3.0")
        self.ck_rowwise_dense = not at_least("v0.4.0")
        self.triton_grouped = at_least("v0.3.1")
        self.zeroes_tail = at_least("v0.4.0")
        self.low_level_ops = at_least("v0.3.0")
        self.mx_v040 = at_least("v0.4.0")
        self.arch = arch
        fnuz = arch == "gfx942"
        self.e4m3 = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
        self.e5m2 = torch.float8_e5m2fnuz if fnuz else torch.float8_e5m2


def _at_least(version: str, tag: str) -> bool:
    def key(v):
        return tuple(int(p) for p in v.removeprefix("v").split("."))

    return key(version) >= key(tag)


_ACTIVE: list[_Release] = []
"""The installed release (the C++ quantize ops are process-wide; some rules depend on the tag)."""


def _active() -> _Release:
    if not _ACTIVE:
        raise RuntimeError("the Primus-Turbo double is not installed")
    return _ACTIVE[-1]


def _check(ok: bool, what: str, *detail) -> None:
    """PRIMUS_TURBO_CHECK (``csrc/include/primus_turbo/macros.h``): a RuntimeError from C++."""
    if not ok:
        raise RuntimeError(f"Assertion failed: {what}. " + "".join(str(d) for d in detail))


def _no_backend(dispatcher: str, **kwargs) -> ValueError:
    """``core/backend.py`` (v0.3.0+): no backend's can_handle accepts the inputs."""
    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return ValueError(f"No compatible backend found for {dispatcher} with inputs: {shown}")


_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


# ---- kernels: the device-side numerics, shared by the public ops and the low-level ops ----------


def _quantize_kernel(x: torch.Tensor, dest_dtype: torch.dtype, axis: int | None):
    KERNEL_CALLS["quantize_fp8_tensorwise" if axis is None else "quantize_fp8_rowwise"] += 1
    _check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
           "input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf || input.scalar_type() == at::kFloat")
    _check(dest_dtype in _FP8, "is_torch_fp8(dest_dtype)")
    # The kernels index data_ptr() as a dense row-major array (the Python wrappers assert it
    # from v0.3.1: kernels/quantization/quantization_impl.py).
    _check(x.is_contiguous(), "input.is_contiguous()", " (TEST DOUBLE: the kernel reads data_ptr() as dense)")
    xf = x.float()
    amax = xf.abs().amax() if axis is None else xf.abs().amax(dim=axis, keepdim=True)
    fp8_max = torch.finfo(dest_dtype).max
    # Two float32 divisions, each correctly rounded, as the device code does
    # (csrc/include/primus_turbo/device/quant_utils.cuh). Not ``fp8_max / t``: for a Python
    # scalar torch computes that as ``t.reciprocal() * fp8_max``, rounding twice.
    scale = torch.full_like(amax, fp8_max) / torch.clamp(amax, min=_EPS)
    scale_inv = torch.ones_like(scale) / scale
    return (xf * scale).clamp(-fp8_max, fp8_max).to(dest_dtype), scale_inv


def _dequantize_kernel(q: torch.Tensor, scale_inv: torch.Tensor, dest_dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale_inv).to(dest_dtype)


def _logical(t: torch.Tensor, trans: bool) -> torch.Tensor:
    return t.transpose(-2, -1) if trans else t


def _scaled(acc: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor) -> torch.Tensor:
    """Apply per-tensor or per-row-of-A / per-column-of-B scale inverses to an fp32 [M, N] result."""
    sa = a_scale_inv.reshape(-1, 1) if a_scale_inv.numel() > 1 else a_scale_inv.reshape(())
    sb = b_scale_inv.reshape(1, -1) if b_scale_inv.numel() > 1 else b_scale_inv.reshape(())
    return acc * sa * sb


def _gemm_kernel(release: _Release, a, a_scale_inv, trans_a, b, b_scale_inv, trans_b, out_dtype, trans_c,
                 granularity: ScalingGranularity, backend: BackendType):
    KERNEL_CALLS["gemm_fp8_impl"] += 1
    _check(a.dim() == 2 and b.dim() == 2, "a.dim() == 2 && b.dim() == 2")
    _check(a.dtype in _FP8 and b.dtype in _FP8, "is_8bit_floating_point_dtype(a/b)")
    # csrc/pytorch/gemm/hipblaslt_gemm.cpp (hipblaslt_gemm_fp8): A and B contiguous, TENSORWISE /
    # ROWWISE scale inverses kFloat; csrc/pytorch/gemm/ck_gemm.cpp reads a/b.data_ptr() as dense
    # and the scales as ``const float *``. A pre-quantized operand (an FSDP2-gathered weight, a
    # view of the all-gather output) must meet them too.
    _check(a.is_contiguous() and b.is_contiguous(), "A.is_contiguous() && B.is_contiguous()",
           "A and B must be contiguous")
    _check(a_scale_inv.dtype == torch.float32 and b_scale_inv.dtype == torch.float32,
           "scaleA_inv.scalar_type() == at::kFloat && scaleB_inv.scalar_type() == at::kFloat")
    if out_dtype not in _SIXTEEN_BIT:
        if release.dispatcher:  # kernels/gemm/gemm_fp8_impl.py: no backend lists fp32 output
            raise _no_backend("GEMMFP8KernelDispatcher", out_dtype=out_dtype, granularity=granularity)
        _check(False, "out_dtype == at::kBFloat16 || out_dtype == at::kHalf", "out_dtype must be kBFloat16 or kHalf")
    A, B = _logical(a, trans_a), _logical(b, trans_b)
    _check(A.shape[1] == B.shape[0], "GEMM K mismatch", f": a has K={A.shape[1]}, b has K={B.shape[0]}")
    if backend == BackendType.CK:
        # csrc/pytorch/gemm/ck_gemm.cpp: with trans_c the operands swap; the left one untransposed
        # (NT or NN) needs k % 32 == 0.
        lhs_trans = (not trans_b) if trans_c else trans_a
        if not lhs_trans:
            _check(A.shape[1] % 32 == 0, "k % 32 == 0", f"For NT or NN layout, k must be a multiple of 32, got k={A.shape[1]}")
    out = _scaled(A.float() @ B.float(), a_scale_inv, b_scale_inv).to(out_dtype)
    return out.t().contiguous() if trans_c else out


def _group_bounds(group_offs: torch.Tensor) -> list[tuple[int, int]]:
    offs = group_offs.tolist()
    return list(zip(offs[:-1], offs[1:]))


def _check_groups(group_lens, group_offs, groups: int) -> None:
    # csrc grouped GEMM bindings: PRIMUS_TURBO_CHECK on kLong group_lens; offsets [0, cumsum].
    _check(group_lens.dtype == torch.int64, "group_lens.scalar_type() == at::kLong", f" got {group_lens.dtype}")
    _check(group_lens.shape == (groups,), "group_lens.size(0) == b.size(0)")
    _check(group_offs.dtype == torch.int64 and group_offs.shape == (groups + 1,), "group_offs is int64 [G + 1]")
    _check(torch.equal(group_offs, torch.cat([group_offs.new_zeros(1), torch.cumsum(group_lens, 0)])),
           "group_offs == [0, cumsum(group_lens)]", " (TEST DOUBLE: the kernels trust both)")


def _check_grouped_operands(release: _Release, a, b, out_dtype, contraction: int | None) -> None:
    """``contraction``: the K the Triton kernel loops over in BLOCK_SIZE_K steps (None: the
    variable-K kernel, whose loop over a group's rows makes no such assumption)."""
    _check(a.dtype in _FP8 and b.dtype in _FP8, "a and b must be fp8")
    if out_dtype not in _SIXTEEN_BIT:
        raise _no_backend("GroupedGEMMFP8KernelDispatcher", out_dtype=out_dtype)
    # ops/grouped_gemm_fp8.py (v0.4.0): "Custom grouped GEMM kernels expect dense layouts."
    _check(a.is_contiguous() and b.is_contiguous(), "a and b are contiguous", " (grouped GEMM kernels expect dense layouts)")
    if contraction is not None:
        _check_triton_loop_k(release, contraction)
    if release.version == "v0.3.0" and a.dtype != b.dtype:
        warnings.warn(
            "For inputs: mixed FP8 dtypes, the default backend is not compatible, fallback backend "
            "HIPBLASLT is selected. The fallback backend may hurt performance!"
        )


def _check_triton_loop_k(release: _Release, contraction: int) -> None:
    if release.triton_grouped and contraction < 256:
        raise RuntimeError(
            f"TEST DOUBLE: the Triton grouped FP8 kernel assumes loop_k > 1 (tl.assume, BLOCK_SIZE_K 128); "
            f"contraction dim {contraction} < 256 is undefined behaviour on the real kernel"
        )


def _grouped_kernel(release: _Release, a, b, a_scales, b_scales, group_lens, group_offs, trans_a, trans_b,
                    out_dtype, granularity, num_cu=None, default_backend=None, maybe_pre_sync=False,
                    group_offs_out=None):
    """[sum rows, K] x [G, N, K] (trans_b) or [G, K, N] -> [rows, N]; rows past group_offs[-1]
    unwritten (NaN) before v0.4.0 and zeroed at v0.4.0."""
    KERNEL_CALLS["grouped_gemm_fp8_impl"] += 1
    _check(a.dim() == 2 and b.dim() == 3 and not trans_a, "a 2-D, b 3-D, trans_a == False")
    _check_groups(group_lens, group_offs, b.shape[0])
    B = _logical(b, trans_b)  # [G, K, N]
    _check(a.shape[1] == B.shape[1], "K mismatch", f": a {tuple(a.shape)}, b {tuple(b.shape)}, trans_b={trans_b}")
    _check_grouped_operands(release, a, b, out_dtype, a.shape[1])
    out = torch.full((a.shape[0], B.shape[2]), 0.0 if release.zeroes_tail else float("nan"))
    a_rows = a_scales.reshape(-1) if a_scales.numel() > 1 else a_scales.reshape(())
    for g, (s, e) in enumerate(_group_bounds(group_offs)):
        b_cols = b_scales[g].reshape(-1) if b_scales.numel() > 1 else b_scales.reshape(())
        sa = a_rows[s:e].reshape(-1, 1) if a_rows.dim() else a_rows
        out[s:e] = (a[s:e].float() @ B[g].float()) * sa * b_cols
    return out.to(out_dtype)


def _grouped_variable_k_kernel(release: _Release, a, b, a_scales, b_scales, group_lens, group_offs, trans_a,
                               trans_b, trans_c, out_dtype, granularity, num_cu=None, default_backend=None,
                               maybe_pre_sync=False):
    """Per group g: a[rows_g].T @ b[rows_g] ([K, N], or [N, K] with trans_c), contracting over the
    group's rows; scales are per column of a and b over all rows (wgrad)."""
    KERNEL_CALLS["grouped_gemm_fp8_variable_k_impl"] += 1
    _check(a.dim() == 2 and b.dim() == 2 and trans_a and not trans_b, "a, b 2-D; trans_a && !trans_b")
    _check_groups(group_lens, group_offs, group_lens.shape[0])
    _check_grouped_operands(release, a, b, out_dtype, None)
    sa = a_scales.reshape(-1, 1) if a_scales.numel() > 1 else a_scales.reshape(())
    sb = b_scales.reshape(1, -1) if b_scales.numel() > 1 else b_scales.reshape(())
    out = torch.zeros(group_lens.shape[0], a.shape[1], b.shape[1])
    for g, (s, e) in enumerate(_group_bounds(group_offs)):
        out[g] = (a[s:e].float().t() @ b[s:e].float()) * sa * sb
    out = out.to(out_dtype)
    return out.transpose(-2, -1).contiguous() if trans_c else out


# ---- the public ops' autograd Functions, built on the kernels as upstream builds them ------------


def _dtypes(release: _Release, config):
    fmt = config.format
    fwd = release.e5m2 if fmt == Format.E5M2 else release.e4m3
    bwd = release.e4m3 if fmt == Format.E4M3 else release.e5m2
    return fwd, bwd


def _check_config(release: _Release, config, op: str):
    if release.legacy and config.granularity in _BLOCK_GRANULARITIES:
        raise NotImplementedError("TEST DOUBLE: v0.1.x block-scaled GEMMs are not modelled")
    if release.legacy and config.granularity == ScalingGranularity.ROWWISE:
        raise ValueError(f"Unsupported granularity {config.granularity}")  # v0.1.1 ops/gemm_fp8.py
    if config.format == Format.HYBRID and not release.hybrid_everywhere:
        # v0.2.0 ops/gemm_fp8.py and ops/grouped_gemm_fp8.py: _get_fp8_dtype raises for HYBRID.
        if op == "grouped" or config.granularity == ScalingGranularity.TENSORWISE:
            raise ValueError(f"Unsupported FP8 format: {config.format}")


def _col_copy(release: _Release, t, q, s, dtype, axis):
    """Backward's column-wise copy: from ``t`` (before v0.3.1), or from its dequantized row copy."""
    src = _dequantize_kernel(q, s, t.dtype) if release.backward_from_fp8 else t
    return _quantize_kernel(src.contiguous(), dtype, axis)


class _Gemm(torch.autograd.Function):
    """FP8GemmTensorFunction / FP8GemmRowFunction (ops/gemm_fp8.py), NT layout (a [M,K], b [N,K])."""

    @staticmethod
    def forward(ctx, a, b, out_dtype, config, release: _Release):
        fwd, bwd = _dtypes(release, config)
        rowwise = config.granularity == ScalingGranularity.ROWWISE
        axis = -1 if rowwise else None
        aq, sa = _quantize_kernel(a, fwd, axis)
        bq, sb = _quantize_kernel(b, fwd, axis)
        if rowwise:
            # v0.3.x default to CK, v0.4.0 to Triton. v0.2.0 is hard-coded to CK but pads K to
            # 128 in Python (ops/gemm_fp8.py): its forward never meets CK's k % 32 rule (modelled
            # by not naming CK here), its dgrad does.
            backend = BackendType.CK if release.ck_rowwise_dense and release.dispatcher else BackendType.TRITON
            out = _gemm_kernel(release, aq, sa, False, bq, sb, True, out_dtype, False, config.granularity, backend)
            aq, sa = _col_copy(release, a, aq, sa, fwd, -2)
            bq, sb = _col_copy(release, b, bq, sb, fwd, -2)
        else:
            out = _gemm_kernel(release, aq, sa, False, bq, sb, True, out_dtype, False, config.granularity,
                               BackendType.HIPBLASLT)
        ctx.save_for_backward(aq, sa, bq, sb)
        ctx.release, ctx.config, ctx.bwd, ctx.out_dtype = release, config, bwd, out_dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        aq, sa, bq, sb = ctx.saved_tensors
        release, config = ctx.release, ctx.config
        grad = grad.contiguous()
        if config.granularity == ScalingGranularity.ROWWISE:
            backend = BackendType.CK if release.ck_rowwise_dense else BackendType.TRITON
            gq, sg = _quantize_kernel(grad, ctx.bwd, -1)
            grad_a = _gemm_kernel(release, gq, sg, False, bq, sb, False, ctx.out_dtype, False, config.granularity, backend)
            gq, sg = _quantize_kernel(grad, ctx.bwd, -2)
        else:
            backend = BackendType.HIPBLASLT
            gq, sg = _quantize_kernel(grad, ctx.bwd, None)
            grad_a = _gemm_kernel(release, gq, sg, False, bq, sb, False, ctx.out_dtype, False, config.granularity, backend)
        grad_b = _gemm_kernel(release, aq, sa, True, gq, sg, False, ctx.out_dtype, True, config.granularity, backend)
        return grad_a, grad_b, None, None, None


class _GroupedGemm(torch.autograd.Function):
    """FP8GroupedGemmTensorFunc / FP8GroupedGemmRowFunc (ops/grouped_gemm_fp8.py)."""

    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, trans_b, out_dtype, config, release: _Release):
        fwd, bwd = _dtypes(release, config)
        rowwise = config.granularity == ScalingGranularity.ROWWISE
        b_row_axis, b_col_axis = (-1, -2) if trans_b else (-2, -1)
        aq, sa = _quantize_kernel(a, fwd, -1 if rowwise else None)
        bq, sb = _quantize_kernel(b, fwd, b_row_axis if rowwise else None)
        out = _grouped_kernel(release, aq, bq, sa, sb, group_lens, group_offs, False, trans_b, out_dtype,
                              config.granularity.value)
        if rowwise:
            aq, sa = _col_copy(release, a, aq, sa, fwd, -2)
            bq, sb = _col_copy(release, b, bq, sb, fwd, b_col_axis)
        ctx.save_for_backward(aq, bq, sa, sb, group_lens, group_offs)
        ctx.release, ctx.config, ctx.bwd, ctx.out_dtype, ctx.trans_b = release, config, bwd, out_dtype, trans_b
        return out

    @staticmethod
    def backward(ctx, grad):
        aq, bq, sa, sb, group_lens, group_offs = ctx.saved_tensors
        release, config = ctx.release, ctx.config
        grad = grad.contiguous()
        rowwise = config.granularity == ScalingGranularity.ROWWISE
        gq, sg = _quantize_kernel(grad, ctx.bwd, -1 if rowwise else None)
        grad_a = _grouped_kernel(release, gq, bq, sg, sb, group_lens, group_offs, False, not ctx.trans_b,
                                 ctx.out_dtype, config.granularity.value)
        if rowwise:
            gq, sg = _quantize_kernel(grad, ctx.bwd, -2)
        grad_b = _grouped_variable_k_kernel(release, aq, gq, sa, sg, group_lens, group_offs, True, False,
                                            ctx.trans_b, ctx.out_dtype, config.granularity.value)
        return grad_a, grad_b, None, None, None, None, None, None


# ---- block-scaled GEMMs: BLOCKWISE (every tag) and MX_BLOCKWISE (v0.4.0) ---------------------------

_BLOCK_GRANULARITIES = (ScalingGranularity.BLOCKWISE, ScalingGranularity.MX_BLOCKWISE)
_BLOCKWISE_AMAX_FLOOR = 1e-4
"""``quant_blockwise.py`` (v0.2.0-v0.4.0): ``amax = tl.maximum(amax, 1e-4)`` before FP8_MAX / amax."""
_MX_E4M3_MAX_POW2 = 8
"""``quantization_mxfp8.cu``: FP8E4M3_TARGET_MAX_POW2 (448 = 1.75 * 2**8)."""


def _block_quantize(x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, mx: bool):
    """``x`` [R, C] in (rows, cols) tiles from index 0, the last partial tile zero-padded (the
    Triton / FlyDSL quantizers load with masks, other=0). Returns (payload [R, C], the float32
    value each tile's payload is multiplied by [ceil(R/rows), ceil(C/cols)])."""
    R, C = x.shape
    nr, nc = -(-R // rows), -(-C // cols)
    tiles = torch.nn.functional.pad(x.float(), (0, nc * cols - C, 0, nr * rows - R)).reshape(nr, rows, nc, cols)
    amax = tiles.abs().amax(dim=(1, 3))
    fp8_max = torch.finfo(dtype).max
    if mx:
        # compute_tile_scale: round amax's float32 bits at e4m3's 3 mantissa bits (+ 1 << 19),
        # take the biased exponent, subtract 127 + 8, clamp to [-127, 128]; payload x * (1 / 2**e).
        biased = torch.bitwise_right_shift(amax.view(torch.int32) + (1 << 19), 23) & 0x1FF
        e = (biased - 127 - _MX_E4M3_MAX_POW2).clamp(-127, 128).float()
        scale_inv, scale = torch.exp2(e), torch.exp2(-e)
    else:
        # compute_scale_and_quant: float32 FP8_MAX / max(amax, 1e-4), scale_inv = 1.0 / scale.
        scale = torch.full_like(amax, fp8_max) / torch.clamp(amax, min=_BLOCKWISE_AMAX_FLOOR)
        scale_inv = torch.ones_like(scale) / scale
    q = (tiles * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(dtype)
    return q.reshape(nr * rows, nc * cols)[:R, :C], scale_inv


def _block_dequantized(x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, mx: bool) -> torch.Tensor:
    """What a block-scaled GEMM multiplies: each tile's payload times its scale_inv, float32."""
    KERNEL_CALLS["quantize_fp8_mx" if mx else "quantize_fp8_blockwise"] += 1
    q, scale_inv = _block_quantize(x, rows, cols, dtype, mx)
    R, C = x.shape
    expanded = scale_inv.repeat_interleave(rows, 0)[:R].repeat_interleave(cols, 1)[:, :C]
    return q.float() * expanded


def _segment_dequantized(x_t: torch.Tensor, group_offs, block: int, dtype, mx: bool) -> torch.Tensor:
    """``x_t`` [C, tokens] in 1 x ``block`` tiles along the tokens, restarting at each group: the
    column-wise casts of a grouped wgrad pad every group ("segment") to the block
    (``quant_fp8_blockwise_segment_m_*`` for BLOCKWISE, ``grouped_quantize_fp8_with_trans`` for MX)."""
    out = torch.zeros(x_t.shape, dtype=torch.float32)
    for s, e in _group_bounds(group_offs):
        if e > s:
            out[:, s:e] = _block_dequantized(x_t[:, s:e], 1, block, dtype, mx)
    return out


def _block_sizes(config) -> tuple[int, int, bool]:
    """(activation tile, weight block side, MX?): BLOCKWISE 1x128 / 128x128; MX 1x32 / 32x32
    (v0.4.0 ``ScalingRecipe(use_2d_block=True)`` for B)."""
    mx = config.granularity == ScalingGranularity.MX_BLOCKWISE
    return config.block_size, config.block_size, mx


def _check_mx(release: _Release, what: str) -> None:
    # core/low_precision.py check_mxfp8_support: compute capability >= (9, 5), i.e. gfx950.
    if release.arch != "gfx950":
        raise AssertionError("Device compute capability gfx950 or higher required for MXFP8 execution.")
    if not release.mx_v040:
        raise NotImplementedError(f"TEST DOUBLE: models v0.4.0's MX {what} only (this is {release.version})")


class _BlockGemm(torch.autograd.Function):
    """FP8GemmBlockFunction / FP8GemmMXFunction (ops/gemm_fp8.py), NT layout: a [M, K], b [N, K].
    Every operand of every GEMM is cast from the high-precision tensor (BLOCKWISE at every tag;
    MX at v0.4.0 via quantize_mxfp8_flydsl_impl's dual cast); the weight's square blocks serve
    both the output and the grad_input GEMM."""

    @staticmethod
    def forward(ctx, a, b, out_dtype, config, release: _Release):
        tile, side, mx = _block_sizes(config)
        dtype = release.e4m3  # Format.E4M3: e4m3 forward and backward
        KERNEL_CALLS["gemm_fp8_mx" if mx else "gemm_fp8_blockwise"] += 1
        _check_16_bit(out_dtype)
        out = _block_dequantized(a, 1, tile, dtype, mx) @ _block_dequantized(b, side, side, dtype, mx).t()
        ctx.save_for_backward(a, b)
        ctx.sizes, ctx.dtype, ctx.out_dtype = (tile, side, mx), dtype, out_dtype
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        (tile, side, mx), dtype = ctx.sizes, ctx.dtype
        KERNEL_CALLS["gemm_fp8_mx" if mx else "gemm_fp8_blockwise"] += 2
        grad = grad.contiguous()
        grad_a = _block_dequantized(grad, 1, tile, dtype, mx) @ _block_dequantized(b, side, side, dtype, mx)
        # wgrad contracts over M: grad_out^T [N, M] and a^T [K, M] in 1 x tile tiles along M.
        grad_b = _block_dequantized(grad.t(), 1, tile, dtype, mx) @ _block_dequantized(a.t(), 1, tile, dtype, mx).t()
        return grad_a.to(ctx.out_dtype), grad_b.to(ctx.out_dtype), None, None, None


class _BlockGroupedGemm(torch.autograd.Function):
    """FP8GroupedGemmBlockFunc (ops/grouped_gemm_fp8.py, every tag) / FP8GroupedGemmMXFunc (v0.4.0):
    a [rows, K] in row tiles; b per expert in square blocks; wgrad tiles along each group's tokens."""

    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, trans_b, out_dtype, config, release: _Release):
        tile, side, mx = _block_sizes(config)
        dtype = release.e4m3
        KERNEL_CALLS["grouped_gemm_fp8_mx" if mx else "grouped_gemm_fp8_blockwise"] += 1
        _check_groups(group_lens, group_offs, b.shape[0])
        _check_16_bit(out_dtype)
        B = _logical(b, not trans_b)  # [G, N, K]
        _check(a.shape[1] == B.shape[2], "K mismatch", f": a {tuple(a.shape)}, b {tuple(b.shape)}, trans_b={trans_b}")
        if not mx:  # _grouped_blockwise_fp8_persistent_gemm_kernel: tl.assume(loop_k > 1) (v0.3.1+)
            for contraction in (a.shape[1], B.shape[1]):  # K forward, N dgrad
                _check_triton_loop_k(release, contraction)
        a_deq = _block_dequantized(a, 1, tile, dtype, mx)
        out = torch.full((a.shape[0], B.shape[1]), 0.0 if release.zeroes_tail else float("nan"))
        for g, (s, e) in enumerate(_group_bounds(group_offs)):
            out[s:e] = a_deq[s:e] @ _block_dequantized(B[g], side, side, dtype, mx).t()
        ctx.save_for_backward(a, b, group_offs)
        ctx.sizes, ctx.dtype, ctx.out_dtype, ctx.trans_b, ctx.release = (tile, side, mx), dtype, out_dtype, trans_b, release
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, group_offs = ctx.saved_tensors
        (tile, side, mx), dtype = ctx.sizes, ctx.dtype
        KERNEL_CALLS["grouped_gemm_fp8_mx" if mx else "grouped_gemm_fp8_blockwise"] += 2
        grad = grad.contiguous()
        B = _logical(b, not ctx.trans_b)  # [G, N, K]
        g_deq = _block_dequantized(grad, 1, tile, dtype, mx)
        grad_a = torch.full(a.shape, 0.0 if ctx.release.zeroes_tail else float("nan"))
        g_t = _segment_dequantized(grad.t(), group_offs, tile, dtype, mx)
        a_t = _segment_dequantized(a.t(), group_offs, tile, dtype, mx)
        grad_B = torch.zeros(B.shape)
        for g, (s, e) in enumerate(_group_bounds(group_offs)):
            grad_a[s:e] = g_deq[s:e] @ _block_dequantized(B[g], side, side, dtype, mx)
            grad_B[g] = g_t[:, s:e] @ a_t[:, s:e].t()
        grad_b = _logical(grad_B, not ctx.trans_b).contiguous()
        return grad_a.to(ctx.out_dtype), grad_b.to(ctx.out_dtype), None, None, None, None, None, None


def _check_16_bit(out_dtype) -> None:
    # ops/gemm_fp8.py, ops/grouped_gemm_fp8.py: assert out_dtype in [torch.float16, torch.bfloat16]
    assert out_dtype in _SIXTEEN_BIT, f"out_dtype must be fp16 or bf16, got {out_dtype}"


# ---- the low-level custom ops, with fake implementations (v0.3.0+) ---------------------------------


def _gemm_fake(a, a_scale_inv, trans_a, b, b_scale_inv, trans_b, out_dtype, trans_c, granularity, default_backend):
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    return a.new_empty((n, m) if trans_c else (m, n), dtype=out_dtype)


def _grouped_fake(a, b, a_scales, b_scales, group_lens, group_offs, trans_a, trans_b, out_dtype, granularity,
                  num_cu, default_backend, maybe_pre_sync=False, group_offs_out=None):
    # kernels/grouped_gemm/grouped_gemm_fp8_impl.py's meta impl asserts these.
    assert a.dim() == 2, f"a must be 2D, got {a.shape}"
    assert b.dim() == 3, f"b must be 3D, got {b.shape}"
    assert out_dtype in [torch.float16, torch.bfloat16], f"out_dtype must be fp16 or bf16, got {out_dtype}"
    return a.new_empty((a.shape[0], b.shape[1] if trans_b else b.shape[2]), dtype=out_dtype)


def _variable_k_fake(a, b, a_scales, b_scales, group_lens, group_offs, trans_a, trans_b, trans_c, out_dtype,
                     granularity, num_cu, default_backend, maybe_pre_sync=False):
    assert a.dim() == 2, f"a must be 2D, got {a.shape}"
    assert b.dim() == 2, f"b must be 2D, got {b.shape}"
    assert out_dtype in [torch.float16, torch.bfloat16], f"out_dtype must be fp16 or bf16, got {out_dtype}"
    k, n = a.shape[1], b.shape[1]
    return a.new_empty((group_lens.shape[0], n, k) if trans_c else (group_lens.shape[0], k, n), dtype=out_dtype)


@functools.cache
def _low_level_ops(version: str) -> types.SimpleNamespace:
    """``primus_turbo::gemm_fp8_impl`` and the grouped ops, as registered at ``version``."""
    ns = "primus_turbo_double_" + version.replace(".", "_")
    release = lambda: _active()  # noqa: E731  (the arch's formats come from the installed release)

    def register(name, impl, fake):
        op = torch.library.custom_op(f"{ns}::{name}", mutates_args=())(impl)
        op.register_fake(fake)
        return op

    def gemm_fp8_impl(a: torch.Tensor, a_scale_inv: torch.Tensor, trans_a: bool, b: torch.Tensor,
                      b_scale_inv: torch.Tensor, trans_b: bool, out_dtype: torch.dtype, trans_c: bool,
                      granularity: int, default_backend: int) -> torch.Tensor:
        return _gemm_kernel(release(), a, a_scale_inv, trans_a, b, b_scale_inv, trans_b, out_dtype, trans_c,
                            ScalingGranularity(granularity), BackendType(default_backend))

    def variable_k(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                   group_lens: torch.Tensor, group_offs: torch.Tensor, trans_a: bool, trans_b: bool, trans_c: bool,
                   out_dtype: torch.dtype, granularity: int, num_cu: int | None, default_backend: int,
                   maybe_pre_sync: bool = False) -> torch.Tensor:
        return _grouped_variable_k_kernel(release(), a, b, a_scales, b_scales, group_lens, group_offs, trans_a,
                                          trans_b, trans_c, out_dtype, granularity)

    if _at_least(version, "v0.4.0"):
        def grouped(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                    group_lens: torch.Tensor, group_offs: torch.Tensor, trans_a: bool, trans_b: bool,
                    out_dtype: torch.dtype, granularity: int, num_cu: int | None, default_backend: int,
                    maybe_pre_sync: bool = False, group_offs_out: torch.Tensor | None = None) -> torch.Tensor:
            return _grouped_kernel(release(), a, b, a_scales, b_scales, group_lens, group_offs, trans_a, trans_b,
                                   out_dtype, granularity)
    else:
        def grouped(a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                    group_lens: torch.Tensor, group_offs: torch.Tensor, trans_a: bool, trans_b: bool,
                    out_dtype: torch.dtype, granularity: int, num_cu: int | None, default_backend: int,
                    maybe_pre_sync: bool = False) -> torch.Tensor:
            return _grouped_kernel(release(), a, b, a_scales, b_scales, group_lens, group_offs, trans_a, trans_b,
                                   out_dtype, granularity)

    return types.SimpleNamespace(
        gemm_fp8_impl=register("gemm_fp8_impl", gemm_fp8_impl, _gemm_fake),
        grouped_gemm_fp8_impl=register("grouped_gemm_fp8_impl", grouped, _grouped_fake),
        grouped_gemm_fp8_variable_k_impl=register("grouped_gemm_fp8_variable_k_impl", variable_k, _variable_k_fake),
    )


_CPP_SCHEMAS = {  # csrc/pytorch/bindings_pytorch.cpp m.def, identical at v0.2.0-v0.4.0 (dequantize: v0.3.1+)
    "quantize_fp8_tensorwise": "(Tensor input, ScalarType dest_dtype, Tensor? scale_opt=None) -> Tensor[]",
    "quantize_fp8_rowwise": "(Tensor input, ScalarType dest_dtype, int axis, Tensor? scale_opt=None) -> Tensor[]",
    "dequantize_fp8_rowwise": "(Tensor input, Tensor scale_inv, int axis, ScalarType dest_dtype) -> Tensor",
}


def _quantize_fp8_tensorwise(input, dest_dtype, scale_opt=None):
    assert scale_opt is None, "the double models dynamic scaling only"
    return list(_quantize_kernel(input, dest_dtype, None))


def _quantize_fp8_rowwise(input, dest_dtype, axis, scale_opt=None):
    assert scale_opt is None, "the double models dynamic scaling only"
    return list(_quantize_kernel(input, dest_dtype, axis))


def _dequantize_fp8_rowwise(input, scale_inv, axis, dest_dtype):
    if not _active().backward_from_fp8:
        raise AttributeError(f"'_OpNamespace' 'primus_turbo_cpp_extension' object has no attribute "
                             f"'dequantize_fp8_rowwise' (it arrived in v0.3.1; this is {_active().version})")
    KERNEL_CALLS["dequantize_fp8_rowwise"] += 1
    _check(dest_dtype in (torch.bfloat16, torch.float16, torch.float32), "dest_dtype is bf16, fp16 or fp32")
    _check(input.dtype in _FP8, "is_torch_fp8(input.scalar_type())")
    return _dequantize_kernel(input, scale_inv, dest_dtype)


def _quantize_meta(input, dest_dtype, axis=None, scale_opt=None):
    scale_shape = [] if axis is None else [1 if d == axis % input.dim() else n for d, n in enumerate(input.shape)]
    return [input.new_empty(input.shape, dtype=dest_dtype), input.new_empty(scale_shape, dtype=torch.float32)]


@functools.cache
def _register_cpp_extension_ops() -> None:
    """``primus_turbo_cpp_extension::*`` with the upstream schemas, kernels and meta impls."""
    lib = torch.library.Library("primus_turbo_cpp_extension", "DEF")
    impls = {
        "quantize_fp8_tensorwise": (_quantize_fp8_tensorwise,
                                    lambda input, dest_dtype, scale_opt=None: _quantize_meta(input, dest_dtype)),
        "quantize_fp8_rowwise": (_quantize_fp8_rowwise, _quantize_meta),
        "dequantize_fp8_rowwise": (_dequantize_fp8_rowwise,
                                   lambda input, scale_inv, axis, dest_dtype: input.new_empty(input.shape, dtype=dest_dtype)),
    }
    for name, (kernel, meta) in impls.items():
        lib.define(name + _CPP_SCHEMAS[name])
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"primus_turbo_cpp_extension::{name}", meta, lib=lib)
    _LIBRARIES.append(lib)  # a Library unregisters its ops when collected


_LIBRARIES: list = []


# ---- the package as the adapter imports it -----------------------------------------------------------


class _Api:
    def __init__(self, release: _Release):
        self.release = release
        self.calls: list[tuple[str, int, tuple[str, ...]]] = []
        self.call_kwargs: list[dict] = []

    def recorded(self, fn):
        """``fn``, noting each call's positional count and keyword names in ``calls``."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.calls.append((fn.__name__, len(args), tuple(kwargs)))
            self.call_kwargs.append(kwargs)
            return fn(*args, **kwargs)

        return call


def _build(version: str, arch: str) -> tuple[_Api, dict[str, types.ModuleType], types.ModuleType]:
    release = _Release(version, arch)
    api = _Api(release)
    Float8QuantConfig = Float8QuantConfigV030 if release.hybrid_everywhere else Float8QuantConfigV020

    def gemm_fp8(a, b, trans_a=False, trans_b=False, out_dtype=None, config=None):
        assert a.ndim == 2, "Only 2D tensors are supported"
        assert b.ndim == 2, "Only 2D tensors are supported"
        config = config or Float8QuantConfig()
        _check_config(release, config, "gemm")
        if config.granularity in (ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE):
            assert trans_a == False, "trans_a has to be False"  # noqa: E712  (upstream's wording)
        if config.granularity == ScalingGranularity.MX_BLOCKWISE:
            _check_mx(release, "dense GEMM")
            assert trans_a == False and trans_b == True, "trans_a has to be False and trans_b has to be True"  # noqa: E712
        assert not trans_a and trans_b, "TEST DOUBLE: models the NT layout (trans_a=False, trans_b=True) only"
        out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
        if config.granularity in _BLOCK_GRANULARITIES:
            return _BlockGemm.apply(a, b, out_dtype, config, release)
        return _Gemm.apply(a, b, out_dtype, config, release)

    def grouped_impl(a, b, group_lens, group_offs, trans_b, out_dtype, config):
        assert a.dim() == 2 and b.dim() == 3, "grouped_gemm_fp8 takes 2-D a and 3-D b"
        if release.bf16_grouped_inputs_only:  # v0.2.0 / v0.3.0 ops/grouped_gemm_fp8.py
            assert a.dtype in (torch.bfloat16, torch.float16) and b.dtype in (torch.bfloat16, torch.float16)
        if group_offs is None:  # grouped_gemm_utils.group_offs_from_lens
            group_offs = torch.cat([group_lens.new_zeros(1), torch.cumsum(group_lens, 0)])
        config = config or Float8QuantConfig()
        _check_config(release, config, "grouped")
        if config.granularity == ScalingGranularity.BLOCKWISE:
            assert config.block_size in [128], "Only block_size 128 is supported currently."
        if config.granularity == ScalingGranularity.MX_BLOCKWISE:
            if not release.mx_v040:  # v0.2.0-v0.3.1 grouped_gemm_fp8 dispatches no MX granularity
                raise ValueError(f"Unsupported FP8 ScalingGranularity: {config.granularity}")
            _check_mx(release, "grouped GEMM")
            assert trans_b, "MXFP8 grouped GEMM only supports trans_b=True (NT layout)."
        if config.granularity in _BLOCK_GRANULARITIES:
            return _BlockGroupedGemm.apply(a, b, group_lens, group_offs, trans_b, out_dtype, config, release)
        return _GroupedGemm.apply(a, b, group_lens, group_offs, trans_b, out_dtype, config, release)

    if not release.backward_from_fp8:
        def grouped_gemm_fp8(a, b, group_lens, group_offs=None, trans_b=True, config=None, num_cu=None):
            return grouped_impl(a, b, group_lens, group_offs, trans_b, a.dtype, config)
    else:
        def grouped_gemm_fp8(a, b, group_lens, group_offs=None, trans_b=True, out_dtype=None, config=None, num_cu=None):
            return grouped_impl(a, b, group_lens, group_offs, trans_b,
                                out_dtype or torch.promote_types(a.dtype, b.dtype), config)

        grouped_gemm_fp8 = torch._dynamo.disable(grouped_gemm_fp8)
        gemm_fp8 = torch._dynamo.disable(gemm_fp8)

    low_precision = types.ModuleType("low_precision")
    for name, obj in (("Format", Format), ("ScalingGranularity", ScalingGranularity),
                      ("ScalingStrategy", ScalingStrategy), ("Float8QuantConfig", Float8QuantConfig)):
        setattr(low_precision, name, obj)
    if release.hybrid_everywhere:
        low_precision.ScaleDtype = ScaleDtype
    ops = types.ModuleType("primus_turbo.pytorch.ops")
    ops.gemm_fp8, ops.grouped_gemm_fp8 = api.recorded(gemm_fp8), api.recorded(grouped_gemm_fp8)
    pytorch = types.ModuleType("primus_turbo.pytorch")
    pytorch.ops = ops
    pytorch.float8_e4m3, pytorch.float8_e5m2 = release.e4m3, release.e5m2
    core = types.ModuleType("primus_turbo.pytorch.core")
    pytorch.core = core
    root = types.ModuleType("primus_turbo")
    root.pytorch = pytorch
    modules = {
        "primus_turbo": root,
        "primus_turbo.pytorch": pytorch,
        "primus_turbo.pytorch.ops": ops,
        "primus_turbo.pytorch.core": core,
    }
    kernel_modules = {
        "primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl": ("gemm_fp8_impl",),
        "primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl": (
            "grouped_gemm_fp8_impl", "grouped_gemm_fp8_variable_k_impl"),
    }
    if release.low_level_ops:
        backend_module = types.ModuleType("primus_turbo.pytorch.core.backend")
        members = [m.name for m in BackendType if m.name != "FLYDSL" or _at_least(version, "v0.4.0")]
        backend_module.BackendType = enum.Enum("BackendType", members)
        modules[backend_module.__name__] = backend_module
    for path, names in kernel_modules.items():
        if release.low_level_ops:
            module = types.ModuleType(path)
            for name in names:
                setattr(module, name, getattr(_low_level_ops(version), name))
            modules[path] = module
        else:
            modules[path] = None  # absent before v0.3.0: importing it fails
    return api, modules, low_precision


def install(monkeypatch, version: str = "v0.4.0", arch: str = "gfx942") -> _Api:
    """Put the double into sys.modules as ``primus_turbo`` (undone by ``monkeypatch``).

    ``version`` is one of VERSIONS, or LEGACY_VERSION (v0.1.x: the config enums at ``core.float8``,
    no ROWWISE GEMM). Returns the API object, whose ``calls`` records what the adapter called.
    """
    _register_cpp_extension_ops()
    api, modules, config_module = _build(version, arch)
    config_name = "float8" if api.release.legacy else "low_precision"
    config_module.__name__ = f"primus_turbo.pytorch.core.{config_name}"
    setattr(modules["primus_turbo.pytorch.core"], config_name, config_module)
    modules[config_module.__name__] = config_module
    # The absent config home must fail to import, as it does upstream.
    modules["primus_turbo.pytorch.core." + ("low_precision" if api.release.legacy else "float8")] = None
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys.modules[__name__], "_ACTIVE", [api.release])
    KERNEL_CALLS.clear()
    return api
