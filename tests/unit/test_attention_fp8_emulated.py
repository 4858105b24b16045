"""The emulated backend's FP8 attention (Primus-Turbo's flash_attn_fp8_func, blockwise 64): close
to fp32 attention, its errors, and torch.compile: one opaque op, compiled results equal to eager.
Against Primus-Turbo's own kernel: tests/real_turbo/test_attention_fp8.py."""

import pytest
import torch
import torch._inductor.config
from support.closeness import assert_bitwise, assert_sqnr_at_least
from support.helpers import attention_grads

from titan_primus.backends.emulated.attention import fp8_attention

FP8_DTYPES = [torch.float8_e4m3fnuz, torch.float8_e4m3fn]  # gfx942, gfx950
SHAPES = [(1, 128, 2, 1, 32), (2, 128, 4, 2, 64)]  # (B, L, Hq, Hkv, D): MHA-like and GQA 2:1

# Measured against fp32 SDPA on N(0, 1) data (2026-12-02, both FP8 dtypes, causal and full,
# these shapes and (2, 256, 4, 2, 64)): out 24.8-27.7 dB, dq and dk 22.5-23.9 dB, dv 24.9-26.9 dB.
MIN_DB = {"out": 22.0, "dq": 20.5, "dk": 20.5, "dv": 22.0}


def _inputs(B, L, Hq, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, h, D, generator=g).to(torch.bfloat16) for h in (Hq, Hkv, Hkv))
    return q, k, v, torch.randn(B, L, Hq, D, generator=g).to(torch.bfloat16)


def _sdpa_fp32(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_close_to_fp32_attention(shape, causal, fp8_dtype):
    q, k, v, dout = _inputs(*shape)
    fp8 = attention_grads(
        lambda *t: fp8_attention(*t, causal=causal, softmax_scale=None, fp8_dtype=fp8_dtype), q, k, v, dout
    )
    fp32 = attention_grads(lambda *t: _sdpa_fp32(*t, causal), q.float(), k.float(), v.float(), dout)
    for name, reference, actual in zip(MIN_DB, fp32, fp8):
        assert actual.dtype == torch.bfloat16 and actual.shape == reference.shape, name
        assert_sqnr_at_least(reference, actual.float(), MIN_DB[name], name)


def test_any_memory_layout_is_logical_bshd():
    """TorchTitan hands over bhsd memory (a transposed view): the result is the bshd one's."""
    q, k, v, dout = _inputs(1, 128, 2, 2, 32)
    fn = lambda *t: fp8_attention(*t, causal=True, softmax_scale=0.2, fp8_dtype=torch.float8_e4m3fn)  # noqa: E731
    bshd = attention_grads(fn, q, k, v, dout)
    bhsd_memory = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), bshd, attention_grads(fn, *bhsd_memory, dout)):
        assert_bitwise(a, b, name)


@pytest.mark.parametrize(
    "shapes, problem",
    [
        (((1, 96, 2, 32), (1, 96, 2, 32)), "multiple of 64"),
        (((1, 128, 2, 32), (1, 64, 2, 32)), "as many queries as keys"),
        (((1, 128, 3, 32), (1, 128, 2, 32)), "multiple of kv heads"),
        # Checked on each call too, for layers whose head dims the adapter could not read.
        (((1, 128, 2, 16), (1, 128, 2, 16)), "head dims \\(16, 16\\)"),
        (((1, 128, 2, 33), (1, 128, 2, 33)), "head dims \\(33, 33\\)"),
        (((1, 128, 4, 64), (1, 128, 2, 64), (1, 128, 2, 32)), "grouped-query attention with head dims \\(64, 32\\)"),
    ],
)
def test_refuses_what_primus_turbo_cannot_take(shapes, problem):
    q_shape, kv_shape, *v_shape = shapes
    q, k = torch.randn(q_shape, dtype=torch.bfloat16), torch.randn(kv_shape, dtype=torch.bfloat16)
    v = torch.randn(v_shape[0], dtype=torch.bfloat16) if v_shape else k
    with pytest.raises(ValueError, match=problem):
        fp8_attention(q, k, v, causal=True, softmax_scale=None, fp8_dtype=torch.float8_e4m3fn)


def test_nan_input_fails_the_closeness_check():
    q, k, v, dout = _inputs(*SHAPES[0])
    q[0, 5, 0, 3] = float("nan")
    out = fp8_attention(q, k, v, causal=False, softmax_scale=None, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="NaN"):
        assert_sqnr_at_least(_sdpa_fp32(*_inputs(*SHAPES[0])[:3], False), out.float(), MIN_DB["out"], "out")


class _GraphRecorder:
    """An aot_eager backend that keeps the forward and backward FX graphs it is handed."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(graph, _):
            self.graphs.append(graph)
            return make_boxed_func(graph.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    def calls(self, op_name):
        return [n for g in self.graphs for n in g.graph.nodes if n.op == "call_function" and op_name in str(n.target)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiles_fullgraph_equal_to_eager(causal, backend):
    q, k, v, dout = _inputs(*SHAPES[1])

    def fn(q, k, v):
        return fp8_attention(q * 1.5, k, v, causal=causal, softmax_scale=None, fp8_dtype=torch.float8_e4m3fnuz)

    eager = attention_grads(fn, q, k, v, dout)
    torch._dynamo.reset()
    # As the converter sets it: the casts around the op (its bf16 gradients, here scaled by 1.5)
    # round as in eager; inside the op inductor cannot reach.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = attention_grads(torch.compile(fn, fullgraph=True, backend=backend), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert_bitwise(a, b, f"{backend} {name}")


def test_is_one_opaque_op_forward_and_backward():
    q, k, v, dout = _inputs(*SHAPES[0])
    recorder = _GraphRecorder()
    torch._dynamo.reset()
    fn = torch.compile(
        lambda *t: fp8_attention(*t, causal=True, softmax_scale=None, fp8_dtype=torch.float8_e4m3fn),
        fullgraph=True,
        backend=recorder,
    )
    attention_grads(fn, q, k, v, dout)
    assert len(recorder.calls("emulated_fp8_attention_forward")) == 1
    assert len(recorder.calls("emulated_fp8_attention_backward")) == 1
    assert not recorder.calls("aten.exp2"), "the emulation's arithmetic leaked into the graph"
