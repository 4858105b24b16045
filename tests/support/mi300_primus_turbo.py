"""The Primus-Turbo rules on the REAL kernels and GPU: runs only on an MI300-class GPU with
Primus-Turbo installed (``mi300`` marker; ci/mi300x.sh). Each test is the hardware twin of
a test of tests/real_turbo, which runs Primus-Turbo's own Python and Triton code on a CPU under
Triton's interpreter with its HIP ops stood in: if one fails here, a stand-in or the adapter is
wrong about the hardware. The bodies here run in that tier too, on every build and architecture
(tests/real_turbo/test_hardware_bodies.py, through the ``hardware`` fixture: the tensors' device
and the profile routing is asked about), so a crash in one shows on every CI run; on the hardware
the routing each one relies on is asserted, never skipped.

What each asserts: fp32 activations come back fp32 and agree with the emulation; the contraction
edges route as the adapter says; any number of tokens runs; rows past the groups are zero; the
compiled path equals the eager one; the profiler sees three Primus-Turbo FP8 GEMMs per op per
training step under torch.compile, and backward keeps FP8 activations and no copy of the weight.

The tests live here so that two modules collect them, each with its own ``hardware`` fixture:
tests/unit/test_mi300_primus_turbo.py on the GPU (marked ``mi300``) and the real-code tier on a CPU.
"""

import pytest
import torch
from packaging.version import Version
from support.helpers import Hardware, make_offsets, run_grouped, run_linear, sqnrs

import titan_primus as tp
from titan_primus.backends.primus_turbo import load_api

GEMM_OPS = (
    "primus_turbo::gemm_fp8_impl",
    "primus_turbo::grouped_gemm_fp8_impl",
    "primus_turbo::grouped_gemm_fp8_variable_k_impl",
)


@pytest.fixture
def turbo():
    api = load_api()
    assert not isinstance(api, str), api
    return api


def decide(hardware: Hardware, op, recipe, **dims):
    return tp.select_backend(op, recipe, hardware.profile, **dims)


def turbo_decision(hardware: Hardware, op, recipe, **dims):
    """The routing on the hardware, which must pick Primus-Turbo here (a wrong rule fails, not skips)."""
    decision = decide(hardware, op, recipe, **dims)
    assert decision.backend_name == "primus_turbo", decision.explain()
    return decision


def linear_fn(decision):
    return lambda x, w, b: decision.backend.linear(x, w, b, decision.recipe)


def grouped_fn(decision):
    return lambda A, B_t, offs: decision.backend.grouped_mm(A, B_t, offs, decision.recipe)


def emulated(decision, op):
    def fn(*args):
        if op == "linear":
            return tp.fp8_linear(*args, recipe=decision.recipe, backend="emulated")
        return tp.fp8_grouped_mm(*args, recipe=decision.recipe, backend="emulated")

    return fn


def grouped_inputs(device, k=256, n=512, counts=(300, 0, 211, 9), trailing=37):
    offs = make_offsets(list(counts)).to(device)
    A = torch.randn(sum(counts) + trailing, k, dtype=torch.bfloat16, device=device)
    weights = (torch.randn(len(counts), n, k, device=device) * 0.05).bfloat16()
    return A, weights.transpose(-2, -1), offs, torch.randn(A.shape[0], n, device=device)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp32_activations(turbo, hardware, recipe):
    decision = turbo_decision(hardware, "linear", recipe, k=1024, n=2048)
    device = hardware.device
    x = torch.randn(507, 1024, device=device)
    w = torch.randn(2048, 1024, device=device) * 0.02
    b = torch.randn(2048, device=device)
    g = torch.randn(507, 2048, device=device)
    got = run_linear(linear_fn(decision), x, w, b, g)
    assert [t.dtype for t in got[:3]] == [torch.float32] * 3
    assert min(sqnrs(run_linear(emulated(decision, "linear"), x, w, b, g), got)) >= 25


def test_dense_contraction_edges(turbo, hardware):
    """Where rowwise dense GEMMs run on Triton (v0.3.2.dev48+), K and N under 256 are refused
    (``tl.assume(loop_k > 1)``); on CK (v0.3.1) K and N must be multiples of 32."""
    triton = turbo.at_least("v0.3.2.dev48")
    assert (decide(hardware, "linear", "rowwise", k=240, n=256).backend_name == "primus_turbo") is False
    assert (decide(hardware, "linear", "rowwise", k=256, n=240).backend_name == "primus_turbo") is False
    assert (decide(hardware, "linear", "rowwise", k=288, n=256).backend_name == "primus_turbo") is True
    if not triton:
        assert decide(hardware, "linear", "rowwise", k=272, n=256).backend_name != "primus_turbo"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tokens", [1, 17, 255, 300])
