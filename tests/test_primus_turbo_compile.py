"""The compiled Primus-Turbo path, against the TEST DOUBLE (tests/doubles/): fullgraph
torch.compile traces Primus-Turbo's low-level custom ops (v0.3.0+), runs three FP8 GEMMs per op
per training step, saves FP8 operands and fp32 scales for backward (never the bf16 inputs), and
agrees bit for bit with the eager path through Primus-Turbo's public ops. v0.2.0, which has no
low-level GEMM ops, keeps a working compiled path that re-runs the forward in backward.

The figures in docs/measurements.md ("Primus-Turbo under torch.compile") are these tests' numbers.
Not evidence about the real kernels (tests/test_mi300_primus_turbo.py counts them there)."""

import pytest
import torch
from doubles import primus_turbo_double
from helpers import make_offsets

import titan_primus as tp

M, K, N = 64, 256, 512
ROWS, EXPERTS = 96, 3


def install(monkeypatch, version, arch="gfx942"):
    primus_turbo_double.install(monkeypatch, version=version, arch=arch)
    tp.registry.refresh()


def step(fn, inputs, grad):
    """One forward + backward of ``fn``: (output, input grads, FP8 GEMM launches by kernel name,
    {dtype: bytes} of the tensors autograd saved for backward)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    saved: dict[torch.dtype, int] = {}

    def pack(t):
        saved[t.dtype] = saved.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    primus_turbo_double.KERNEL_CALLS.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    out.backward(grad)
    gemms = {k: v for k, v in primus_turbo_double.KERNEL_CALLS.items() if k in primus_turbo_double.GEMM_KERNELS}
    return out, [t.grad for t in leaves if t.requires_grad], gemms, saved


def linear_case(recipe, arch="gfx942", x_dtype=torch.bfloat16):
    decision = tp.select_backend("linear", recipe, arch, "primus_turbo")
    fn = lambda x, w: decision.backend.linear(x, w, None, decision.recipe)  # noqa: E731
    return fn, (torch.randn(M, K, dtype=x_dtype), torch.randn(N, K) * 0.05), torch.randn(M, N, dtype=x_dtype)


def grouped_case(recipe, arch="gfx942"):
    decision = tp.select_backend("grouped_mm", recipe, arch, "primus_turbo")
    fn = lambda A, B_t, offs: decision.backend.grouped_mm(A, B_t, offs, decision.recipe)  # noqa: E731
    weights = (torch.randn(EXPERTS, N, K) * 0.05).bfloat16()  # [E, N, K]; B_t is its transposed view
    A = torch.randn(ROWS, K, dtype=torch.bfloat16)
    offs = make_offsets([40, 0, 50])  # 6 trailing rows
    return fn, (A, weights.transpose(-2, -1), offs), torch.randn(ROWS, N, dtype=torch.bfloat16)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True)


CASES = [(v, r) for v in ("v0.3.0", "v0.3.1", "v0.4.0") for r in ("tensorwise", "rowwise")]


@pytest.mark.parametrize("version, recipe", CASES)
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_compiled_path_runs_three_fp8_gemms_and_saves_fp8(version, recipe, op, monkeypatch):
    install(monkeypatch, version)
    if op == "grouped_mm" and version == "v0.3.0" and recipe == "tensorwise":
        pytest.skip("refused at v0.3.0 (test_primus_turbo_rules.py)")
    fn, inputs, grad = (linear_case if op == "linear" else grouped_case)(recipe)
    eager_out, eager_grads, eager_gemms, _ = step(fn, inputs, grad)
    out, grads, gemms, saved = step(compiled(fn), inputs, grad)

    assert sum(gemms.values()) == 3, gemms
    if op == "grouped_mm":
        assert gemms == {"grouped_gemm_fp8_impl": 2, "grouped_gemm_fp8_variable_k_impl": 1}
    fp8 = {primus_turbo_double._Release(version, "gfx942").e4m3}
    a, b = inputs[0], inputs[1]
    # FP8 data (one byte per element of each operand), fp32 scales, group offsets and masks:
    # no 16-bit copy of an input.
    assert set(saved) <= fp8 | {torch.float32, torch.int64, torch.int32, torch.bool}, saved
    assert saved[next(iter(fp8))] == a.numel() + b.numel()
    assert saved.get(torch.float32, 0) < 0.1 * saved[next(iter(fp8))]
    # Same kernels, same numerics as Primus-Turbo's public ops in eager.
    assert eager_gemms == gemms
    assert torch.equal(out, eager_out)
    assert all(torch.equal(x, y) for x, y in zip(grads, eager_grads))


@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_v020_compiles_by_rerunning_the_forward(op, monkeypatch):
    """v0.2.0 has no low-level GEMM ops: the public ops run inside opaque custom ops, and backward
    re-runs the forward (4 FP8 GEMMs) from the saved bf16 inputs. Still equal to eager."""
    install(monkeypatch, "v0.2.0")
    fn, inputs, grad = (linear_case if op == "linear" else grouped_case)("rowwise")
    eager_out, eager_grads, _, _ = step(fn, inputs, grad)
    out, grads, gemms, saved = step(compiled(fn), inputs, grad)
    assert sum(gemms.values()) == 4, gemms
    a = inputs[0]
    assert saved[torch.bfloat16] >= 2 * a.numel() and not any(d.is_floating_point and d.itemsize == 1 for d in saved)
    assert torch.equal(out, eager_out)
    assert all(torch.equal(x, y) for x, y in zip(grads, eager_grads))
    assert "re-runs the forward" in tp.registry.get_backend("primus_turbo").execution_paths()["compiled"]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_compiled_fp32_activations(arch, monkeypatch):
    """fp32 activations under compile: bf16 kernel output upcast, fp32 gradients, equal to eager."""
    install(monkeypatch, "v0.4.0", arch)
    fn, inputs, grad = linear_case("rowwise", arch, x_dtype=torch.float32)
    eager_out, eager_grads, _, _ = step(fn, inputs, grad)
    out, grads, gemms, _ = step(compiled(fn), inputs, grad)
    assert out.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32, torch.float32]
    assert torch.equal(out, eager_out) and all(torch.equal(x, y) for x, y in zip(grads, eager_grads))
    assert sum(gemms.values()) == 3
