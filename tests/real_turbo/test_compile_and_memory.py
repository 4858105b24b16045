"""The Primus-Turbo path under ``torch.compile(fullgraph=True)`` equals eager bit for bit and
runs three FP8 GEMMs per op per step; what it keeps from forward to backward is the weight
itself and FP8 activations, never a copy of the weight (Primus-Turbo's own ops keep one)."""

import sys

import pytest
import torch

import titan_primus as tp
from real_turbo.conftest import ARCH, RECIPES
from real_turbo.calls import DISPATCHERS, SavedTensors, grads, turbo_own

FP8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
GEMMS = ("gemm_fp8_impl", "grouped_gemm_fp8_impl", "grouped_gemm_fp8_variable_k_impl")


def _decision(op, recipe):
    return tp.select_backend(op, recipe, ARCH, "primus_turbo", k=256, n=512)


def _linear(recipe):
    decision = _decision("linear", recipe)
    return lambda x, w: decision.backend.linear(x, w, None, decision.recipe)


OFFS = torch.tensor([24, 24, 64], dtype=torch.int32)  # an empty expert, no trailing rows


def _grouped(recipe):
    decision = _decision("grouped_mm", recipe)
    return lambda A, W: decision.backend.grouped_mm(A, W.transpose(-2, -1), OFFS, decision.recipe)


def _inputs(op):
    if op == "linear":
        return torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(512, 256, dtype=torch.bfloat16)
    return torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(3, 512, 256, dtype=torch.bfloat16)


def _gemm_launches(fn, *inputs, monkeypatch):
    """``grads(fn, *inputs)`` and the FP8 GEMMs it launched, eager or compiled."""
    launches = _counting_gemm_launches(monkeypatch)
    return grads(fn, *inputs), launches


def _counting_gemm_launches(monkeypatch) -> list:
    """The list each FP8 GEMM launched from now on is appended to: the calls into the kernel
    dispatchers behind Primus-Turbo's ``primus_turbo::*_impl`` custom ops."""
    launches = []
    for module, classes in DISPATCHERS.items():
        for name in classes:
            dispatcher = getattr(sys.modules[module], name)
            real = dispatcher.dispatch.__func__

            def counted(cls, *args, _name=name, _real=real, **kwargs):
                launches.append(_name)
                return _real(cls, *args, **kwargs)

            monkeypatch.setattr(dispatcher, "dispatch", classmethod(counted))
    return launches


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_compiled_equals_eager_with_three_gemms(op, recipe, monkeypatch):
    fn = _linear(recipe) if op == "linear" else _grouped(recipe)
    inputs = _inputs(op)
    eager = grads(fn, *inputs)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    graph, launches = _gemm_launches(compiled, *inputs, monkeypatch=monkeypatch)
    for a, b in zip(eager, graph):
        assert torch.equal(a, b)
    assert len(launches) == 3, launches


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_weight_copy_is_kept_for_backward(op, recipe, compiled):
    """The weight (512 x 256: larger than the activation) is saved as itself; the activation as
    FP8. Primus-Turbo's own autograd Functions keep an FP8 copy of the weight: one byte per
    weight element, which under FSDP2 stays resident for every layer from its forward to its
    backward."""
    fn = _linear(recipe) if op == "linear" else _grouped(recipe)
    x, w = (t.clone().requires_grad_() for t in _inputs(op))
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    with SavedTensors() as ours:
        fn(x, w)
    assert ours.copies_of(w) == 0
    assert ours.fp8_bytes() >= x.numel()  # the activation's FP8 copy (and, blockwise, its scales)
    if not compiled:
        with SavedTensors() as theirs:
            turbo_own(op, recipe, OFFS)(x, w)
        assert theirs.copies_of(w) >= w.numel()  # what the adapter no longer keeps


class QuantizerCalls:
    """Every call of Primus-Turbo's quantizers (``kernels/quantization/quantization_impl.py``)
    in eager mode, as (phase, shape of the tensor cast): phase "forward" until ``backward()``."""

    def __init__(self, monkeypatch):
        self.calls, self.phase = [], "forward"
        quant = sys.modules[tp.backends.primus_turbo.release.QUANT_MODULE]
        for name in dir(quant):
            real = getattr(quant, name)
            if name.endswith("_impl") and "quant" in name and callable(real):

                def counted(*args, _real=real, **kwargs):
                    # The tensor cast: titan-primus names it (x, or w for the weight quantizer).
                    t = args[0] if args else kwargs.get("x", kwargs.get("w"))
                    self.calls.append((self.phase, tuple(t.shape)))
                    return _real(*args, **kwargs)

                monkeypatch.setattr(quant, name, counted)

    def shapes(self, phase):
        return [shape for p, shape in self.calls if p == phase]


