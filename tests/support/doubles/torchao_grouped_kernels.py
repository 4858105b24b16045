"""CPU stand-ins for the kernels under TorchAO's FP8 rowwise grouped GEMM (TEST DOUBLE).

TorchAO's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (0.17+) is Python around four Triton
quantizers and ``torch._scaled_grouped_mm``, none of which runs on a CPU. With these installed,
TorchAO's own Python runs for real (its layout and shape asserts, its autograd Function, the
transposes between the kernels) and only the kernels are replaced: each stand-in computes what the
TorchAO 0.18 kernel does (fp32 scales ``fp8_max / max(amax, 1e-12)`` taken in float64, floored to
a power of 2; scale, clamp, cast), returns the layouts it returns, and the GEMM refuses what the
CUDA kernel refuses (:func:`kernel_preconditions`: torch's own checks of dtypes, layouts and
16-byte strides, run on meta copies of the operands, the 16-byte aligned data pointers, and
TorchAO's group sizes in multiples of 16). Rows past the last group are left NaN, as undefined as
the kernel leaves them. Evidence about TorchAO's Python, not its kernels.

What the memory audit measures on it is therefore what TorchAO 0.18 itself keeps: its
``_Float8GroupedMM.forward`` saves ``padded_A`` (A as handed over, ``pad_token_groups_for_grouped_mm``
being False), ``B_t`` and the offsets (``torchao/prototype/moe_training/fp8_grouped_mm.py``, lines
155-157), none of the stand-ins' outputs."""

from __future__ import annotations

import torch

_QUANTIZERS = (
    "triton_fp8_rowwise_2d_scale_and_cast",
    "triton_fp8_colwise_3d_scale_and_cast",
    "triton_fp8_rowwise_3d_transpose_rhs",
    "triton_fp8_per_group_colwise_scales_dual",
)


def _scales(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    scales = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(scales))) if pow2 else scales


