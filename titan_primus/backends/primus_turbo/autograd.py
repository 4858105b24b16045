"""The FP8 linear and grouped GEMM on Primus-Turbo's low-level ops, eager and compiled alike.

Each Function runs the algorithm of Primus-Turbo's own autograd Function for its granularity
(``ops/gemm_fp8.py``: ``FP8Gemm{Tensor,Row,Block}Function``; ``ops/grouped_gemm_fp8.py``:
``FP8GroupedGemm{Tensor,Row,Block}Func``) with the same quantizers
(``kernels/quantization/quantization_impl.py``), the same GEMM ops
(``primus_turbo::gemm_fp8_impl``, ``grouped_gemm_fp8_impl``,
``grouped_gemm_fp8_variable_k_impl``), operand layouts and default backends, so its results are
Primus-Turbo's own, bit for bit (tests/real_turbo checks that against each build). Two things
differ, both about memory:

- What backward needs of the weight is made again from the weight in backward (the same
  quantization of the same values, so the same bits), where Primus-Turbo's Functions keep an FP8
  copy of it from forward to backward. Under FSDP2 the weight's storage is freed after each
  layer's forward and gathered again for its backward: a copy would keep every layer's
  unsharded weight resident at once. What is saved is the weight itself (the parameter FSDP2
  manages, or the FP8 weight it gathered) and the FP8 copies of the activation backward uses.
- All ops are custom ops with fake implementations, so the Functions trace into
  ``torch.compile(fullgraph=True)`` graphs (Primus-Turbo's public ops are
  ``torch._dynamo.disable``d).

A weight FSDP2 gathered in FP8 (:class:`~titan_primus.fsdp_fp8.gathered.Fp8GatheredWeight`, tensorwise and
rowwise) is taken as it is: its payload and ``scale_inv`` are exactly what the quantizer would
have made of the gathered bf16 weight.
"""

from __future__ import annotations

import torch

from ...fsdp_fp8.gathered import Fp8GatheredWeight
from ...grouping import group_lens
from ...recipes import sixteen_bit
from .release import TurboApi, require_api
from .rules import BLOCKWISE_SIZE, dense_backend

__all__ = ["TurboLinear", "TurboGroupedMM", "GRANULARITY"]

GRANULARITY = {"tensorwise": "TENSORWISE", "rowwise": "ROWWISE", "blockwise": "BLOCKWISE"}
_GROUPED_BACKEND = "TRITON"  # every build's grouped Functions, for these three granularities


def _granularity(api: TurboApi, recipe: str) -> int:
    return api.enums.ScalingGranularity[GRANULARITY[recipe]].value


def _backend(api: TurboApi, name: str) -> int:
    return api.backend_type[name].value


def _quantize(api: TurboApi, t: torch.Tensor, dtype: torch.dtype, recipe: str, axis: int | None = None):
    """(FP8 data, scale_inv) as ``QuantizedTensor.quantize`` makes them (tensorwise: axis None)."""
    if recipe == "tensorwise":
        return api.quant.quantize_fp8_tensorwise_impl(x=t, out_dtype=dtype)
    return api.quant.quantize_fp8_rowwise_impl(x=t, out_dtype=dtype, axis=axis % t.dim())


def _requantized(api: TurboApi, q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, axis: int, new_axis: int):
    """A rowwise copy quantized along ``new_axis`` from the ``axis`` copy dequantized to
    ``dtype`` (``QuantizedTensor.quantize(quantized.dequantize(), ...)``)."""
    source = api.quant.dequantize_fp8_rowwise_impl(x=q, out_dtype=dtype, axis=axis % q.dim(), scale_inv=scale_inv)
    return _quantize(api, source, q.dtype, "rowwise", new_axis)


