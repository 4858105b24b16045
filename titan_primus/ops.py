"""The two public FP8 ops, with argument checks that turn bad input into one clear error, and
the dtype contract every backend and both TorchTitan adapters share.

The dtype contract (stated for users in docs/recipes.md, "The dtype contract"):

- A linear computes in, and returns, :func:`linear_compute_dtype` of its input: the autocast
  dtype when autocast is enabled for the input's device type, else the input's dtype, as
  ``nn.Linear`` and TorchAO's ``Float8Linear`` do. :func:`run_linear` is the one place this is
  applied: a backend's ``linear`` receives ``x`` already in that dtype and returns exactly
  ``x.dtype`` (bias added in it); grad_input comes back in x's dtype, grad_weight in the weight's.
- A grouped GEMM always returns bfloat16, whatever its inputs (TorchAO's FP8 grouped GEMM and
  ``torch._grouped_mm`` on TorchTitan's bf16 operands do); its gradients come back in the
  inputs' dtypes.

Routing: eager calls route through :func:`titan_primus.select_backend` (cached). Under
``torch.compile`` the route is looked up outside the traced code (``_route_when_compiling``), so
the public ops compile with ``fullgraph=True`` and leave no routing work in the graph.
"""

from __future__ import annotations

import dataclasses
import os
import types

import torch

from .device import DeviceProfile
from .grouping import rows_known
from .recipes import Fp8Recipe
from .registry import generation
from .routing import BACKEND_ENV, BackendUnavailableError, RoutingDecision, select_backend

__all__ = [
    "Fp8InputError",
    "fp8_linear",
    "fp8_grouped_mm",
    "linear_compute_dtype",
    "resolve_op",
    "run_grouped_mm",
    "run_linear",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Fp8InputError(ValueError):
    """The arguments of an FP8 op are malformed; the message names the problem and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise Fp8InputError(message)


def _check_float(name: str, t: torch.Tensor) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dtype in _FLOATS, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def resolve_op(op, recipe, device, backend, k: int, n: int):
    """(backend, recipe object, decision) for a call; ``recipe`` may be a name or an Fp8Recipe."""
    if isinstance(recipe, Fp8Recipe):
        decision = select_backend(op, recipe.name, device, backend, k=k, n=n)
        accepted = decision.backend.accepts(recipe)
        if not accepted:
            raise BackendUnavailableError(accepted.reason)
        return decision.backend, recipe, decision
    if not isinstance(recipe, str):
        raise Fp8InputError(f"recipe must be a recipe name or an Fp8Recipe, got {type(recipe).__name__}")
    decision: RoutingDecision = select_backend(op, recipe, device, backend, k=k, n=n)
    return decision.backend, decision.recipe, decision


def _resolve(op, recipe, device, backend, k: int, n: int):
    """(backend, recipe object) for a call of an op."""
    if torch.compiler.is_compiling():
        return _route_when_compiling(op, _as_constant(recipe), _as_constant(device), backend, k, n, generation())
    impl, resolved, _ = resolve_op(op, recipe, device, backend, k, n)
    return impl, resolved


# Under torch.compile, routing runs as plain Python while dynamo traces, never inside the traced
# code: dynamo would follow it into pluggy and the registry caches and stop. The arguments
# become constants (dataclass values, a DeviceProfile or Fp8Recipe, are unpacked to tuples),
# ``_route_name`` resolves them once (a function dynamo calls instead of tracing, its result
# stored as a constant), and the traced code reads the resolved (backend, recipe) by attribute,
# which dynamo guards like any global. The registry generation is part of the key, so a
# refreshed registry makes dynamo route (and compile) anew.
_COMPILED_ROUTES = types.SimpleNamespace()
_COMPILED_ROUTE_NAMES: dict[tuple, str] = {}


def _as_constant(value):
    """A dataclass instance as (class, ((field, value), ...)), recursively; anything else as is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), tuple(
            (f.name, _as_constant(getattr(value, f.name))) for f in dataclasses.fields(value) if f.init
        )
    return value


