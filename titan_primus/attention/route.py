"""Which backend runs an attention layer, decided once at conversion.

- Primus-Turbo (MI300-class GPUs where it imports): bf16 flash attention (``flash_attn_func``,
  ``flash_attn_varlen_func`` for document masking) with the ``attention`` option; its FP8
  attention (``flash_attn_fp8_func``, blockwise 64) with ``fp8_attention``, where its definition
  holds.
- The emulation (CPUs, or ``backend="emulated"``): FP8 attention only, the exact definition of
  Primus-Turbo's in the FP8 format of the device the run names: a CPU's own profile uses OCP
  e4m3fn (MI355X's, gfx950), ``device="gfx942"`` FNUZ e4m3fnuz (MI300X's), about 24 dB apart, so
  MI300X numerics on a laptop need ``device="gfx942"``, as for the GEMMs. bf16 attention stays
  TorchTitan's own there.
- Everywhere else (NVIDIA, other ROCm): TorchTitan's own attention, unchanged; there is no FP8
  attention kernel to route to (TorchAO has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import DeviceProfile
from ..registry import get_backend

__all__ = ["AttentionRoute", "AttentionSite", "backend_route", "fp8_attention_refusal", "route_attention"]


@dataclass(frozen=True)
class AttentionSite:
    """What one layer's attention computes, as an adapter reads it off TorchTitan's model."""

    causal: bool | None = True
    """None: each call says (SDPA's ``is_causal``; Flux passes False)."""
    documents: bool = False
    """Document masking: packed documents attend only within themselves (cu_seqlens)."""
    window: tuple[int, int] = (-1, -1)
    """Sliding window (left, right) in flash-attention's convention; (-1, -1): none."""
    head_dims: tuple[int, int] | None = None
    """(query/key, value) head dimensions, where the adapter knows them."""
    grouped: bool = False
    """Grouped-query attention: fewer key/value heads than query heads."""
    dropout: float = 0.0
    unmappable: str | None = None
    """The adapter's reason Primus-Turbo cannot compute this layer's attention as TorchTitan does
    (a BlockMask with a score_mod, an LSE epilogue, context parallelism, ...), if any."""

    def describe(self) -> str:
        if self.causal is None:
            mask = "causal or full, as each call's is_causal says"
        elif self.documents:
            mask = "document-causal" if self.causal else "document"
        else:
            mask = "causal" if self.causal else "full"
        if self.window != (-1, -1):
            mask += f", window {self.window}"
        return mask


@dataclass(frozen=True)
class AttentionRoute:
    """The decision for one attention layer."""

    fqn: str
    backend: str | None
    """"primus_turbo" or "emulated"; None: TorchTitan's own attention."""
    fp8: bool
    reason: str
    fp8_dtype: torch.dtype | None = None
    """The e4m3 format FP8 attention quantizes to (the device's: FNUZ on gfx942)."""
    kernel_settings: tuple[bool, int] | None = None
    """Primus-Turbo's bf16 kernels' settings, read once here (attention_bf16.kernel_settings)."""

    def describe(self) -> str:
        if self.backend is None:
            return f"TorchTitan's attention ({self.reason})"
        what = "FP8 attention (blockwise 64)" if self.fp8 else "bf16 flash attention"
        return f"{self.backend} {what} ({self.reason})"


def backend_route(fqn: str, backend: str, *, fp8: bool, device: DeviceProfile, reason: str) -> AttentionRoute:
    """A route on ``backend`` as routing would make it (the FP8 format, the bf16 kernels' settings),
    for callers that pick the backend themselves (parity, bench) once its availability is checked."""
    if fp8:
        return AttentionRoute(fqn, backend, True, reason, device.e4m3)
    from ..backends.primus_turbo.attention_bf16 import kernel_settings

    return AttentionRoute(fqn, backend, False, reason, kernel_settings=kernel_settings())


def fp8_attention_refusal(site: AttentionSite) -> str | None:
    """Why Primus-Turbo's FP8 attention cannot compute ``site`` as defined, or None where it can.
    Each rule is read in Primus-Turbo's sources (``ops/attention/flash_attn_interface.py``,
    ``kernels/attention/attention_triton_impl.py``); the sequence length, unknown at conversion,
    is checked on each call (a multiple of 64: ``check_fp8_attention_inputs``)."""
    if site.unmappable:
        return site.unmappable
    if site.documents:
        return (
            "document masking needs varlen attention, and Primus-Turbo's FP8 attention has none "
            "(flash_attn_fp8_func takes no cu_seqlens)"
        )
    if site.window != (-1, -1):
        return f"sliding window {site.window}: Primus-Turbo's FP8 attention asserts window_size == (-1, -1)"
    if site.dropout:
        return f"dropout {site.dropout}: Primus-Turbo's FP8 backward ignores the forward's dropout"
    if site.head_dims and any(d < 32 or d % 2 for d in site.head_dims):
        return f"head dims {site.head_dims}: Primus-Turbo's FP8 backward needs even head dims of at least 32"
    if site.grouped and site.head_dims and site.head_dims[0] != site.head_dims[1]:
        return (
            f"grouped-query attention with head dims {site.head_dims}: Primus-Turbo's FP8 backward computes dK and dV "
            f"wrong there (found under the Triton interpreter at every build from v0.3.1 to v0.4.1.dev26: "
            f"tests/real_turbo/test_attention_cli.py)"
        )
    return None


def _attention_backend(device: DeviceProfile, backend: str) -> tuple[str | None, str]:
    """(the backend attention layers can run on here, why), before any layer's own rules."""
    if backend in ("auto", "primus_turbo"):
        turbo = get_backend("primus_turbo").availability(device)
        if turbo:
            return "primus_turbo", turbo.reason
        if backend == "primus_turbo" or device.mi300_class:
            return None, f"Primus-Turbo is not usable here: {turbo.reason}"
    if backend == "emulated" or (backend == "auto" and device.kind == "cpu"):
        return "emulated", "the emulation of Primus-Turbo's FP8 attention"
    return None, f"no attention backend of titan-primus's on {device.arch} (TorchAO has no FP8 attention)"


def route_attention(
    fqn: str, site: AttentionSite, *, device: DeviceProfile, backend: str, bf16: bool, fp8: bool
) -> AttentionRoute:
    """The route of the attention layer at ``fqn``: ``bf16`` and ``fp8`` are the converter's
    ``attention`` and ``fp8_attention`` options, ``backend`` its backend option."""
    name, available = _attention_backend(device, backend)
    fp8_refused = fp8_attention_refusal(site) if fp8 else None
    if name is None:
        return AttentionRoute(fqn, None, False, available)
    if site.unmappable:
        return AttentionRoute(fqn, None, False, site.unmappable)
    if fp8 and fp8_refused is None:
        return backend_route(fqn, name, fp8=True, device=device, reason=f"{site.describe()}; {available}")
    refused = f"; FP8 attention refused: {fp8_refused}" if fp8_refused else ""
    if name == "primus_turbo" and bf16:
        if site.head_dims and any(d % 8 for d in site.head_dims):
            return AttentionRoute(fqn, None, False, f"head dims {site.head_dims}: AITER's kernels take multiples of 8")
        return backend_route(fqn, name, fp8=False, device=device, reason=f"{site.describe()}; {available}{refused}")
    if name == "emulated":
        return AttentionRoute(fqn, None, False, f"bf16 attention stays TorchTitan's own off MI300-class GPUs{refused}")
    return AttentionRoute(fqn, None, False, f"the attention option is off{refused}")