def test_any_number_of_tokens(turbo, hardware, recipe, tokens):
    """The wgrad contracts over tokens: the adapter pads rows to the kernels' minimum."""
    decision = turbo_decision(hardware, "linear", recipe, k=1024, n=2048)
    device = hardware.device
    x = torch.randn(tokens, 1024, dtype=torch.bfloat16, device=device)
    w = torch.randn(2048, 1024, device=device) * 0.02
    g = torch.randn(tokens, 2048, device=device)
    got = run_linear(linear_fn(decision), x, w, None, g)
    assert all(torch.isfinite(t).all() for t in got[:3])
    assert min(sqnrs(run_linear(emulated(decision, "linear"), x, w, None, g), got)) >= 25


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_grouped_small_k_edge(turbo, hardware, recipe):
    """K or N = 240 is refused (the Triton grouped kernels' ``tl.assume(loop_k > 1)``); K = 256,
    the smallest admitted without origami, agrees with the emulation (unbalanced, empty and
    trailing-row groups)."""
    turbo_backend = tp.registry.get_backend("primus_turbo")
    # (Asked of the backend: routing raises for tensorwise here, no other backend runs it.)
    assert not turbo_backend.supports("grouped_mm", recipe, hardware.profile, k=240, n=512)
    assert not turbo_backend.supports("grouped_mm", recipe, hardware.profile, k=512, n=240)
    decision = turbo_decision(hardware, "grouped_mm", recipe, k=256, n=256)
    A, B_t, offs, g = grouped_inputs(hardware.device, k=256, n=256)
    W = B_t.transpose(-2, -1)  # run_grouped takes [E, N, K] weights and hands the op their view
    got = run_grouped(grouped_fn(decision), A, W, offs, g)
    assert all(torch.isfinite(t).all() for t in got)
    assert (got[0][-37:] == 0).all() and (got[1][-37:] == 0).all()
    assert min(sqnrs(run_grouped(emulated(decision, "grouped_mm"), A, W, offs, g), got)) >= 25


def test_tail_rows_of_the_public_op(turbo, hardware):
    """v0.4.0 zeroes rows past sum(group_lens) itself; earlier builds leave them unwritten
    (whatever the allocator held), which is why the adapter masks them."""
    import primus_turbo.pytorch as primus_turbo

    A, B_t, offs, _ = grouped_inputs(hardware.device)
    lens = hardware.group_lens(torch.diff(offs, prepend=offs.new_zeros(1)).to(torch.int64))
    enums = turbo.enums
    config = enums.Float8QuantConfig(format=enums.Format.E4M3, granularity=enums.ScalingGranularity.ROWWISE)
    out = primus_turbo.ops.grouped_gemm_fp8(
        A, B_t.transpose(-2, -1), lens, trans_b=True, out_dtype=torch.bfloat16, config=config
    )
    assert torch.isfinite(out[: int(offs[-1])]).all()
    if Version(turbo.version) >= Version("0.4.0"):  # a build, not an API surface (release.SURFACES)
        assert (out[-37:] == 0).all()


def test_contiguous_b_t_runs_without_transposition(turbo, hardware):
    """A contiguous [E, K, N] B_t goes in with trans_b=False; same result as its transposed view."""
    decision = turbo_decision(hardware, "grouped_mm", "rowwise", k=256, n=512)
    A, B_t, offs, g = grouped_inputs(hardware.device)
    contiguous_b_t = []

    def fn(A, B_t, offs):
        contiguous_b_t.append(B_t.is_contiguous())
        return grouped_fn(decision)(A, B_t, offs)

    # run_grouped hands the op its weights' transposed view (clones keep the strides).
    view = run_grouped(fn, A, B_t.transpose(-2, -1), offs, g)
    contiguous = run_grouped(fn, A, B_t.contiguous().transpose(-2, -1), offs, g)
    assert contiguous_b_t == [False, True]
    assert min(sqnrs(view, contiguous)) >= 40


