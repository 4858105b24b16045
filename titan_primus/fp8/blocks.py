"""Block-scaled FP8 casts: 1x128 tiles, 128x128 blocks (float32 scales) and MX 1x32 / 32x32
blocks (E8M0 power-of-two scales), as the recipe table's :class:`BlockScaleRule` defines them.

An operand is laid out [non-contracted, contracted]. Every element belongs to one scaling cell,
named by a row key (its block along dim 0) and a column key (its block along dim 1); one amax
and one scale per cell. Regular blocks start at index 0 of a dimension and a last partial
block is padded with zeros, as Primus-Turbo's masked Triton loads do (zeros change no amax).
Along a grouped GEMM's token dimension the blocks start again at each group's first row
(:func:`segment_keys`): Primus-Turbo pads each group to the block size before its
column-wise casts, and TorchAO's grouped kernels require groups padded to it.

Regular blocks are reshapes of the zero-padded tensor; token blocks along a grouped dimension
are reduced by key. Nothing here synchronises with the host, so it traces under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math

import torch

from ..recipes import BlockScaleRule

__all__ = [
    "BlockCells",
    "segment_keys",
    "cells_of",
    "block_amax",
    "quantize_blocks",
    "dequantize",
    "quantize_matrices",
    "dequantize_matrices",
]

# (mantissa bits, exponent of the largest power of two <= fp8 max) of each OCP FP8 format: the
# constants of the "even" E8M0 rule (Primus-Turbo FP8E4M3_TARGET_MAX_POW2 = 8, ..._E5M2 = 15).
_E8M0_CONSTANTS = {torch.float8_e4m3fn: (3, 8), torch.float8_e5m2: (2, 15)}
_E8M0_MIN, _E8M0_MAX = -127, 127
"""Exponent range of an E8M0 scale (byte 0..254; 255 is NaN). The "even" rule clamps to 128
(Primus-Turbo keeps 255 reachable to mark NaN), reached only by an amax >= 2**136."""


class BlockCells:
    """The scaling cells of an [R, C] operand: regular ``block`` = (rows, cols) blocks, or, when
    ``col_keys`` is given, one block row per ``block[0]`` rows and the cells along C named by
    ``col_keys`` [C] (``n_cols`` distinct values, a static upper bound)."""

    __slots__ = ("shape", "block", "col_keys", "n_rows", "n_cols")

    def __init__(
        self, shape: tuple[int, int], block: tuple[int, int], col_keys: torch.Tensor | None = None, n_cols: int = 0
    ):
        self.shape, self.block, self.col_keys = shape, block, col_keys
        self.n_rows = -(-shape[0] // block[0])
        self.n_cols = n_cols if col_keys is not None else -(-shape[1] // block[1])

    def _blocked(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [R, C] zero-padded to whole blocks, as [n_rows, block rows, columns] or, for
        regular blocks, [n_rows, block rows, n_cols, block cols]."""
        rows = self.n_rows * self.block[0]
        cols = x.shape[1] if self.col_keys is not None else self.n_cols * self.block[1]
        x = torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))
        if self.col_keys is not None:
            return x.reshape(self.n_rows, self.block[0], cols)
        return x.reshape(self.n_rows, self.block[0], self.n_cols, self.block[1])

    def amax(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Per-cell maximum of a non-negative [R, C] tensor, [n_rows, n_cols]."""
        blocked = self._blocked(magnitude)
        if self.col_keys is None:
            return blocked.amax(dim=(1, 3))
        per_row_block = blocked.amax(dim=1)  # [n_rows, C]
        index = self.col_keys.unsqueeze(0).expand_as(per_row_block)
        return per_row_block.new_zeros(self.n_rows, self.n_cols).scatter_reduce(1, index, per_row_block, "amax")

    def times(self, x: torch.Tensor, per_cell: torch.Tensor) -> torch.Tensor:
        """``x`` [R, C] (float32) times its cell's entry of ``per_cell`` [n_rows, n_cols]."""
        rows, cols = self.shape
        blocked = self._blocked(x)
        if self.col_keys is None:
            product = blocked * per_cell[:, None, :, None]
        else:
            product = blocked * per_cell[:, self.col_keys].unsqueeze(1)
        padded_cols = blocked.shape[2] if self.col_keys is not None else blocked.shape[2] * blocked.shape[3]
        return product.reshape(blocked.shape[0] * blocked.shape[1], padded_cols)[:rows, :cols]


def segment_keys(offs: torch.Tensor, length: int, block: int) -> tuple[torch.Tensor, int]:
    """Blocks of ``block`` rows that start again at each group's first row, for ``length`` rows
    grouped by int32 cumulative end offsets ``offs`` [E]; rows past ``offs[-1]`` form their own
    blocks. No host sync: the key count is a static upper bound."""
    ends = offs.to(torch.int64)
    lens = torch.diff(ends, prepend=ends.new_zeros(1))
    blocks = (lens + block - 1) // block
    first_block = torch.cumsum(blocks, 0) - blocks
    # one more "group" for trailing rows: it starts at offs[-1], after every group's blocks
    starts = torch.cat([ends - lens, ends[-1:]])
    first_block = torch.cat([first_block, blocks.sum().reshape(1)])
    rows = torch.arange(length, device=offs.device)
    group = torch.searchsorted(ends, rows, right=True)
    keys = first_block[group] + (rows - starts[group]) // block
    return keys, -(-length // block) + len(offs) + 1


def cells_of(
    shape: tuple[int, int], block: tuple[int, int], device, col_segments: torch.Tensor | None = None
) -> BlockCells:
    """The cells of an [R, C] operand in ``block`` = (rows, cols) blocks; ``col_segments``: the
    int32 group end offsets along C when C is a grouped GEMM's token dimension."""
    if col_segments is None:
        return BlockCells(tuple(shape), block)
    return BlockCells(tuple(shape), block, *segment_keys(col_segments, shape[1], block[1]))


def block_amax(x: torch.Tensor, cells: BlockCells) -> torch.Tensor:
    """float32 amax of each cell, [n_rows, n_cols] (0 for cells without elements)."""
    return cells.amax(x.detach().abs().to(torch.float32))


def _fp32_scales(amax: torch.Tensor, fp8_dtype: torch.dtype, rule: BlockScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_max = torch.finfo(fp8_dtype).max
    if rule.float64:  # TorchAO: fp8_max / clamp(amax, EPS) in float64, stored as float32
        scale = (fp8_max / amax.to(torch.float64).clamp(min=rule.amax_eps)).to(torch.float32)
    else:  # Primus-Turbo: FP8_MAX / tl.maximum(amax, 1e-4) in float32
        scale = torch.tensor(fp8_max, dtype=torch.float32, device=amax.device) / amax.clamp(min=rule.amax_eps)
    return scale, 1.0 / scale


def _e8m0_exponent(amax: torch.Tensor, fp8_dtype: torch.dtype, rule: BlockScaleRule) -> torch.Tensor:
    """The unbiased power-of-two exponent e of each cell's scale 2**e, int32."""
    if fp8_dtype not in _E8M0_CONSTANTS:
        raise ValueError(f"MX (E8M0) scaling is defined on OCP FP8 formats, not {fp8_dtype}")
    mbits, max_pow2 = _E8M0_CONSTANTS[fp8_dtype]
    if rule.rounding == "even":
        # Round amax to fp8's mantissa width, take its exponent, subtract fp8_max's exponent.
        bits = amax.to(torch.float32).view(torch.int32) + (1 << (23 - mbits - 1))
        exponent = (torch.bitwise_right_shift(bits, 23) & 0x1FF) - 127 - max_pow2
        return exponent.clamp(_E8M0_MIN, _E8M0_MAX + 1).to(torch.int32)
    # "rceil": ceil(log2(amax / fp8_max)), exactly (as cvt.rp.satfinite.ue8m0 does): with
    # descale = m * 2**x, m in [0.5, 1), the ceiling is x, or x - 1 when descale is a power of two.
    descale = amax.to(torch.float32) / torch.finfo(fp8_dtype).max
    mantissa, exponent = torch.frexp(descale)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    exponent = torch.where(descale == 0, torch.full_like(exponent, _E8M0_MIN), exponent)
    return exponent.clamp(_E8M0_MIN, _E8M0_MAX).to(torch.int32)


def quantize_blocks(
    x: torch.Tensor, fp8_dtype: torch.dtype, rule: BlockScaleRule, cells: BlockCells
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` [R, C] to ``fp8_dtype`` with one scale per cell. Returns (fp8 payload [R, C],
    float32 scale_inv [n_rows, n_cols]: what the GEMM multiplies the payload by; for E8M0 the
    power of two 2**e itself)."""
    amax = block_amax(x, cells)
    fp8_max = torch.finfo(fp8_dtype).max
    if rule.kind == "fp32":
        scale, scale_inv = _fp32_scales(amax, fp8_dtype, rule)
        multiplier = scale
    else:
        exponent = _e8m0_exponent(amax, fp8_dtype, rule)
        scale_inv = torch.ldexp(torch.ones_like(amax), exponent)
        multiplier = torch.ldexp(torch.ones_like(amax), -exponent)
        if rule.rounding == "rceil":
            # TorchAO's _to_mx_rceil multiplies by 1.0, not 2**127, where the byte is 0.
            multiplier = torch.where(exponent == _E8M0_MIN, torch.ones_like(multiplier), multiplier)
    data = cells.times(x.to(torch.float32), multiplier).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return data, scale_inv


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, cells: BlockCells) -> torch.Tensor:
    """The float32 values a block-scaled GEMM multiplies: payload x its cell's scale_inv."""
    return cells.times(data.to(torch.float32), scale_inv)


def _stacked(t: torch.Tensor, block_rows: int) -> torch.Tensor:
    """``t`` [..., R, C] as [matrices, R padded to whole blocks, C]: no block spans two matrices."""
    rows, cols = t.shape[-2:]
    padding = -(-rows // block_rows) * block_rows - rows
    return torch.nn.functional.pad(t.reshape(math.prod(t.shape[:-2]), rows, cols), (0, 0, 0, padding))


def quantize_matrices(
    t: torch.Tensor, fp8_dtype: torch.dtype, rule: BlockScaleRule, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``t`` [..., R, C] (leading dims: independent matrices, such as experts) in regular
    ``block`` cells. Returns (fp8 payload shaped as ``t``, float32 scale_inv
    [..., ceil(R / block rows), ceil(C / block cols)])."""
    rows, cols = t.shape[-2:]
    stacked = _stacked(t, block[0])
    flat = stacked.reshape(-1, cols)
    cells = cells_of(tuple(flat.shape), block, t.device)
    data, scale_inv = quantize_blocks(flat, fp8_dtype, rule, cells)
    data = data.reshape(stacked.shape)[:, :rows].reshape(t.shape)
    return data, scale_inv.reshape(*t.shape[:-2], stacked.shape[1] // block[0], cells.n_cols)


def dequantize_matrices(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 values a block-scaled GEMM multiplies from :func:`quantize_matrices`'s
    payload [..., R, C] and scale_inv (each element times its block's scale_inv)."""
    rows, cols = data.shape[-2:]
    stacked = _stacked(data.to(torch.float32), block[0])
    flat = stacked.reshape(-1, cols)
    values = dequantize(
        flat, scale_inv.reshape(-1, scale_inv.shape[-1]), cells_of(tuple(flat.shape), block, data.device)
    )
    return values.reshape(stacked.shape)[:, :rows].reshape(data.shape)
