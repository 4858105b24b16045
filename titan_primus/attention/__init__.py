"""Attention on Primus-Turbo: which backend runs each attention layer, and the call itself.

TorchTitan-independent, like the GEMM routing: each adapter reads a layer's attention off its own
model (:class:`AttentionSite`), asks the converter's router for an :class:`AttentionRoute`, and
its inner-attention module calls :func:`attend` with bshd tensors. Off unless the converter's
``attention`` / ``fp8_attention`` options are on (docs/attention.md).
"""

from .site import AttentionSite, fp8_attention_refusal
from .route import AttentionRoute, attention_backends, attention_refusal, backend_route, route_attention
from .call import attend

__all__ = [
    "AttentionRoute",
    "AttentionSite",
    "attend",
    "attention_backends",
    "attention_refusal",
    "backend_route",
    "fp8_attention_refusal",
    "route_attention",
]