def _profiled_step(hardware, fn, inputs, grad):
    """(output, grads, Primus-Turbo FP8 GEMM op calls by name, bytes saved for backward by dtype)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    saved: dict[torch.dtype, int] = {}

    def pack(t):
        saved[t.dtype] = saved.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*leaves)
        out.backward(grad)
        hardware.synchronize()
    counts = {}
    for event in prof.events():
        if event.name in GEMM_OPS:
            counts[event.name] = counts.get(event.name, 0) + 1
    return out, [t.grad for t in leaves if t.requires_grad], counts, saved


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_compiled_path_on_the_real_kernels(turbo, hardware, recipe, op):
    """Compiled vs eager, the GEMM count from the profiler, and what backward keeps: FP8
    activations and the weight itself, no copy of it."""
    device = hardware.device
    if op == "linear":
        decision = turbo_decision(hardware, "linear", recipe, k=512, n=512)
        fn = linear_fn(decision)
        x = torch.randn(256, 512, dtype=torch.bfloat16, device=device)
        w = torch.randn(512, 512, device=device) * 0.02
        inputs, grad = (x, w), torch.randn(256, 512, dtype=torch.bfloat16, device=device)
        call = lambda x, w: fn(x, w, None)  # noqa: E731
    else:
        decision = turbo_decision(hardware, "grouped_mm", recipe, k=256, n=512)
        A, B_t, offs, g = grouped_inputs(device)
        call, inputs, grad = grouped_fn(decision), (A, B_t, offs), g.bfloat16()
    eager = _profiled_step(hardware, call, inputs, grad)
    torch._dynamo.reset()
    compiled_call = torch.compile(call, backend=hardware.compile_backend, fullgraph=True)
    _profiled_step(hardware, compiled_call, inputs, grad)  # compile outside the measured step
    out, grads, counts, saved = _profiled_step(hardware, compiled_call, inputs, grad)
    assert sum(counts.values()) == 3, counts
    assert saved.get(turbo.float8_e4m3, 0) == inputs[0].numel()  # the activation's FP8 copy; no weight copy
    assert torch.equal(out, eager[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, eager[1]))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_fsdp_gathered_fp8_weights_give_exactly_the_normal_path(turbo, hardware, recipe, op):
    """The twin of tests/real_turbo/test_fsdp_gathered.py: a weight quantized as
    an FSDP2 rank quantizes it for FP8 all-gather, then what the backend builds from the payload
    (expert weights transposed to B_t as TorchTitan does), gives the output and gradients of the
    plain bf16 weight through the normal eager path, bit for bit."""
    from titan_primus.fsdp_fp8 import fp8_all_gather_plan, quantize_weight

    dims = {"k": 1024, "n": 2048} if op == "linear" else {"k": 256, "n": 512}
    decision = turbo_decision(hardware, op, recipe, **dims)
    plan, verdict = fp8_all_gather_plan(decision.backend, decision.recipe, op)
    assert plan is not None, verdict.reason  # tensorwise and rowwise take the gathered FP8 weight
    device = hardware.device
    if op == "linear":
        weight = (torch.randn(2048, 1024, device=device) * 0.02).bfloat16()
        x = torch.randn(512, 1024, dtype=torch.bfloat16, device=device)
        grad = torch.randn(512, 2048, dtype=torch.bfloat16, device=device)
        call = lambda x, w: decision.backend.linear(x, w, None, decision.recipe)  # noqa: E731
        inputs = (x,)
    else:
        A, B_t, offs, grad = grouped_inputs(device)
        weight, grad = B_t.transpose(-2, -1).contiguous(), grad.bfloat16()
        call = lambda A, w: decision.backend.grouped_mm(A, w.transpose(-2, -1), offs, decision.recipe)  # noqa: E731
        inputs = (A,)
    data, scale = quantize_weight(weight, plan, weight.abs().amax().float())
    gathered = decision.backend.gathered_weight(data, scale, torch.bfloat16, decision.recipe, plan.quantize_dtype)

    def step(w):
        leaves = [t.detach().requires_grad_() for t in (*inputs, w)]
        out = call(*leaves)
        out.backward(grad)
        return out, [t.grad for t in leaves]

    out, grads = step(weight)
    g_out, g_grads = step(gathered)
    assert torch.equal(g_out, out) and all(torch.equal(a, b) for a, b in zip(g_grads, grads))
