"""Which backend runs an attention layer, decided once at conversion, through the same registry
as the GEMMs: the backend named, or under ``auto`` the highest-ranked one on the device whose
:meth:`~titan_primus.backends.base.Fp8Backend.attention` provides kernels.

- Primus-Turbo (MI300-class GPUs where it imports): bf16 flash attention (``flash_attn_func``,
  ``flash_attn_varlen_func`` for document masking) with the ``attention`` option; its FP8
  attention (``flash_attn_fp8_func``, blockwise 64) with ``fp8_attention``, where its definition
  holds.
- The emulation (CPUs, or ``backend="emulated"``): FP8 attention only, Primus-Turbo's definition
  in the FP8 format of the device the run names: a CPU's own profile uses OCP e4m3fn (MI355X's,
  gfx950), ``device="gfx942"`` FNUZ e4m3fnuz (MI300X's), about 24 dB apart, so MI300X numerics
  on a laptop need ``device="gfx942"``, as for the GEMMs. bf16 attention stays TorchTitan's own
  there.
- Everywhere else (NVIDIA, other ROCm): TorchTitan's own attention, unchanged; no backend there
  provides attention kernels (TorchAO has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..device import DeviceProfile
from ..registry import backends, get_backend
from .site import AttentionSite, fp8_attention_refusal

if TYPE_CHECKING:  # importing titan_primus.backends imports every built-in backend: only lazily
    from ..backends.base import AttentionKernels, Fp8Backend

__all__ = [
    "AttentionRoute",
    "AttentionSite",
    "attention_backends",
    "attention_refusal",
    "backend_route",
    "fp8_attention_refusal",
    "route_attention",
]


@dataclass(frozen=True)
class AttentionRoute:
    """The decision for one attention layer."""

    fqn: str
    backend: str | None
    """The backend's name ("primus_turbo", "emulated", a plugin's); None: TorchTitan's own attention."""
    fp8: bool
    reason: str
    kernels: AttentionKernels | None = field(default=None, compare=False, repr=False)
    """What a call runs: the backend's attention kernels, built for the device at conversion."""

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The e4m3 format FP8 attention quantizes to (the device's: FNUZ on gfx942)."""
        return self.kernels.fp8_format if self.kernels is not None else None

    def describe(self) -> str:
        if self.backend is None:
            return f"TorchTitan's attention ({self.reason})"
        what = "FP8 attention (blockwise 64)" if self.fp8 else "bf16 flash attention"
        return f"{self.backend} {what} ({self.reason})"


def backend_route(fqn: str, backend: str, *, fp8: bool, device: DeviceProfile, reason: str) -> AttentionRoute:
    """A route on ``backend`` as routing would make it (its kernels built for ``device``), for
    callers that pick the backend themselves (parity, bench) once :func:`attention_refusal` said
    it can run there."""
    return AttentionRoute(fqn, backend, fp8, reason, get_backend(backend).attention()(device, fp8))


def attention_backends() -> tuple[str, ...]:
    """The names of the registered backends that provide attention kernels."""
    return tuple(name for name, backend in backends().items() if backend.attention() is not None)


def attention_refusal(backend: str, device: DeviceProfile, site: AttentionSite, *, fp8: bool) -> str:
    """Why ``backend`` cannot run ``site``'s attention (FP8 or bf16) on ``device``, as
    "unavailable: ..." or "unsupported: ..."; "" where it can."""
    chosen = get_backend(backend)
    kernels = chosen.attention()
    if kernels is None or not (kernels.fp8 if fp8 else kernels.bf16):
        return f"unsupported: the {backend} backend has no {'FP8' if fp8 else 'bf16'} attention"
    if not (available := chosen.availability(device)):
        return f"unavailable: {available.reason}"
    refusal = kernels.unavailable(fp8) or (fp8_attention_refusal(site) if fp8 else kernels.bf16_refusal(site.head_dims))
    return f"unsupported: {refusal}" if refusal else ""


def _attention_backend(device: DeviceProfile, requested: str) -> tuple[Fp8Backend | None, str]:
    """(the backend attention layers can run on here, why), before any layer's own rules: the one
    named, or under ``auto`` the highest-ranked on ``device`` that provides attention kernels."""
    if requested == "auto":
        ranked = sorted(backends().values(), key=lambda b: -b.rank(device))
        candidates = [b for b in ranked if b.rank(device) > 0]
    else:
        candidates = [get_backend(requested)]
    why_not = []
    for backend in candidates:
        if backend.attention() is None:
            why_not.append(f"the {backend.name} backend has no attention kernels")
            continue
        available = backend.availability(device)
        if available:
            return backend, available.reason
        why_not.append(f"the {backend.name} backend is not usable here: {available.reason}")
    return None, "; ".join(why_not) or f"no backend of titan-primus's runs on {device.arch}"


def route_attention(
    fqn: str, site: AttentionSite, *, device: DeviceProfile, backend: str, bf16: bool, fp8: bool
) -> AttentionRoute:
    """The route of the attention layer at ``fqn``: ``bf16`` and ``fp8`` are the converter's
    ``attention`` and ``fp8_attention`` options, ``backend`` its backend option."""
    chosen, available = _attention_backend(device, backend)
    if chosen is None:
        return AttentionRoute(fqn, None, False, available)
    if site.unmappable:
        return AttentionRoute(fqn, None, False, site.unmappable)
    kernels = chosen.attention()
    fp8_refused = None
    if fp8:
        fp8_refused = (
            kernels.unavailable(True) or fp8_attention_refusal(site)
            if kernels.fp8
            else f"the {chosen.name} backend has no FP8 attention"
        )
    if fp8 and fp8_refused is None:
        return AttentionRoute(fqn, chosen.name, True, f"{site.describe()}; {available}", kernels(device, True))
    refused = f"; FP8 attention refused: {fp8_refused}" if fp8_refused else ""
    if not bf16:
        return AttentionRoute(fqn, None, False, f"the attention option is off{refused}")
    if not kernels.bf16:
        return AttentionRoute(
            fqn, None, False, f"bf16 attention stays TorchTitan's own: the {chosen.name} backend has none{refused}"
        )
    if why := kernels.unavailable(False) or kernels.bf16_refusal(site.head_dims):
        return AttentionRoute(fqn, None, False, why)
    return AttentionRoute(fqn, chosen.name, False, f"{site.describe()}; {available}{refused}", kernels(device, False))
