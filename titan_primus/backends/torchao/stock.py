"""Stock TorchAO, as a user of TorchAO alone runs it: the peer ``titan-primus bench`` times beside
the TorchAO backend, and whose outputs it compares with the backend's.

- Linears: ``convert_to_float8_training`` of a bias-free ``nn.Linear`` with
  ``Float8LinearConfig.from_recipe_name`` (TorchAO's own Float8Linear: its casts, its backward,
  which runs every GEMM and cast whatever gradient is needed).
- Expert GEMMs: ``_quantize_then_scaled_grouped_mm`` with a default ``Float8TrainingOpConfig``,
  what the expert weights that TorchTitan's FP8 MoE converter quantizes (``quantize_`` with that
  config) dispatch ``torch._grouped_mm`` to; groups come aligned to 16 rows (the bench's are), as
  TorchTitan's padding dispatcher delivers them.

Names are looked up in ``STOCK_SYMBOLS`` (checked before a measurement: a TorchAO that moved one
gives a skipped row naming it)."""

from __future__ import annotations

import torch

from ...recipes import Fp8Recipe
from ..base import Op, StockPath, Verdict
from .symbols import absent_symbols, symbol

__all__ = ["STOCK_SYMBOLS", "stock_path"]

STOCK_SYMBOLS = {
    "convert_to_float8_training": "torchao.float8",
    "Float8LinearConfig": "torchao.float8.config",
    "Float8TrainingOpConfig": "torchao.prototype.moe_training.config",
    "_quantize_then_scaled_grouped_mm": "torchao.prototype.moe_training.utils",
}
_LINEAR_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # Float8LinearConfig.from_recipe_name's


def _symbol(name: str):
    return symbol(STOCK_SYMBOLS, name)


def _missing(names: tuple[str, ...]) -> str | None:
    missing = absent_symbols(STOCK_SYMBOLS, names)
    return f"this TorchAO lacks {', '.join(missing)}" if missing else None


def _linear(recipe: Fp8Recipe):
    convert, config = _symbol("convert_to_float8_training"), _symbol("Float8LinearConfig")
    modules: dict[tuple, torch.nn.Module] = {}

    def forward(a, w, offs):
        # One Float8Linear per weight shape, built on the meta device and given the weight at
        # each call (torch.func.functional_call), so the caller's weight gets the gradient.
        key = (tuple(w.shape), w.dtype)
        if key not in modules:
            linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
            modules[key] = convert(torch.nn.Sequential(linear), config=config.from_recipe_name(recipe.name))
        return torch.func.functional_call(modules[key], {"0.weight": w}, (a,))

    return forward


def _grouped():
    grouped, config = _symbol("_quantize_then_scaled_grouped_mm"), _symbol("Float8TrainingOpConfig")()
    return lambda a, w, offs: grouped(a, w.transpose(-2, -1), config, offs=offs)


def stock_path(op: Op, recipe: Fp8Recipe) -> tuple[StockPath | None, Verdict]:
    if op == "linear":
        if recipe.name not in _LINEAR_RECIPES:
            return None, Verdict.no(f"stock TorchAO's Float8Linear has no {recipe.name!r} recipe")
        why = _missing(("convert_to_float8_training", "Float8LinearConfig"))
        if why:
            return None, Verdict.no(why)
        return StockPath("TorchAO convert_to_float8_training", _linear(recipe)), Verdict.yes()
    if recipe.name != "rowwise":
        return None, Verdict.no(f"stock TorchAO's FP8 grouped GEMM is rowwise only, not {recipe.name!r}")
    why = _missing(("Float8TrainingOpConfig", "_quantize_then_scaled_grouped_mm"))
    if why:
        return None, Verdict.no(why)
    return StockPath("TorchAO Float8TrainingOpConfig grouped GEMM", _grouped()), Verdict.yes()
