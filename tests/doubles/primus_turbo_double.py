"""A TEST DOUBLE of Primus-Turbo's public FP8 API: not Primus-Turbo, and no evidence about it.

Written from Primus-Turbo's documented signatures and its quantization code as read at tags
v0.2.0, v0.3.0, v0.3.1 and v0.4.0 (see tests/data/primus_turbo_api.json, which the tests check
this double against), so the titan-primus adapter can be exercised on a CPU. It implements the
numerics independently of titan_primus (its own quantizer, following Primus-Turbo: fp32 amax,
scale = fp8_max / max(amax, 1e-12), dequantize as q * (1 / scale)), checks arguments the way the
real kernels do (2-D operands, trans flags, int64 group_lens, bf16/fp16 inputs before v0.3.1,
HYBRID rejected by v0.2.0's tensorwise and grouped paths), and fills every output row it does not
write with NaN, the worst case of the real kernels' torch.empty outputs (v0.2.0-v0.3.1 leave them
uninitialised; v0.4.0 zeroes them).

Not modelled: the GPU (group_lens.is_cuda is not asserted), pre-quantized inputs, BLOCKWISE/MX.
"""

from __future__ import annotations

import enum
import functools
import sys
import types
from dataclasses import dataclass

import torch

VERSIONS = ("v0.2.0", "v0.3.0", "v0.3.1", "v0.4.0")


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


@dataclass
class Float8QuantConfigV020:
    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    block_size: int | None = None


@dataclass
class Float8QuantConfigV030:
    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.DYNAMIC
    scale_dtype: ScaleDtype = ScaleDtype.FP32
    block_size: int | None = None


class _Quirks:
    """What differs between releases."""

    def __init__(self, version: str, arch: str):
        if version not in VERSIONS:
            raise ValueError(f"the double models {VERSIONS}, not {version}")
        self.version = version
        self.hybrid_everywhere = version != "v0.2.0"
        self.bf16_inputs_only = version in ("v0.2.0", "v0.3.0")
        self.col_copies_from_fp8 = version in ("v0.3.1", "v0.4.0")
        fnuz = arch == "gfx942"
        self.e4m3 = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
        self.e5m2 = torch.float8_e5m2fnuz if fnuz else torch.float8_e5m2


def _quant(x: torch.Tensor, dtype: torch.dtype, reduce_axis: int | None):
    """Primus-Turbo's dynamic quantizer; returns (fp8, scale_inv)."""
    xf = x.float()
    amax = xf.abs().amax() if reduce_axis is None else xf.abs().amax(dim=reduce_axis, keepdim=True)
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / torch.clamp(amax, min=1e-12)
    return (xf * scale).clamp(-fp8_max, fp8_max).to(dtype), 1.0 / scale


def _deq(q, scale_inv) -> torch.Tensor:
    return q.float() * scale_inv


class _Api:
    def __init__(self, quirks: _Quirks):
        self.q = quirks
        self.calls: list[tuple[str, int, tuple[str, ...]]] = []

    def recorded(self, fn):
        """``fn``, noting each call's positional count and keyword names in ``calls``."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.calls.append((fn.__name__, len(args), tuple(kwargs)))
            return fn(*args, **kwargs)

        return call

    def dtypes(self, config):
        fmt = config.format
        fwd = self.q.e5m2 if fmt == Format.E5M2 else self.q.e4m3
        bwd = self.q.e4m3 if fmt == Format.E4M3 else self.q.e5m2
        return fwd, bwd

    def check_config(self, config, op: str):
        if config.granularity not in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
            raise NotImplementedError("the double models TENSORWISE and ROWWISE only")
        if config.format == Format.HYBRID and not self.q.hybrid_everywhere:
            if op == "grouped" or config.granularity == ScalingGranularity.TENSORWISE:
                raise ValueError("Format.HYBRID is not supported here (Primus-Turbo v0.2.0)")

    def col_source(self, x, row_q, row_s):
        """Backward's column-wise copy starts from x, or (v0.3.1+) from its dequantized row copy."""
        return _deq(row_q, row_s).to(x.dtype) if self.q.col_copies_from_fp8 else x


