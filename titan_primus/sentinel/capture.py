"""A breached GEMM call saved to a file (``torch.save`` of plain tensors, strings and numbers,
loadable with ``weights_only=True``), so ``titan-primus parity --replay FILE`` can run the same
inputs through every backend on another machine."""

from __future__ import annotations

import dataclasses
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import device_profile
from ..fsdp_fp8 import Fp8GatheredWeight
from ..recipes import Fp8Recipe, make_recipe
from .check import GemmRecord

__all__ = ["FORMAT", "Capture", "load_capture", "save_capture"]

FORMAT = "titan-primus-sentinel-capture/1"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the capture")
    return dtype


def _recipe_fields(recipe: Fp8Recipe) -> dict:
    return {"name": recipe.name, "definition": recipe.definition, "e4m3": str(recipe.e4m3), "e5m2": str(recipe.e5m2)}


def _rebuild_recipe(fields: dict) -> Fp8Recipe:
    formats = dataclasses.replace(device_profile("cpu"), e4m3=_dtype(fields["e4m3"]), e5m2=_dtype(fields["e5m2"]))
    return make_recipe(fields["name"], fields["definition"], formats)


def _operand(t):
    if isinstance(t, Fp8GatheredWeight):  # a weight FSDP2 gathered in FP8: its payload and scale
        return {
            "fp8": t.fp8_data().cpu(),
            "scale": t.scale().cpu(),
            "dtype": str(t.dtype),
            "source_dtype": str(t._source_dtype),
            "reciprocal": t._reciprocal,
            "block": t._block,
        }
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _restore(entry, device: torch.device):
    if isinstance(entry, dict):
        return Fp8GatheredWeight(
            entry["fp8"].to(device),
            entry["scale"].to(device),
            _dtype(entry["dtype"]),
            entry["reciprocal"],
            _dtype(entry["source_dtype"]),
            entry.get("block"),
        )
    return entry.to(device) if isinstance(entry, torch.Tensor) else entry


def save_capture(folder: str, record: GemmRecord, step: int, rank: int, problems: list[str]) -> Path:
    """Write ``record`` (operands, the gradient the backend was handed, what it returned) and
    the breach it showed; returns the file's path."""
    if _rebuild_recipe(_recipe_fields(record.recipe)) != record.recipe:
        problems = [*problems, "the recipe is not one titan-primus defines by name: replay cannot rebuild it"]
    directory = Path(folder).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    layer = re.sub(r"[^A-Za-z0-9_.-]", "_", record.layer)
    path = directory / f"step{step:07d}-rank{rank}-{layer}-gemm{record.gemm}.pt"
    torch.save(
        {
            "format": FORMAT,
            "layer": record.layer,
            "gemm": record.gemm,
            "op": record.op,
            "step": step,
            "rank": rank,
            "backend": record.backend,
            "bit_exact": record.bit_exact,
            "recipe": _recipe_fields(record.recipe),
            "operands": [_operand(t) for t in record.operands],
            "needs_grad": list(record.needs_grad),
            "tensor_parallel": record.shards is not None,
            "tensors": {name: t.detach().cpu() for name, t in record.tensors.items()},
            "problems": list(problems),
            "torch": str(torch.__version__),
        },
        path,
    )
    return path


@dataclass
class Capture:
    """A saved breach: the record (its tensors on the device asked for) and what was seen."""

    record: GemmRecord
    step: int
    rank: int
    problems: list[str]
    tensor_parallel: bool


def load_capture(path: str, device: torch.device | str = "cpu") -> Capture:
    """Read a file written by :func:`save_capture`; ValueError (naming the file) if it is not one."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not a readable sentinel capture ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a titan-primus sentinel capture (expected format {FORMAT!r})")
    device = torch.device(device)
    record = GemmRecord(
        layer=data["layer"],
        gemm=data["gemm"],
        op=data["op"],
        backend=data["backend"],
        bit_exact=data["bit_exact"],
        recipe=_rebuild_recipe(data["recipe"]),
        operands=tuple(_restore(t, device) for t in data["operands"]),
        needs_grad=tuple(data["needs_grad"]),
        tensors={name: t.to(device) for name, t in data["tensors"].items()},
    )
    return Capture(record, data["step"], data["rank"], data["problems"], data["tensor_parallel"])