def _weight_forward(api: TurboApi, weight: torch.Tensor, dtype: torch.dtype, recipe: str, axis: int):
    """The forward FP8 weight: the one FSDP2 gathered, or quantized here."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight.fp8_data(), weight.scale_inv()
    if recipe == "blockwise":
        return api.quant.quant_fp8_blockwise_for_weight_impl(w=weight, dtype=dtype, block_size=BLOCKWISE_SIZE)
    return _quantize(api, weight, dtype, recipe, axis)


@torch.library.custom_op("titan_primus::primus_turbo_weight_for_backward", mutates_args=())
def _weight_for_backward(
    weight: torch.Tensor,
    scale_inv: torch.Tensor | None,
    grad: torch.Tensor,
    recipe: str,
    fp8_dtype: torch.dtype,
    source_dtype: torch.dtype,
    axis: int,
    new_axis: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight backward reads, made again from the weight (``scale_inv`` given: ``weight``
    is the FP8 payload FSDP2 gathered): tensorwise and blockwise use the forward cast; rowwise
    re-quantizes it dequantized, along the other dim.

    Under torch.compile the joint graph would otherwise keep an FP8 weight copy from forward to
    backward: a custom op of its own, so it is not merged with the forward's identical cast, and
    taking the incoming gradient (unused), so the partitioner cannot place it in the forward. Its
    fake implementation is the same code, on Primus-Turbo's fake implementations. Its outputs are
    always new tensors (a custom op must not alias its inputs): a gathered payload backward reads
    as it is (tensorwise, blockwise) is not passed through it."""
    api = require_api()
    if scale_inv is None:
        q, scale_inv = _weight_forward(api, weight, fp8_dtype, recipe, axis)
    elif recipe != "rowwise":
        raise ValueError(
            f"primus_turbo_weight_for_backward would return its inputs for a gathered {recipe} weight "
            f"(a custom op must not alias them): use the gathered payload itself"
        )
    else:
        q = weight
    if recipe != "rowwise":
        return q, scale_inv
    source = api.quant.dequantize_fp8_rowwise_impl(
        x=q, out_dtype=source_dtype, axis=axis % q.dim(), scale_inv=scale_inv
    )
    return _quantize(api, source, fp8_dtype, "rowwise", new_axis)


_weight_for_backward.register_fake(_weight_for_backward._init_fn)


def _weight_backward(
    weight: torch.Tensor, grad: torch.Tensor, fp8_dtype: torch.dtype, recipe: str, axis: int, new_axis: int
):
    if not isinstance(weight, Fp8GatheredWeight):
        return _weight_for_backward(weight, None, grad, recipe, fp8_dtype, weight.dtype, axis, new_axis)
    if recipe != "rowwise":  # the gathered payload itself, FSDP2's storage
        return weight.fp8_data(), weight.scale_inv()
    return _weight_for_backward(
        weight.fp8_data(), weight.scale_inv(), grad, recipe, fp8_dtype, weight._source_dtype, axis, new_axis
    )


def _gemm(
    api: TurboApi,
    a,
    a_scale_inv,
    trans_a: bool,
    b,
    b_scale_inv,
    trans_b: bool,
    out_dtype,
    trans_c: bool,
    granularity: int,
    backend: int,
):
    """``primus_turbo::gemm_fp8_impl``, called by its schema's argument names (the same at every
    verified build), so that an argument a newer build adds with a default changes nothing and a
    renamed or removed one fails by name instead of shifting values into other parameters."""
    return api.gemm(
        a=a,
        a_scale_inv=a_scale_inv,
        trans_a=trans_a,
        b=b,
        b_scale_inv=b_scale_inv,
        trans_b=trans_b,
        out_dtype=out_dtype,
        trans_c=trans_c,
        granularity=granularity,
        default_backend=backend,
    )


def _nt_backward(api: TurboApi, trans_b: bool) -> bool:
    """gfx950 tensorwise backward runs NT-layout GEMMs on transposed FP8 copies from
    v0.3.2.dev48 (``_deter_use_nt_layout_gemm_in_bwd``: not on gfx942, only for trans_b)."""
    return api.at_least("v0.3.2.dev48") and api.float8_e4m3 == torch.float8_e4m3fn and trans_b