class _Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, out_dtype, config, api: _Api):
        fwd, bwd = api.dtypes(config)
        rowwise = config.granularity == ScalingGranularity.ROWWISE
        axis = -1 if rowwise else None  # rowwise: a per row over K, b [N, K] per row over K
        aq, sa = _quant(a, fwd, axis)
        bq, sb = _quant(b, fwd, axis)
        ctx.save_for_backward(a, b, aq, sa, bq, sb)
        ctx.api, ctx.config, ctx.rowwise, ctx.bwd = api, config, rowwise, bwd
        return (_deq(aq, sa) @ _deq(bq, sb).t()).to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, aq, sa, bq, sb = ctx.saved_tensors
        api = ctx.api
        if ctx.rowwise:
            g_row = _deq(*_quant(grad, ctx.bwd, -1))  # per row over N
            g_col = _deq(*_quant(grad, ctx.bwd, -2))  # per n over M
            fwd = aq.dtype
            a_col = _deq(*_quant(api.col_source(a, aq, sa), fwd, -2))  # per k over M
            b_col = _deq(*_quant(api.col_source(b, bq, sb), fwd, -2))  # per k over N
            grad_a, grad_b = g_row @ b_col, g_col.t() @ a_col
        else:  # tensorwise: the forward FP8 copies are reused
            g = _deq(*_quant(grad, ctx.bwd, None))
            grad_a, grad_b = g @ _deq(bq, sb), g.t() @ _deq(aq, sa)
        return grad_a.to(a.dtype), grad_b.to(b.dtype), None, None, None


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, out_dtype, config, api: _Api):
        fwd, bwd = api.dtypes(config)
        rowwise = config.granularity == ScalingGranularity.ROWWISE
        axis = -1 if rowwise else None  # rowwise: a per token over K, b [G, N, K] per (g, n) over K
        aq, sa = _quant(a, fwd, axis)
        bq, sb = _quant(b, fwd, axis)
        ends = torch.cumsum(group_lens, 0).tolist()
        starts = [0, *ends[:-1]]
        out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.float32)
        ad, bd = _deq(aq, sa), _deq(bq, sb)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = ad[s:e] @ bd[g].t()
        ctx.save_for_backward(a, b, aq, sa, bq, sb)
        ctx.api, ctx.rowwise, ctx.bwd, ctx.bounds = api, rowwise, bwd, list(zip(starts, ends))
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, aq, sa, bq, sb = ctx.saved_tensors
        api = ctx.api
        if ctx.rowwise:
            g_row = _deq(*_quant(grad, ctx.bwd, -1))  # per token over N
            g_col = _deq(*_quant(grad, ctx.bwd, -2))  # per n over ALL rows, shared by every group
            fwd = aq.dtype
            b_col = _deq(*_quant(api.col_source(b, bq, sb), fwd, -2))  # per (g, k) over N
            a_col = _deq(*_quant(api.col_source(a, aq, sa), fwd, -2))  # per k over ALL rows
        else:
            g_row = g_col = _deq(*_quant(grad, ctx.bwd, None))
            b_col, a_col = _deq(bq, sb), _deq(aq, sa)
        grad_a = torch.full(a.shape, float("nan"), dtype=torch.float32)
        grad_b = torch.zeros(b.shape, dtype=torch.float32)
        for g, (s, e) in enumerate(ctx.bounds):
            grad_a[s:e] = g_row[s:e] @ b_col[g]
            grad_b[g] = g_col[s:e].t() @ a_col[s:e]
        return grad_a.to(a.dtype), grad_b.to(b.dtype), None, None, None, None