def _step(op, recipe, frozen, compiled=False):
    """One forward and backward with ``frozen`` ("weight", "input" or None) not requiring grad:
    the GEMMs launched, the quantizer calls, the tensors saved for backward, the leaves."""
    fn = _linear(recipe) if op == "linear" else _grouped(recipe)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x, w = (t.clone().requires_grad_(frozen != name) for t, name in zip(_inputs(op), ("input", "weight")))
    with pytest.MonkeyPatch.context() as monkeypatch:
        launches = _counting_gemm_launches(monkeypatch)
        casts = None if compiled else QuantizerCalls(monkeypatch)  # eager: Python side effects
        with SavedTensors() as saved:
            out = fn(x, w)
        if casts:
            casts.phase = "backward"
        out.backward(torch.randn_like(out))
    return launches, casts, saved, x, w


@pytest.mark.parametrize("frozen", ["weight", "input"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_a_frozen_operand_costs_no_gemm_no_cast_and_keeps_nothing(op, recipe, frozen):
    """LoRA base weights, frozen layers, an input that needs no gradient: backward runs one FP8
    GEMM (the gradient that is needed), casts nothing only the other gradient reads, and
    forward keeps nothing for it. Primus-Turbo's own Functions run both GEMMs and every cast."""
    launches, casts, saved, x, w = _step(op, recipe, frozen)
    full_launches, full_casts, *_ = _step(op, recipe, None)
    assert len(full_launches) == 3 and len(launches) == 2, launches
    assert (x.grad is None) == (frozen == "input") and (w.grad is None) == (frozen == "weight")
    w_shape = tuple(w.shape)

    def of_input(shapes):  # [rows, K] (the linear's rows padded to the kernels' minimum)
        return sum(s[-1] == x.shape[-1] and s != w_shape for s in shapes)

    if frozen == "weight":
        # No cast of the activation for the wgrad (rowwise: dequantize and re-quantize in
        # forward), no FP8 activation kept (blockwise: one kernel casts it both ways).
        dropped = 2 if recipe == "rowwise" else 0
        assert of_input(casts.shapes("forward")) == of_input(full_casts.shapes("forward")) - dropped
        assert not [t for t in saved.saved if t.dtype in FP8], [(t.shape, t.dtype) for t in saved.saved]
    else:
        # No weight cast in backward, no weight kept.
        assert w_shape not in casts.shapes("backward") and w_shape in full_casts.shapes("backward")
        assert len(casts.calls) < len(full_casts.calls), (casts.calls, full_casts.calls)
        storage = w.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() != storage for t in saved.saved)


@pytest.mark.parametrize("frozen", ["weight", "input"])
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_a_frozen_operand_costs_no_gemm_compiled(op, frozen):
    launches, *_ = _step(op, "rowwise", frozen, compiled=True)
    assert len(launches) == 2, launches


WEIGHT_FOR_BACKWARD = torch.ops.titan_primus.primus_turbo_weight_for_backward.default


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_for_backward_is_a_well_formed_custom_op(recipe):
    """torch.library.opcheck (schema: no output aliases an input; fake implementation; autograd
    registration; AOT dispatch) on the op that makes the weight's backward operands, from a bf16
    weight and (rowwise) from an FP8 payload FSDP2 gathered."""
    api = tp.backends.primus_turbo.release.require_api()
    fwd, bwd = api.formats(recipe)
    weight, grad = torch.randn(512, 256, dtype=torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16)
    torch.library.opcheck(WEIGHT_FOR_BACKWARD, (weight, None, grad, recipe, fwd, torch.bfloat16, -1, -2))
    if recipe == "rowwise":
        # opcheck's schema check cannot compare FP8 inputs (torch 2.14: "mul_cpu_reduced_float" not
        # implemented for FP8): the aliasing it checks is checked here, the rest by opcheck.
        q, scale_inv = api.quant.quantize_fp8_rowwise_impl(weight, fwd, 1)
        args = (q, scale_inv, grad, recipe, fwd, torch.bfloat16, -1, -2)
        inputs = {t.untyped_storage().data_ptr() for t in (q, scale_inv, grad)}
        assert not inputs & {t.untyped_storage().data_ptr() for t in WEIGHT_FOR_BACKWARD(*args)}
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(WEIGHT_FOR_BACKWARD, args, test_utils=utils)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_weight_for_backward_refuses_to_return_a_gathered_payload(recipe):
    """Where backward reads the gathered payload as it is, the op would hand back its inputs."""
    api = tp.backends.primus_turbo.release.require_api()
    fwd, _ = api.formats(recipe)
    q = torch.randn(512, 256).to(fwd)
    with pytest.raises(ValueError, match="must not alias"):
        WEIGHT_FOR_BACKWARD(
            q, torch.ones(()), torch.randn(64, 512, dtype=torch.bfloat16), recipe, fwd, torch.bfloat16, -1, -2
        )
