"""A deliberately CORRUPTED test backend, registered through titan-primus's pluggy registry: the
emulation, made wrong on purpose from step ``from_step`` on, the way FP8 kernels have gone wrong
in the field. The numerics sentinel must catch it on its first checked step from then on.

Modes: ``rows`` (the first rows of every output come back reversed: wrong rows of the right
magnitude), ``nan`` (one NaN in every output), ``grad_rows`` (the first rows of every
grad_input come back reversed), ``trailing`` (grouped GEMMs: garbage in the rows past offs[-1]).

In-process: ``titan_primus.registry.register(corrupt_backend)`` (then set ``mode`` and
``from_step`` on ``registry.get_backend("corrupted")``). In a trainer process: an entry point
in the ``titan_primus`` group naming this module (:func:`write_entry_point`), with
``TITAN_PRIMUS_CORRUPT=MODE:FROM_STEP`` in the environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.hookspec import hookimpl

MODES = ("rows", "nan", "grad_rows", "trailing")
ENV = "TITAN_PRIMUS_CORRUPT"


class _ReversedGradRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, rows):
        ctx.rows = rows
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return torch.cat([grad[: ctx.rows].flip(-1), grad[ctx.rows :]]), None


class CorruptedBackend(EmulatedBackend):
    """TEST BACKEND, wrong on purpose: never chosen automatically (rank 0); name it."""

    name = "corrupted"

    def __init__(self, mode: str = "rows", from_step: int = 1):
        assert mode in MODES, mode
        self.mode, self.from_step = mode, from_step
        self.step = 1
        self._ran = False
        # Steps are counted at optimizer steps that follow a forward (TorchTitan's container and
        # its inner optimizers each fire the hook once per step).
        register_optimizer_step_post_hook(self._after_optimizer_step)

    def rank(self, device) -> int:
        return 0

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._ran:
            self.step, self._ran = self.step + 1, False

    def _corrupt(self, out: torch.Tensor, valid_rows: int | None = None) -> torch.Tensor:
        rows = max(1, out.shape[0] // 8)
        if self.mode == "rows":
            return torch.cat([out[:rows].flip(-1), out[rows:]])
        if self.mode == "nan":
            first = torch.zeros_like(out, dtype=torch.bool)
            first.view(-1)[0] = True
            return torch.where(first, torch.full_like(out, float("nan")), out)
        if self.mode == "trailing" and valid_rows is not None and valid_rows < out.shape[0]:
            return torch.cat([out[:valid_rows], torch.ones_like(out[valid_rows:])])
        return out

    def _active(self) -> bool:
        self._ran = True
        return self.step >= self.from_step

    def linear(self, x, weight, bias, recipe, shards=None):
        corrupt = self._active()
        if corrupt and self.mode == "grad_rows":
            x = _ReversedGradRows.apply(x, max(1, x.shape[0] // 8))
        out = super().linear(x, weight, bias, recipe, shards)
        return self._corrupt(out) if corrupt else out

    def grouped_mm(self, A, B_t, offs, recipe):
        corrupt = self._active()
        if corrupt and self.mode == "grad_rows":
            A = _ReversedGradRows.apply(A, max(1, A.shape[0] // 8))
        out = super().grouped_mm(A, B_t, offs, recipe)
        return self._corrupt(out, int(offs[-1]) if offs.numel() else 0) if corrupt else out


@hookimpl
def titan_primus_register_backends():
    mode, _, from_step = os.environ.get(ENV, "rows:1").partition(":")
    return [CorruptedBackend(mode, int(from_step or 1))]


def write_entry_point(directory: Path) -> Path:
    """A distribution's metadata in ``directory`` (put it on PYTHONPATH, with this module's
    folder) declaring this module as a titan-primus plugin, as a pip-installed plugin would."""
    dist_info = directory / "titan_primus_corrupt_backend-0.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: titan-primus-corrupt-backend\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text("[titan_primus]\ncorrupted = corrupt_backend\n")
    return directory
