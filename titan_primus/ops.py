"""The two public FP8 ops, with argument checks that turn bad input into one clear error."""

from __future__ import annotations

import torch

from .device import DeviceProfile
from .recipes import Fp8Recipe
from .routing import BackendUnavailableError, RoutingDecision, select_backend

__all__ = ["Fp8InputError", "fp8_linear", "fp8_grouped_mm", "resolve_op"]

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
    impl, resolved, _ = resolve_op("linear", recipe, device, backend, k, n)
    out = impl.linear(x.reshape(-1, k), weight, bias, resolved)
    return out.reshape(*x.shape[:-1], n)


def _check_offsets(offs: torch.Tensor, rows: int) -> None:
    if offs.numel() == 0 or torch.compiler.is_compiling():
        return
    ends = offs.detach().to("cpu", torch.int64)
    _require(bool((ends >= 0).all()), f"offs must be non-negative, got {ends.tolist()}")
    _require(
        bool((ends[1:] >= ends[:-1]).all()),
        f"offs must be non-decreasing cumulative end offsets (cumsum of tokens per expert), got {ends.tolist()}",
    )
    _require(
        int(ends[-1]) <= rows,
        f"offs[-1] ({int(ends[-1])}) exceeds the number of rows of A ({rows}); offsets must end within A",
    )


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
    Returns [R, N] in bfloat16, like ``torch._grouped_mm`` on bfloat16 inputs.
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
    impl, resolved, _ = resolve_op("grouped_mm", recipe, device, backend, k, n)
    return impl.grouped_mm(A, B_t, offs, resolved)