def _cast(t: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8_max = torch.finfo(dtype).max
    return (t.float() * scales).clamp(-fp8_max, fp8_max).to(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def rowwise_2d_scale_and_cast(hp, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False):
    """[M, K] -> row-major FP8 [M, K], scales [M, 1] (each row over K)."""
    scales = _scales(hp.abs().amax(dim=-1, keepdim=True), output_dtype, round_scales_to_power_of_2)
    return _cast(hp, scales, output_dtype).contiguous(), scales


def colwise_3d_scale_and_cast(hp, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False):
    """[E, K, N] -> column-major FP8 [E, K, N], scales [E, 1, N] (each (e, n) over K)."""
    scales = _scales(hp.abs().amax(dim=-2, keepdim=True), output_dtype, round_scales_to_power_of_2)
    return _column_major(_cast(hp, scales, output_dtype)), scales


def rowwise_3d_transpose_rhs(hp, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False):
    """[E, K, N] -> column-major FP8 [E, N, K] (the transpose), scales [E, K] (each (e, k) over N)."""
    scales = _scales(hp.abs().amax(dim=-1, keepdim=True), output_dtype, round_scales_to_power_of_2)
    return _cast(hp, scales, output_dtype).contiguous().transpose(-2, -1), scales.squeeze(-1)


def per_group_colwise_scales_dual(
    hp_1, hp_2, offsets, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False
):
    """Two [M, C] tensors, each column of each group of rows scaled alone -> for each, a
    column-major FP8 [M, C] and flat group-major scales [E * C]."""
    starts = [0, *offsets.tolist()[:-1]]
    out = []
    for hp in (hp_1, hp_2):
        data = torch.zeros(hp.shape, dtype=output_dtype)
        scales = []
        for start, end in zip(starts, offsets.tolist()):
            group_scales = _scales(
                hp[start:end].abs().amax(dim=0) if end > start else hp.new_zeros(hp.shape[1]),
                output_dtype,
                round_scales_to_power_of_2,
            )
            data[start:end] = _cast(hp[start:end], group_scales, output_dtype)
            scales.append(group_scales)
        out += [_column_major(data), torch.cat(scales)]
    return tuple(out)


ALIGNMENT_BYTES = 16


def kernel_preconditions(mat_a, mat_b, scale_a, scale_b, offs, out_dtype) -> None:
    """Raise where ``torch._scaled_grouped_mm``'s CUDA kernel raises (or computes nothing
    defined):

    - torch's own checks, run on meta tensors with the operands' shapes and strides: FP8 E4M3
      operands, ``mat_a`` row-major and ``mat_b`` column-major, the leading stride of each a
      multiple of 16 bytes ("strides should be multiple of 16 bytes" on an H200, 2026-12-03,
      for grad_B over 41 tokens), float32 scales of the right shapes (torch/_meta_registrations.py,
      ``_meta_grouped_mm_common``, which implements aten/src/ATen/native/cuda/Blas.cpp's checks);
    - each operand's data pointer 16-byte aligned, which the meta check cannot see ("expected
      data_ptr to be aligned to 16 bytes": ``check_valid_strides_and_return_transposed``,
      aten/src/ATen/native/GroupedMMUtils.h, called for both operands before the kernel);
    - every group boundary a multiple of 16 rows where groups split the contraction (2-D x 2-D,
      the weight gradient), so each group's operands start 16-byte aligned for the kernel's TMA
      loads. torch does not check this one (it would need the offsets on the host): the GPU
      computes with misaligned groups, undefined, and TorchAO 0.18 states it as its op's
      precondition: "Group sizes must be divisible by 16"
      (torchao/prototype/moe_training/fp8_grouped_mm.py, docstring of
      ``_to_fp8_rowwise_then_scaled_grouped_mm``).

    TorchAO's Triton quantizers' stand-ins check no preconditions: theirs were not read."""

    def meta(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    torch.ops.aten._scaled_grouped_mm.default(
        meta(mat_a), meta(mat_b), meta(scale_a), meta(scale_b), meta(offs), out_dtype=out_dtype
    )
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.data_ptr() % ALIGNMENT_BYTES:
            raise RuntimeError(f"{name}: expected data_ptr to be aligned to 16 bytes")
    if mat_a.dim() == mat_b.dim() == 2:
        unaligned = [end for end in offs.tolist() if end * mat_a.element_size() % ALIGNMENT_BYTES]
        if unaligned:
            raise RuntimeError(
                f"group boundaries {unaligned} along the contraction are not multiples of 16 bytes "
                f"(TorchAO: group sizes must be divisible by 16)"
            )


def scaled_grouped_mm(
    mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """``torch._scaled_grouped_mm`` with reciprocal scales: 2-D x 3-D (groups of rows of
    ``mat_a``) or 2-D x 2-D (groups along the contraction, one [N, K] output per group)."""
    kernel_preconditions(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
    ends = offs.tolist()
    groups = list(zip([0, *ends[:-1]], ends))
    if mat_b.dim() == 3:
        a = mat_a.float() * scale_a.reshape(-1, 1)
        out = torch.full((mat_a.shape[0], mat_b.shape[-1]), float("nan"), dtype=out_dtype)
        for g, (start, end) in enumerate(groups):
            out[start:end] = (a[start:end] @ (mat_b[g].float() * scale_b[g].reshape(1, -1))).to(out_dtype)
        return out
    scale_a, scale_b = scale_a.reshape(len(groups), -1), scale_b.reshape(len(groups), -1)
    return torch.stack(
        [
            ((mat_a[:, start:end].float() * scale_a[g].reshape(-1, 1)) @ (mat_b[start:end].float() * scale_b[g])).to(
                out_dtype
            )
            for g, (start, end) in enumerate(groups)
        ]
    )


# Each stand-in as a custom op with a fake implementation (the shapes and layouts the kernel
# returns), as TorchAO's Triton kernels are custom ops: TorchAO's Python then traces into
# torch.compile(fullgraph=True) graphs, and the stand-ins run (and record) when the graph runs.
_RECEIVED: dict[str, list[torch.Tensor]] = {name: [] for name in _QUANTIZERS}


def _fp8_like(t, dtype, column_major=False):
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    return _column_major(out) if column_major else out


def _custom_op(name, stand_in, fake):
    op = torch.library.custom_op(f"titan_primus_test::torchao_{name}", mutates_args=())(stand_in)
    op.register_fake(fake)
    return op


def _recorded(name, stand_in):
    def op(
        hp: torch.Tensor, output_dtype: torch.dtype, round_scales_to_power_of_2: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _RECEIVED[name].append(hp)
        return stand_in(hp, output_dtype, round_scales_to_power_of_2)

    op.__name__ = name
    return op


def _recorded_dual(
    hp_1: torch.Tensor, hp_2: torch.Tensor, offsets: torch.Tensor, output_dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _RECEIVED["triton_fp8_per_group_colwise_scales_dual"].append(hp_1)
    return per_group_colwise_scales_dual(hp_1, hp_2, offsets, output_dtype, pow2)


def _stand_in_gemm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=out_dtype)


_OPS = {
    "triton_fp8_rowwise_2d_scale_and_cast": _custom_op(
        "rowwise_2d",
        _recorded("triton_fp8_rowwise_2d_scale_and_cast", rowwise_2d_scale_and_cast),
        lambda hp, d, p: (_fp8_like(hp, d), hp.new_empty((*hp.shape[:-1], 1), dtype=torch.float32)),
    ),
    "triton_fp8_colwise_3d_scale_and_cast": _custom_op(
        "colwise_3d",
        _recorded("triton_fp8_colwise_3d_scale_and_cast", colwise_3d_scale_and_cast),
        lambda hp, d, p: (_fp8_like(hp, d, True), hp.new_empty((hp.shape[0], 1, hp.shape[2]), dtype=torch.float32)),
    ),
    "triton_fp8_rowwise_3d_transpose_rhs": _custom_op(
        "rowwise_3d_transpose_rhs",
        _recorded("triton_fp8_rowwise_3d_transpose_rhs", rowwise_3d_transpose_rhs),
        lambda hp, d, p: (_fp8_like(hp, d).transpose(-2, -1), hp.new_empty(hp.shape[:2], dtype=torch.float32)),
    ),
    "triton_fp8_per_group_colwise_scales_dual": _custom_op(
        "per_group_colwise_scales_dual",
        _recorded_dual,
        lambda a, b, offs, d, p: (
            _fp8_like(a, d, True),
            a.new_empty(a.shape[1] * offs.shape[0], dtype=torch.float32),
            _fp8_like(b, d, True),
            b.new_empty(b.shape[1] * offs.shape[0], dtype=torch.float32),
        ),
    ),
}
_GEMM = _custom_op(
    "scaled_grouped_mm",
    _stand_in_gemm,
    lambda a, b, sa, sb, offs, out_dtype: (
        a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)
        if b.dim() == 3
        else a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=out_dtype)
    ),
)


def install(monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Swap the kernels TorchAO's FP8 grouped GEMM calls (the names its module imported, and
    ``torch._scaled_grouped_mm``) for the stand-ins above, eager and compiled. Returns, per
    quantizer name, the high-precision tensors it was given (what reached TorchAO's kernel
    boundary), from now on."""
    import torchao.prototype.moe_training.fp8_grouped_mm as fp8_grouped_mm

    for name, op in _OPS.items():
        assert hasattr(fp8_grouped_mm, name), f"TorchAO's fp8_grouped_mm no longer calls {name}"
        _RECEIVED[name].clear()
        if name == "triton_fp8_per_group_colwise_scales_dual":
            call = lambda a, b, offs, output_dtype, round_scales_to_power_of_2=False, op=op: op(  # noqa: E731
                a, b, offs, output_dtype, round_scales_to_power_of_2
            )
        else:
            call = lambda hp, output_dtype, round_scales_to_power_of_2=False, op=op: op(  # noqa: E731
                hp, output_dtype, round_scales_to_power_of_2
            )
        monkeypatch.setattr(fp8_grouped_mm, name, call)

    def gemm(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, **_):
        assert bias is None and scale_result is None
        return _GEMM(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", gemm)
    return _RECEIVED
