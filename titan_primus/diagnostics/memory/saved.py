"""What a converted layer keeps from forward to backward, by kind of memory.

Everything autograd saves for backward passes ``torch.autograd.graph.saved_tensors_hooks``'
pack hook; once the forward is over, each storage those tensors live in is memory held until
the backward (counted once, however many tensors view it). A storage is:

- ``parameter``: the parameter's own storage, or the FP8 payload and scales FSDP2 all-gathered
  for it. FSDP2 manages it: it frees the unsharded storage after each layer's forward and
  gathers it again for backward, so keeping it costs nothing.
- ``weight_copy``: any other storage holding a tensor of the weight's shape (or its transpose):
  a copy of the weight (an FP8 cast, a column-scaled copy) that outlives the forward. Under
  FSDP2 every layer's copy stays resident at once: one byte per parameter per rank in FP8.
- ``activation_fp8`` / ``activation_hp``: a tensor with the layer's rows (tokens) and its input
  or output width, in an FP8 dtype or not (the input itself, kept by reference, is one).
- ``other``: the rest (scales, group offsets, masks).

Torch-only; :func:`audit_layer` runs one op of one backend, eager or compiled, with the weight
as FSDP2 hands it over (bf16, or all-gathered in FP8).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ...backends.base import Op
from ...fsdp_fp8 import fp8_all_gather_plan, quantize_weight
from ...recipes import Fp8Recipe, with_token_groups_padded_to

__all__ = ["CATEGORIES", "LayerShape", "AUDIT_SHAPES", "audit_layer", "kept_for_backward", "recording_saved_tensors"]

CATEGORIES = ("activation_fp8", "activation_hp", "parameter", "weight_copy", "other")
_FP8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}


@dataclass(frozen=True)
class LayerShape:
    op: Op
    rows: int
    """Tokens of a linear; all rows of a grouped GEMM (trailing rows included)."""
    k: int
    n: int
    groups: tuple[int, ...] = ()
    """Rows per expert of a grouped GEMM (the rest of ``rows`` trails the last group)."""

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.n, self.k) if self.op == "linear" else (len(self.groups), self.n, self.k)

    def describe(self) -> str:
        experts = f" E={len(self.groups)} groups={list(self.groups)}" if self.op == "grouped_mm" else ""
        return f"M={self.rows} K={self.k} N={self.n}{experts}"


# Every dimension distinct (so a tensor's shape tells what it is), multiples of 128 where a
# block-scaled recipe needs them, contraction dims >= 256 and a linear of at least 256 tokens (the least
# Primus-Turbo's Triton kernels contract over without the zero rows it pads to).
AUDIT_SHAPES = {
    "linear": LayerShape("linear", rows=288, k=256, n=384),
    "grouped_mm": LayerShape("grouped_mm", rows=320, k=256, n=384, groups=(96, 0, 128, 64)),
}


def _storages(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s memory (the inner tensors of a wrapper subclass)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
    else:
        try:
            t.untyped_storage().data_ptr()
            return [t]
        except RuntimeError:  # a wrapper subclass with no storage of its own (FP8 all-gather's sharded weight)
            inner = list(vars(t).values())
    return [s for i in inner if isinstance(i, torch.Tensor) for s in _storages(i)]


def _key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of ``t``'s storage; (0, 0) once freed (FSDP2 resizes it to nothing)."""
    storage = t.untyped_storage()
    size = storage.nbytes()
    return (storage.data_ptr(), size) if size else (0, 0)