def _build(version: str, arch: str) -> tuple[_Api, dict[str, types.ModuleType], types.ModuleType]:
    quirks = _Quirks(version, arch)
    api = _Api(quirks)
    Float8QuantConfig = Float8QuantConfigV020 if version == "v0.2.0" else Float8QuantConfigV030

    def gemm_impl(a, b, trans_a, trans_b, out_dtype, config):
        assert a.dim() == 2 and b.dim() == 2, "gemm_fp8 takes 2-D a and b"
        config = config or Float8QuantConfig()
        api.check_config(config, "gemm")
        if config.granularity == ScalingGranularity.ROWWISE:
            assert not trans_a, "ROWWISE requires trans_a=False"
        assert not trans_a and trans_b, "the double models the NT layout (trans_a=False, trans_b=True) only"
        assert a.shape[1] == b.shape[1], f"K mismatch: a {tuple(a.shape)}, b {tuple(b.shape)} (trans_b=True)"
        out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
        return _Gemm.apply(a, b, out_dtype, config, api)

    def gemm_fp8(a, b, trans_a=False, trans_b=False, out_dtype=None, config=None):
        return gemm_impl(a, b, trans_a, trans_b, out_dtype, config)

    def grouped_impl(a, b, group_lens, group_offs, trans_b, out_dtype, config, num_cu):
        assert a.dim() == 2 and b.dim() == 3, "grouped_gemm_fp8 takes 2-D a and 3-D b"
        assert group_lens.dtype == torch.int64, f"group_lens must be int64 (kLong), got {group_lens.dtype}"
        assert group_lens.shape == (b.shape[0],), "one group_lens entry per group of b"
        assert trans_b, "the double models trans_b=True ([G, N, K] weights) only"
        assert a.shape[1] == b.shape[2], f"K mismatch: a {tuple(a.shape)}, b {tuple(b.shape)}"
        if quirks.bf16_inputs_only:
            assert a.dtype in (torch.bfloat16, torch.float16) and b.dtype in (torch.bfloat16, torch.float16)
        config = config or Float8QuantConfig()
        api.check_config(config, "grouped")
        return _GroupedGemm.apply(a, b, group_lens, out_dtype, config, api)

    if version in ("v0.2.0", "v0.3.0"):
        def grouped_gemm_fp8(a, b, group_lens, group_offs=None, trans_b=True, config=None, num_cu=None):
            return grouped_impl(a, b, group_lens, group_offs, trans_b, a.dtype, config, num_cu)
    else:
        def grouped_gemm_fp8(a, b, group_lens, group_offs=None, trans_b=True, out_dtype=None, config=None, num_cu=None):
            return grouped_impl(a, b, group_lens, group_offs, trans_b,
                                out_dtype or torch.promote_types(a.dtype, b.dtype), config, num_cu)

        grouped_gemm_fp8 = torch._dynamo.disable(grouped_gemm_fp8)
        gemm_fp8 = torch._dynamo.disable(gemm_fp8)

    low_precision = types.ModuleType("low_precision")
    for name, obj in (("Format", Format), ("ScalingGranularity", ScalingGranularity),
                      ("ScalingStrategy", ScalingStrategy), ("Float8QuantConfig", Float8QuantConfig)):
        setattr(low_precision, name, obj)
    if version != "v0.2.0":
        low_precision.ScaleDtype = ScaleDtype
    ops = types.ModuleType("primus_turbo.pytorch.ops")
    ops.gemm_fp8, ops.grouped_gemm_fp8 = api.recorded(gemm_fp8), api.recorded(grouped_gemm_fp8)
    pytorch = types.ModuleType("primus_turbo.pytorch")
    pytorch.ops = ops
    pytorch.float8_e4m3, pytorch.float8_e5m2 = quirks.e4m3, quirks.e5m2
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
    return api, modules, low_precision


def install(monkeypatch, version: str = "v0.4.0", arch: str = "gfx942", legacy_config_module: bool = False) -> _Api:
    """Put the double into sys.modules as ``primus_turbo`` (undone by ``monkeypatch``).

    ``legacy_config_module`` places the config enums at ``core.float8`` (their v0.1.x home) instead
    of ``core.low_precision``. Returns the API object, whose ``calls`` records what the adapter called.
    """
    api, modules, config_module = _build(version, arch)
    config_name = "float8" if legacy_config_module else "low_precision"
    config_module.__name__ = f"primus_turbo.pytorch.core.{config_name}"
    setattr(modules["primus_turbo.pytorch.core"], config_name, config_module)
    modules[config_module.__name__] = config_module
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    # The absent config home must fail to import, as it does upstream.
    other = "low_precision" if legacy_config_module else "float8"
    monkeypatch.setitem(sys.modules, f"primus_turbo.pytorch.core.{other}", None)
    return api
