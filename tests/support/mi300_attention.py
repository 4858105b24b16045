"""The attention route on the REAL kernels and GPU: runs only on an MI300-class GPU with Primus-Turbo
installed (``mi300`` marker; ci/mi300x.sh). The bodies run in the real-code tier too, on every
build and architecture (tests/real_turbo/test_attention_bodies.py: Primus-Turbo's own Python and
Triton code, AITER's kernels stood in), so a crash in one shows on every CI run; on the hardware
the routing each one relies on is asserted, never skipped.

What each asserts: bf16 Primus-Turbo attention (AITER's kernels) equals fp32 attention on the same
masks (document masking through cu_seqlens, causal, a sliding window) to bf16's accuracy; FP8
attention (Primus-Turbo's Triton kernel) equals the exact emulation titan-primus runs on CPUs;
both compile fullgraph, equal to eager.

The tests live here so that two modules collect them, each with its own ``hardware`` fixture:
tests/unit/test_mi300_attention.py on the GPU (marked ``mi300``) and the real-code tier on a CPU.
"""

import pytest
import torch
import torch.nn.functional as F
from support.closeness import assert_sqnr_at_least
from support.helpers import Hardware

from titan_primus.attention import AttentionSite, attend, route_attention
from titan_primus.attention.call import Documents

# Primus-Turbo's own gate for bf16 attention against a reference (tests/pytorch/ops/test_attention.py).
BF16_SQNR_DB = 40
# FP8 attention against fp32 attention is about 23-27 dB (tests/unit/test_attention_fp8_emulated.py);
# the kernel against the emulation of its definition must be far closer than that.
FP8_AGAINST_EMULATION_DB = 40


def _route(hardware: Hardware, site: AttentionSite, *, fp8: bool):
    route = route_attention("layer", site, device=hardware.profile, backend="auto", bf16=True, fp8=fp8)
    assert route.backend == "primus_turbo" and route.fp8 == fp8, route
    return route


def _qkv(hardware: Hardware, B=2, L=128, H=4, Hkv=2, D=64, Dv=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, L, H, D), (B, L, Hkv, D), (B, L, Hkv, Dv))
    return [torch.randn(s, generator=g).bfloat16().to(hardware.device).requires_grad_() for s in shapes]


def _allowed(L: int, cu_seqlens: list[int], causal: bool, left: int) -> torch.Tensor:
    """Which of B·L packed tokens attend which: the same document, causal, within ``left``."""
    T = cu_seqlens[-1]
    doc = torch.zeros(T, dtype=torch.long)
    for start in cu_seqlens[1:-1]:
        doc[start:] += 1
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    return allowed


def _reference(q, k, v, allowed, scale):
    """fp32 attention over the B·L packed tokens with ``allowed`` (T, T)."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.float().flatten(0, 1).transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt, kt.repeat_interleave(group, 0), vt.repeat_interleave(group, 0), attn_mask=allowed.to(q.device), scale=scale
    )
    return out.transpose(0, 1).unflatten(0, q.shape[:2])


def _step(fn, q, k, v):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.float().square().sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in (q, k, v)]


@pytest.mark.parametrize(
    "documents, causal, left",
    [
        ((0, 40, 128, 200, 256), True, -1),
        ((0, 128, 256), True, -1),
        ((0, 128, 256), True, 31),
        ((0, 128, 256), False, -1),
    ],
    ids=["documents", "causal", "sliding-window", "full"],
)
def test_bf16_route_equals_fp32_attention_on_the_same_masks(hardware, documents, causal, left):
    q, k, v = _qkv(hardware)
    window = (left, 0) if left >= 0 else (-1, -1)
    packed = documents != (0, 128, 256)
    route = _route(hardware, AttentionSite(causal=causal, documents=packed, window=window), fp8=False)
    cu = torch.tensor(documents, dtype=torch.int32, device=hardware.device)
    longest = max(b - a for a, b in zip(documents, documents[1:]))
    given = Documents(cu, longest) if packed else None
    scale = 0.11  # not 1/sqrt(D): the model's scale reaches the kernel
    routed = _step(lambda *t: attend(route, *t, scale=scale, causal=causal, window=window, documents=given), q, k, v)
    allowed = _allowed(q.shape[1], list(documents), causal, left)
    reference = _step(lambda *t: _reference(*t, allowed, scale), q, k, v)
    for name, got, want in zip(("out", "dq", "dk", "dv"), routed, reference):
        assert_sqnr_at_least(want, got, BF16_SQNR_DB, what=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp8_route_equals_the_emulation(hardware, causal):
    q, k, v = _qkv(hardware)
    turbo = _route(hardware, AttentionSite(causal=causal, head_dims=(64, 64)), fp8=True)
    emulated = route_attention(
        "layer", AttentionSite(causal=causal), device=hardware.profile, backend="emulated", bf16=False, fp8=True
    )
    assert emulated.backend == "emulated" and emulated.fp8_dtype == turbo.fp8_dtype
    got = _step(lambda *t: attend(turbo, *t, scale=None, causal=causal), q, k, v)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    want = _step(lambda *t: attend(emulated, *t, scale=None, causal=causal), *cpu)
    for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
        assert_sqnr_at_least(a, b.cpu(), FP8_AGAINST_EMULATION_DB, what=name)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_routes_compile_fullgraph_equal_to_eager(hardware, fp8):
    q, k, v = _qkv(hardware)
    route = _route(hardware, AttentionSite(causal=True, head_dims=(64, 64)), fp8=fp8)

    def fn(q, k, v):
        return attend(route, q, k, v, scale=0.125, causal=True)

    eager = _step(fn, q, k, v)
    compiled = _step(torch.compile(fn, fullgraph=True, backend=hardware.compile_backend), q, k, v)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