class TurboLinear(torch.autograd.Function):
    """x [M, K] @ weight [N, K].T (``gemm_fp8(x, weight, trans_b=True)``) -> [M, N] in x.dtype.

    A gradient that is not needed (a frozen weight, an input that needs none) costs neither its
    GEMM nor the casts only it reads, and forward keeps nothing for it: a frozen weight keeps
    no FP8 copy of x, an x that needs no gradient keeps no weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str):
        api = require_api()
        fwd, _ = api.formats(recipe)
        granularity, backend = _granularity(api, recipe), _backend(api, dense_backend(api, recipe))
        need_x, need_w = ctx.needs_input_grad[:2]
        out_dtype = sixteen_bit(x.dtype)
        x = x.contiguous()
        x_col = sx_col = None
        if recipe == "blockwise":  # one kernel casts both ways; the column cast is kept only for wgrad
            xq, sx, x_col, sx_col = api.quant.quant_fp8_blockwise_dual_impl(x=x, dtype=fwd, block_size=BLOCKWISE_SIZE)
        else:
            xq, sx = _quantize(api, x, fwd, recipe, -1)
        wq, sw = _weight_forward(api, weight, fwd, recipe, -1)
        out = _gemm(api, xq, sx, False, wq, sw, True, out_dtype, False, granularity, backend)
        if not need_w:
            x_col = sx_col = None
        elif recipe == "rowwise":
            x_col, sx_col = _requantized(api, xq, sx, x.dtype, -1, -2)
        elif recipe == "tensorwise":
            x_col, sx_col = (xq.t().contiguous(), sx) if _nt_backward(api, True) else (xq, sx)
        ctx.save_for_backward(x_col, sx_col, weight if need_x else None)
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, weight.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x_col, sx_col, weight = ctx.saved_tensors
        api, recipe = require_api(), ctx.recipe
        need_x, need_w = ctx.needs_input_grad[:2]
        fwd, bwd = api.formats(recipe)
        granularity, backend = _granularity(api, recipe), _backend(api, dense_backend(api, recipe))
        nt = recipe == "tensorwise" and _nt_backward(api, True)
        # The gradient of the kernel's 16-bit output (fp32 layers get a bf16 result upcast).
        out_dtype = sixteen_bit(grad.dtype)
        grad = grad.to(out_dtype).contiguous()
        gq = sg = g_col = sg_col = grad_x = grad_w = None
        if recipe == "blockwise":  # one kernel casts both ways
            gq, sg, g_col, sg_col = api.quant.quant_fp8_blockwise_dual_impl(
                x=grad, dtype=bwd, block_size=BLOCKWISE_SIZE
            )
        elif need_x or recipe == "tensorwise":  # tensorwise: one cast serves both GEMMs
            gq, sg = _quantize(api, grad, bwd, recipe, -1)
        if need_x:
            wq, sw = _weight_backward(weight, grad, fwd, recipe, -1, -2)
            if nt:
                wq = wq.t().contiguous()
            grad_x = _gemm(api, gq, sg, False, wq, sw, nt, out_dtype, False, granularity, backend)
            grad_x = grad_x.to(ctx.dtypes[0])
        if need_w:
            if nt:
                grad_w = _gemm(
                    api, x_col, sx_col, False, gq.t().contiguous(), sg, True, out_dtype, True, granularity, backend
                )
            else:
                if recipe == "rowwise":
                    g_col, sg_col = _quantize(api, grad, bwd, recipe, -2)
                elif recipe == "tensorwise":
                    g_col, sg_col = gq, sg
                grad_w = _gemm(api, x_col, sx_col, True, g_col, sg_col, False, out_dtype, True, granularity, backend)
            grad_w = grad_w.to(ctx.dtypes[1])
        return grad_x, grad_w, None


def _b_layout(B_t: torch.Tensor, nt_only: bool = False) -> tuple[torch.Tensor, bool]:
    """(b, trans_b) for a [E, K, N] ``B_t`` without a copy where its layout allows one:
    TorchTitan's transposed view of [E, N, K] weights as that contiguous tensor (trans_b=True),
    a contiguous [E, K, N] as it is (trans_b=False); ``nt_only``: always trans_b=True."""
    b = B_t.transpose(-2, -1)
    if nt_only:
        return b.contiguous(), True
    if B_t.is_contiguous():
        return B_t, False
    return (b, True) if b.is_contiguous() else (B_t.contiguous(), False)


def group_offsets(offs: torch.Tensor) -> torch.Tensor:
    """Primus-Turbo's ``group_offs`` ([0, cumsum(group_lens)], int64) from TorchTitan's int32 end
    offsets, without a host sync."""
    return torch.cat([offs.new_zeros(1), offs]).to(torch.int64)


def _grouped_gemm(api: TurboApi, a, b, a_scales, b_scales, lens, goffs, trans_b: bool, granularity: int, backend: int):
    """``primus_turbo::grouped_gemm_fp8_impl`` over groups of rows of ``a``, bf16 out."""
    # By the schema's argument names, as _gemm.
    return api.grouped(
        a=a,
        b=b,
        a_scales=a_scales,
        b_scales=b_scales,
        group_lens=lens,
        group_offs=goffs,
        trans_a=False,
        trans_b=trans_b,
        out_dtype=torch.bfloat16,
        granularity=granularity,
        num_cu=None,
        default_backend=backend,
    )


class TurboGroupedMM(torch.autograd.Function):
    """A [R, K] x B_t [E, K, N] per group of rows (offs: int32 end offsets) -> [R, N] bf16.
    A gradient that is not needed costs neither its GEMM nor the casts only it reads, and
    forward keeps nothing for it (as :class:`TurboLinear`)."""

    @staticmethod
    def forward(ctx, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: str):
        api = require_api()
        fwd, _ = api.formats(recipe)
        granularity, backend = _granularity(api, recipe), _backend(api, _GROUPED_BACKEND)
        need_A, need_B = ctx.needs_input_grad[:2]
        b, trans_b = _b_layout(B_t)
        b_row, b_col = (-1, -2) if trans_b else (-2, -1)  # over K, over N
        lens, goffs = group_lens(offs), group_offsets(offs)
        A = A.contiguous()
        a_col = sa_col = None
        if recipe == "blockwise":  # one kernel casts both ways; the column cast is kept only for wgrad
            aq, a_col, sa, sa_col, _, _ = api.quant.quant_fp8_blockwise_segment_m_row_col_impl(
                x=A,
                dtype=fwd,
                block_size=BLOCKWISE_SIZE,
                group_lens=lens,
                group_offs=goffs,
                gemm_other_dim=b.shape[b_col],
            )
        else:
            aq, sa = _quantize(api, A, fwd, recipe, -1)
        bq, sb = _weight_forward(api, b, fwd, recipe, b_row)
        out = _grouped_gemm(api, aq, bq, sa, sb, lens, goffs, trans_b, granularity, backend)
        if not need_B:
            a_col = sa_col = None
        elif recipe == "rowwise":
            a_col, sa_col = _requantized(api, aq, sa, A.dtype, -1, -2)  # per k over all rows of all groups
        elif recipe == "tensorwise":
            a_col, sa_col = aq, sa
        ctx.save_for_backward(a_col, sa_col, b if need_A else None, lens, goffs)
        ctx.recipe, ctx.trans_b, ctx.dtypes, ctx.b_shape = recipe, trans_b, (A.dtype, B_t.dtype), b.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        a_col, sa_col, b, lens, goffs = ctx.saved_tensors
        api, recipe, trans_b = require_api(), ctx.recipe, ctx.trans_b
        need_A, need_B = ctx.needs_input_grad[:2]
        fwd, bwd = api.formats(recipe)
        granularity, backend = _granularity(api, recipe), _backend(api, _GROUPED_BACKEND)
        b_row, b_col = (-1, -2) if trans_b else (-2, -1)
        grad = grad.contiguous()
        vk_lens, vk_offs = lens, goffs
        gq = sg = g_col = sg_col = grad_A = grad_B_t = None
        if recipe == "blockwise":  # one kernel casts both ways
            gq, g_col, sg, sg_col, vk_lens, vk_offs = api.quant.quant_fp8_blockwise_segment_m_row_col_impl(
                x=grad,
                dtype=bwd,
                block_size=BLOCKWISE_SIZE,
                group_lens=lens,
                group_offs=goffs,
                gemm_other_dim=ctx.b_shape[b_row],
            )
        elif need_A or recipe == "tensorwise":  # tensorwise: one cast serves both GEMMs
            gq, sg = _quantize(api, grad, bwd, recipe, -1)
        A_dtype, B_dtype = ctx.dtypes
        if need_A:
            bq, sb = _weight_backward(b, grad, fwd, recipe, b_row, b_col)
            if recipe == "tensorwise" and _nt_backward(api, trans_b):
                bq_nt, dgrad_trans_b = bq.transpose(-1, -2).contiguous(), True
            else:
                bq_nt, dgrad_trans_b = bq, not trans_b
            grad_A = _grouped_gemm(api, gq, bq_nt, sg, sb, lens, goffs, dgrad_trans_b, granularity, backend)
            grad_A = grad_A.to(A_dtype)
        if need_B:
            if recipe == "rowwise":
                g_col, sg_col = _quantize(api, grad, bwd, recipe, -2)
            elif recipe == "tensorwise":
                g_col, sg_col = gq, sg
            grad_b = api.grouped_variable_k(
                a=a_col,
                b=g_col,
                a_scales=sa_col,
                b_scales=sg_col,
                group_lens=vk_lens,
                group_offs=vk_offs,
                trans_a=True,
                trans_b=False,
                trans_c=trans_b,
                out_dtype=torch.bfloat16,
                granularity=granularity,
                num_cu=None,
                default_backend=backend,
            )
            grad_B_t = (grad_b.transpose(-2, -1) if trans_b else grad_b).to(B_dtype)
        return grad_A, grad_B_t, None, None