@contextmanager
def recording_saved_tensors():
    """Collects every tensor autograd saves for backward inside the block, into the list it yields."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def kept_for_backward(
    saved, weight_shapes, parameters=(), rows: int | None = None, widths: tuple[int, ...] = ()
) -> dict[str, int]:
    """Bytes per category (:data:`CATEGORIES`) of the storages the ``saved`` tensors hold now;
    storages freed since (FSDP2 reshards the unsharded parameters after each forward) hold
    nothing. ``weight_shapes``: the shapes of the layers' weights; ``parameters``: tensors whose
    storages are the parameters' (FSDP-managed); ``rows`` and ``widths``: an activation is a
    tensor with ``rows`` and one of ``widths`` among its dims (None: any tensor not otherwise
    classified is an activation)."""
    weight_shapes = {tuple(s) for s in weight_shapes} | {(*s[:-2], s[-1], s[-2]) for s in map(tuple, weight_shapes)}
    parameter_keys = {_key(inner) for p in parameters for inner in _storages(p)}
    kept = dict.fromkeys(CATEGORIES, 0)
    seen = set()
    for tensor in saved:
        for inner in _storages(tensor):
            key = _key(inner)
            if key in seen or key[1] == 0:
                continue
            seen.add(key)
            if key in parameter_keys:
                category = "parameter"
            elif tuple(inner.shape) in weight_shapes:
                category = "weight_copy"
            elif rows is None or (rows in inner.shape and any(w in inner.shape for w in widths)):
                category = "activation_fp8" if inner.dtype in _FP8 else "activation_hp"
            else:
                category = "other"
            kept[category] += key[1]
    return kept


def _layer_inputs(shape: LayerShape, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.rows, shape.k, generator=g).bfloat16()
    weight = (torch.randn(shape.weight_shape, generator=g) * 0.02).bfloat16()
    counts = torch.tensor(shape.groups, dtype=torch.int32)
    offs = counts.cumsum(0, dtype=torch.int32) if shape.groups else None
    return x, weight, offs


def _gathered(backend, recipe: Fp8Recipe, op: Op, weight: torch.Tensor):
    """``weight`` as FSDP2 hands it over when it all-gathers it in FP8 (the payload its
    pre-all-gather hook quantizes, the tensor its post-all-gather hook builds), with the
    tensors that hold its memory; None where it gathers in high precision."""
    plan, _ = fp8_all_gather_plan(backend, recipe, op)
    if plan is None:
        return None
    data, scale = quantize_weight(weight, plan, weight.abs().amax().float())
    return backend.gathered_weight(data, scale, weight.dtype, recipe, weight.dtype), (data, scale)


def audit_layer(
    backend, recipe: Fp8Recipe, shape: LayerShape, compiled: bool = False, fp8_all_gather: bool = False
) -> dict:
    """One forward + backward of ``backend``'s ``shape.op`` with ``recipe``: the bytes kept from
    forward to backward per category, and whether the activation kept is the input itself.
    The weight is a bf16 parameter, or (``fp8_all_gather``) the FP8 weight FSDP2 gathers for it;
    ``compiled``: under ``torch.compile(fullgraph=True)``. Raises ValueError where the weight is
    not gathered in FP8 for this backend and recipe."""
    x, weight, offs = _layer_inputs(shape)
    x.requires_grad_()
    parameters = [weight]
    if fp8_all_gather:
        found = _gathered(backend, recipe, shape.op, weight)
        if found is None:
            raise ValueError(f"{backend.name} {recipe.describe()}: the {shape.op} weight is not all-gathered in FP8")
        weight, parameters = found[0], list(found[1])
    # A parameter, as FSDP2's unsharded one is: torch.compile's partitioner then knows that
    # keeping it for backward is free, as it is under FSDP2.
    weight = torch.nn.Parameter(weight)

    if shape.op == "linear":

        def forward(x, weight):
            return backend.linear(x, weight, None, recipe)
    else:
        # Groups as the converters deliver them (the audit's are aligned): padded by the
        # dispatcher where the backend needs it, so the backend pads nothing again.
        recipe = with_token_groups_padded_to(recipe, backend.group_alignment(recipe))

        def forward(x, weight):
            return backend.grouped_mm(x, weight.transpose(-2, -1), offs, recipe)

    if compiled:
        torch._dynamo.reset()
        forward = torch.compile(forward, fullgraph=True)
        forward(x, weight).float().sum().backward()  # compiles; this step's memory is not the layer's
        x.grad = weight.grad = None
    with recording_saved_tensors() as saved:
        out = forward(x, weight)
    kept = kept_for_backward(saved, [shape.weight_shape], parameters, rows=shape.rows, widths=(shape.k, shape.n))
    input_by_reference = any(_key(inner) == _key(x) for t in saved for inner in _storages(t))
    del saved
    out.backward(torch.randn_like(out))
    return {"kept": kept, "input_by_reference": input_by_reference}
