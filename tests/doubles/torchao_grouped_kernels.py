"""CPU stand-ins for the kernels under TorchAO's FP8 rowwise grouped GEMM (TEST DOUBLE).

TorchAO's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (0.17+) is Python around four Triton
quantizers and ``torch._scaled_grouped_mm``, none of which runs on a CPU. With these installed,
TorchAO's own Python runs for real (its layout and shape asserts, its autograd Function, the
transposes between the kernels) and only the kernels are replaced: each stand-in computes what the
TorchAO 0.18 kernel does (fp32 scales ``fp8_max / max(amax, 1e-12)`` taken in float64, floored to
a power of 2; scale, clamp, cast), returns the layouts it returns, and the GEMM checks the
layouts the CUDA kernel requires (A row-major, B column-major). Rows past the last group are left
NaN, as undefined as the kernel leaves them. Evidence about TorchAO's Python, not its kernels."""

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


def scaled_grouped_mm(
    mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """``torch._scaled_grouped_mm`` with reciprocal scales: 2-D x 3-D (groups of rows of
    ``mat_a``) or 2-D x 2-D (groups along the contraction, one [N, K] output per group)."""
    assert mat_a.stride(-1) == 1, f"mat_a must be row-major, strides {mat_a.stride()}"
    assert mat_b.stride(-2) == 1, f"mat_b must be column-major, strides {mat_b.stride()}"
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


def install(monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Swap the kernels TorchAO's FP8 grouped GEMM calls (the names its module imported, and
    ``torch._scaled_grouped_mm``) for the stand-ins above. Returns, per quantizer name, the
    high-precision tensors it was given (what reached TorchAO's kernel boundary)."""
    import torchao.prototype.moe_training.fp8_grouped_mm as fp8_grouped_mm

    received = {name: [] for name in _QUANTIZERS}
    stand_ins = (
        rowwise_2d_scale_and_cast,
        colwise_3d_scale_and_cast,
        rowwise_3d_transpose_rhs,
        per_group_colwise_scales_dual,
    )
    for name, stand_in in zip(_QUANTIZERS, stand_ins):
        assert hasattr(fp8_grouped_mm, name), f"TorchAO's fp8_grouped_mm no longer calls {name}"

        def recording(hp, *args, stand_in=stand_in, name=name, **kwargs):
            received[name].append(hp)
            return stand_in(hp, *args, **kwargs)

        monkeypatch.setattr(fp8_grouped_mm, name, recording)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    return received
