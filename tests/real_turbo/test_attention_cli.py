"""The CLI's attention rows on Primus-Turbo's own code: ``parity``'s FP8 attention cases on its
Triton kernel (against fp32 SDPA and the emulation of the same definition), and ``bench --memory``'s
model of what each Primus-Turbo attention path keeps for backward against what it saves (the bf16
path with AITER's kernels stood in: aiter_stand_in.py, whose ``rng_state`` is the model's 2 int64)."""

import pytest
import torch

from real_turbo.conftest import ARCH, TURBO
from titan_primus.attention import AttentionRoute, attend, backend_route
from titan_primus.diagnostics.memory.audit import ATTENTION_AUDIT_HEADS, ATTENTION_AUDIT_SEQ
from titan_primus.diagnostics.memory.model import ATTENTION_PATHS, attention_saved
from titan_primus.diagnostics import parity
from titan_primus.device import device_profile
from titan_primus.diagnostics.memory.saved import recording_saved_tensors


def test_parity_runs_fp8_attention_on_primus_turbo_against_fp32_and_the_emulation():
    rows = parity.run_matrix(device_profile(ARCH), (), attention_cases=parity.QUICK_ATTENTION_CASES)
    turbo = [r for r in rows if r.backend == "primus_turbo"]
    assert len(turbo) == len(parity.QUICK_ATTENTION_CASES)
    assert all(r.status == "pass" for r in turbo), [(r.case, r.reason) for r in turbo]
    for row in turbo:
        assert {c.against for c in row.checks} == {"fp32", "emulated"}
        assert all(c.sqnr_db >= c.threshold_db for c in row.checks)


def test_primus_turbos_fp8_backward_is_wrong_for_gqa_with_unequal_head_dims_and_routing_refuses_it():
    """Measured at every build and both archs (2026-12-02, Triton interpreter): Primus-Turbo's FP8
    kernel, called directly, gets the forward and dq of the emulation, but dk and dv wrong
    (non-finite at parity's gqa_dv_differs shape, S 192, Hq 4, Hkv 2, D 64 / Dv 32; -1.8 and 0.0 dB
    against fp32 at S 128; -2.9 and 0.1 dB at D 32 / Dv 64). GQA alone, or the head dims differing
    alone, are right. So the route refuses the combination (parity shows the refusal), and both
    FP8 attention wrappers refuse it on every call (test_attention_fp8_emulated.py); this test
    fails once a Primus-Turbo build computes it right, and the rule can then name the builds."""
    from titan_primus import sqnr

    from titan_primus.attention import fp8_attention_refusal
    from titan_primus.backends.emulated import attention as emulated_attention
    from titan_primus.backends.primus_turbo import attention_fp8
    from titan_primus.numerics import run_attention

    (case,) = [c for c in parity.DEFAULT_ATTENTION_CASES if c.name == "gqa_dv_differs"]
    assert "grouped-query attention" in fp8_attention_refusal(case.site())
    (row,) = [
        r for r in parity.run_matrix(device_profile(ARCH), (), attention_cases=(case,)) if r.backend == "primus_turbo"
    ]
    assert row.status == "skipped" and "grouped-query attention" in row.reason, (row.status, row.reason)
    inputs = case.inputs(torch.device("cpu"))
    reference = case.run(inputs, None, device_profile(ARCH))
    # Both ops called below their wrappers, which refuse the combination on every call.
    scale, fp8_dtype = inputs[0].shape[-1] ** -0.5, device_profile(ARCH).e4m3
    emulated = run_attention(
        lambda q, k, v: emulated_attention._forward_op(q, k, v, True, scale, fp8_dtype)[0], *inputs
    )
    turbo = run_attention(lambda q, k, v: attention_fp8._forward_op(q, k, v, True, scale)[0], *inputs)
    assert sqnr(emulated[0], turbo[0]) > 40 and sqnr(emulated[1], turbo[1]) > 40
    assert all(sqnr(reference[i], emulated[i]) > 20 for i in range(4))
    assert not all(sqnr(reference[i], turbo[i]) > 5 for i in (2, 3))


def _saved(route: AttentionRoute) -> list[tuple[tuple[int, ...], int]]:
    h, S = ATTENTION_AUDIT_HEADS, ATTENTION_AUDIT_SEQ
    dims = ((h.heads, h.head_dim), (h.kv_heads, h.head_dim), (h.kv_heads, h.v_head_dim))
    q, k, v = (torch.randn(1, S, n, d, dtype=torch.bfloat16, requires_grad=True) for n, d in dims)
    with recording_saved_tensors() as saved:
        attend(route, q, k, v, scale=None, causal=True)
    return sorted((tuple(t.shape), t.element_size()) for t in saved)


@pytest.mark.parametrize("fp8, path", [(True, ATTENTION_PATHS[2]), (False, ATTENTION_PATHS[1])], ids=["fp8", "bf16"])
def test_bench_memory_models_what_primus_turbos_attention_saves(fp8, path):
    assert TURBO is not None
    route = backend_route("memory model", "primus_turbo", fp8=fp8, device=device_profile(ARCH), reason="test")
    modelled = attention_saved(path, ATTENTION_AUDIT_HEADS, ATTENTION_AUDIT_SEQ, 1)
    assert _saved(route) == sorted((t.shape, t.element_bytes) for t in modelled)
