"""Token-group offsets, one convention in, every backend's convention out.

TorchTitan, TorchAO and ``torch._grouped_mm`` describe groups by int32 cumulative END offsets of
length E (``offs[e]`` is one past the last row of group e). Rows of A at or past ``offs[-1]``
belong to no group (TorchTitan's padding dispatcher leaves them); their outputs and gradients
must be exactly zero.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

__all__ = [
    "group_lens",
    "group_ids",
    "group_bounds",
    "mask_trailing_rows_of_grad",
    "padded_groups",
    "rows_known",
    "zero_trailing_rows",
]


def rows_known(t: torch.Tensor) -> bool | None:
    """Whether ``t`` has rows, where that is known on the host without a sync: True or False in
    eager code and for a compiled shape (dynamic shapes specialise 0, so the guard costs no
    recompilation beyond it); None for a data-dependent row count under torch.compile (the
    tokens an EP all-to-all delivers), which may be 0 at run time."""
    rows = t.shape[0]
    if guard_or_false(rows == 0):
        return False
    if guard_or_false(rows > 0):
        return True
    return None


def group_lens(offs: torch.Tensor) -> torch.Tensor:
    """Per-group row counts, int64 on ``offs``' device (Primus-Turbo's ``group_lens``)."""
    return torch.diff(offs, prepend=offs.new_zeros(1)).to(torch.int64)


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) row range of each group, on the host (synchronises; for references and reports)."""
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows; rows past ``offs[-1]`` get ``len(offs)``. No host sync."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def zero_trailing_rows(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``t`` with rows at or past ``offs[-1]`` set to zero, without a host sync.

    ``torch.where`` rather than a multiply: it drops NaN/garbage in the unselected rows, and its
    backward sends exactly zero gradient to them.
    """
    rows = torch.arange(t.shape[0], device=t.device)
    valid = (rows < offs[-1]).unsqueeze(-1)
    return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device))


class _MaskTrailingRowsOfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, offs):
        ctx.save_for_backward(offs)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        (offs,) = ctx.saved_tensors
        return zero_trailing_rows(grad, offs), None


def mask_trailing_rows_of_grad(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``t`` itself (a view, no copy) whose gradient has rows at or past ``offs[-1]`` set to zero:
    for a kernel that leaves those rows of its input gradient undefined but reads nothing of
    them in the input."""
    return _MaskTrailingRowsOfGrad.apply(t, offs)


def padded_groups(offs: torch.Tensor, rows: int, alignment: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``rows`` rows goes when every group is padded with zero rows to a multiple
    of ``alignment`` rows: (the destination row of each row, the padded groups' end offsets, the
    padded row count). Rows past ``offs[-1]`` follow the last padded group. No host sync: the
    padded row count is a bound from shapes, ``rows`` rounded up plus ``alignment`` per group, so
    it is itself a multiple of ``alignment``."""
    lens = group_lens(offs)
    padded_lens = (lens + alignment - 1) // alignment * alignment
    padded_ends = torch.cumsum(padded_lens, 0)
    # Start of each group, and of the trailing rows as group len(offs), before and after padding.
    starts = torch.cat([offs.to(torch.int64) - lens, offs[-1:].to(torch.int64)])
    padded_starts = torch.cat([padded_ends - padded_lens, padded_ends[-1:]])
    ids = group_ids(offs, rows)
    destination = padded_starts[ids] + torch.arange(rows, device=offs.device) - starts[ids]
    padded_rows = -(-rows // alignment) * alignment + alignment * offs.shape[0]
    return destination, padded_ends.to(offs.dtype), padded_rows