def _from_constant(value):
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], type)
        and dataclasses.is_dataclass(value[0])
    ):
        cls, items = value
        return cls(**{name: _from_constant(v) for name, v in items})
    return value


@torch.compiler.assume_constant_result
def _route_name(key: tuple) -> str:
    key = (*key, os.environ.get(BACKEND_ENV))  # the run-wide override, as set when this graph is traced
    if key not in _COMPILED_ROUTE_NAMES:
        op, recipe, device, backend, k, n, _, _ = key
        impl, resolved, _ = resolve_op(op, _from_constant(recipe), _from_constant(device), backend, k, n)
        name = f"route_{len(_COMPILED_ROUTE_NAMES)}"
        setattr(_COMPILED_ROUTES, name, (impl, resolved))
        _COMPILED_ROUTE_NAMES[key] = name
    return _COMPILED_ROUTE_NAMES[key]


def _route_when_compiling(*key):
    return getattr(_COMPILED_ROUTES, _route_name(key))


def linear_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear on ``x`` computes in and returns: the autocast dtype when autocast is
    enabled for ``x``'s device type (as ``nn.Linear`` and TorchAO's ``Float8Linear``), else
    ``x``'s dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def run_linear(
    backend, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe, shards=None
) -> torch.Tensor:
    """``x [..., K] @ weight.T + bias`` on ``backend`` under the dtype contract: the one function
    the public op and both TorchTitan adapters' linears call. ``x`` is cast to
    :func:`linear_compute_dtype`; the backend runs with autocast off, so it sees exactly the
    dtypes it is given. ``shards`` goes to backends that take tensor-parallel shards."""
    dtype = linear_compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        extra = {} if shards is None else {"shards": shards}
        out = backend.linear(x.reshape(-1, x.shape[-1]).to(dtype), weight, bias, recipe, **extra)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _NoRows(torch.autograd.Function):
    """A grouped GEMM of an A with no rows: an empty bf16 output, zero gradients (B_t's a dense
    zero tensor, so every rank hands FSDP2 and the EP all-to-alls a gradient, as a rank with
    tokens does), and no quantizer or GEMM launched on an empty operand."""

    @staticmethod
    def forward(ctx, A, B_t):
        ctx.a_dtype, ctx.b_meta = A.dtype, (B_t.shape, B_t.dtype, B_t.device)
        return A.new_zeros((0, B_t.shape[2]), dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.b_meta
        grad_A = grad.new_zeros((0, shape[1]), dtype=ctx.a_dtype) if ctx.needs_input_grad[0] else None
        grad_B_t = torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None
        return grad_A, grad_B_t


def run_grouped_mm(backend, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """``backend.grouped_mm`` under the grouped-GEMM contract: the one function the public op and
    both TorchTitan adapters' experts call. An A without rows (an EP rank that received no
    token) launches nothing: the row count is a shape, known on the host without a sync
    (:func:`~titan_primus.grouping.rows_known`). Rows past ``offs[-1]`` (every row, when no
    group has any) are the backends' to zero, on the device."""
    has_rows = rows_known(A)
    if has_rows is False:
        return _NoRows.apply(A, B_t)
    if has_rows:
        return backend.grouped_mm(A, B_t, offs, recipe)
    # A compiled graph's data-dependent row count (EP's received tokens), maybe 0: one zero row
    # past offs[-1] keeps every operand non-empty; it gets zero output and gradient, and adds
    # nothing to any amax. Fused into the backends' zeroing of trailing rows by inductor.
    rows = A.shape[0]
    return backend.grouped_mm(torch.nn.functional.pad(A, (0, 0, 0, 1)), B_t, offs, recipe)[:rows]


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: str | Fp8Recipe = "rowwise",
    backend: str = "auto",
    device: DeviceProfile | str | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with FP8 GEMMs in forward and backward, like ``F.linear``.

    x: [..., K]; weight: [N, K]; bias: [N] or None. ``recipe`` is "tensorwise", "rowwise" or
    "rowwise_with_gw_hp" (or an :class:`Fp8Recipe`); ``backend`` is "auto" or a backend name;
    ``device`` is a :class:`DeviceProfile` or profile name (default: the detected device).
    Returns the autocast dtype under autocast, else x's dtype (:func:`linear_compute_dtype`).
    """
    _check_float("x", x)
    _check_float("weight", weight)
    _require(x.dim() >= 1, "x must have at least one dimension (its last is in_features)")
    _require(weight.dim() == 2, f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _require(
        x.shape[-1] == k,
        f"x's last dim ({x.shape[-1]}) must equal weight's in_features ({k}); weight is [out, in] like nn.Linear",
    )
    if bias is not None:
        _check_float("bias", bias)
        _require(bias.shape == (n,), f"bias must have shape ({n},), got {tuple(bias.shape)}")
    impl, resolved = _resolve("linear", recipe, device, backend, k, n)
    return run_linear(impl, x, weight, bias, resolved)


def _check_offsets(offs: torch.Tensor, rows: int) -> None:
    """The checks on ``offs``: on the host, naming the values, only where ``offs`` already is
    there; elsewhere on its device (``torch._assert_async``), since reading a GPU tensor on the
    host is a device-to-host sync. A failed device assert fails the next kernel launch; on CUDA
    that ends the process's CUDA context, as torch's own device-side index checks do."""
    if offs.numel() == 0 or torch.compiler.is_compiling():
        return
    ends = offs.detach()
    conditions = (
        ((ends >= 0).all(), "offs must be non-negative"),
        (
            (ends[1:] >= ends[:-1]).all(),
            "offs must be non-decreasing cumulative end offsets (cumsum of tokens per expert)",
        ),
        (ends[-1] <= rows, f"offs[-1] exceeds the number of rows of A ({rows}); offsets must end within A"),
    )
    for holds, message in conditions:
        if ends.device.type != "cpu":
            torch._assert_async(holds, f"fp8_grouped_mm: {message}")
        elif not holds:
            raise Fp8InputError(f"{message}, got {ends.tolist()}")


def fp8_grouped_mm(
    A: torch.Tensor,
    B_t: torch.Tensor,
    offs: torch.Tensor,
    *,
    recipe: str | Fp8Recipe = "rowwise",
    backend: str = "auto",
    device: DeviceProfile | str | None = None,
) -> torch.Tensor:
    """FP8 grouped GEMM with the contract of TorchTitan 0.3's ``GroupedExperts._grouped_mm``.

    A: [R, K]; B_t: [E, K, N] (usually a transposed view of [E, N, K] expert weights);
    offs: int32 [E], cumulative end offsets of each expert's rows in A. Groups may be empty or
    unaligned; rows of A at or past ``offs[-1]`` get exactly zero output and zero gradient.
    Returns [R, N] in bfloat16 whatever the inputs' dtypes (as TorchAO's FP8 grouped GEMM does);
    the gradients come back in A's and B_t's dtypes.
    """
    _check_float("A", A)
    _check_float("B_t", B_t)
    _require(A.dim() == 2, f"A must be 2-D [rows, K], got shape {tuple(A.shape)}")
    _require(B_t.dim() == 3, f"B_t must be 3-D [experts, K, N], got shape {tuple(B_t.shape)}")
    _require(isinstance(offs, torch.Tensor), f"offs must be a torch.Tensor, got {type(offs).__name__}")
    _require(
        offs.dtype == torch.int32,
        f"offs must be int32 (e.g. torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)), got {offs.dtype}",
    )
    experts, k, n = B_t.shape
    _require(
        offs.shape == (experts,),
        f"offs must have one entry per expert: shape ({experts},), got {tuple(offs.shape)}",
    )
    _require(A.shape[1] == k, f"A's K ({A.shape[1]}) must equal B_t's K ({k}); B_t is [experts, K, N]")
    _check_offsets(offs, A.shape[0])
    impl, resolved = _resolve("grouped_mm", recipe, device, backend, k, n)
    return run_grouped_mm(impl, A, B_t, offs, resolved)
