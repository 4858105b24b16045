"""FP8 GEMM launches and bytes saved for backward per op per training step under
torch.compile(fullgraph=True), against the Primus-Turbo TEST DOUBLE (tests/doubles/): the figures
of docs/measurements.md, "Primus-Turbo under torch.compile". Not the real kernels.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python docs/primus_turbo_compile_measure.py v0.4.0
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from doubles import primus_turbo_double  # noqa: E402
from helpers import make_offsets  # noqa: E402

import titan_primus as tp  # noqa: E402

M, K, N = 2048, 1024, 1024
EXPERTS, ROWS, COUNTS = 4, 1024, [400, 0, 300, 260]


def step(fn, inputs, grad):
    """(output, grads, FP8 GEMM launches, {dtype: bytes saved for backward})."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    saved: dict[str, int] = {}

    def pack(t):
        name = str(t.dtype).removeprefix("torch.")
        saved[name] = saved.get(name, 0) + t.numel() * t.element_size()
        return t

    primus_turbo_double.KERNEL_CALLS.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    out.backward(grad)
    gemms = sum(n for k, n in primus_turbo_double.KERNEL_CALLS.items() if k in primus_turbo_double.GEMM_KERNELS)
    return out, [t.grad for t in leaves if t.requires_grad], gemms, saved


def report(label, fn, inputs, grad):
    eager = step(fn, inputs, grad)
    torch._dynamo.reset()
    out, grads, gemms, saved = step(torch.compile(fn, fullgraph=True), inputs, grad)
    equal = torch.equal(out, eager[0]) and all(torch.equal(a, b) for a, b in zip(grads, eager[1]))
    print(f"{label}: compiled GEMMs {gemms}, saved {saved} = {sum(saved.values())} B; "
          f"eager GEMMs {eager[2]}; compiled == eager bitwise: {equal}")


def main(version: str) -> None:
    monkeypatch = pytest.MonkeyPatch()
    primus_turbo_double.install(monkeypatch, version=version)
    tp.registry.refresh()
    for recipe in ("rowwise", "tensorwise"):
        if version == "v0.2.0" and recipe == "tensorwise":
            continue  # refused there
        linear = tp.select_backend("linear", recipe, "gfx942", "primus_turbo")
        for weight_dtype in (torch.bfloat16, torch.float32):
            inputs = (torch.randn(M, K, dtype=torch.bfloat16), (torch.randn(N, K) * 0.03).to(weight_dtype))
            report(f"{version} linear {recipe}, weight {weight_dtype}",
                   lambda x, w: linear.backend.linear(x, w, None, linear.recipe),
                   inputs, torch.randn(M, N, dtype=torch.bfloat16))
        grouped = tp.select_backend("grouped_mm", recipe, "gfx942", "primus_turbo")
        weights = (torch.randn(EXPERTS, N, K) * 0.03).bfloat16()
        inputs = (torch.randn(ROWS, K, dtype=torch.bfloat16), weights.transpose(-2, -1), make_offsets(COUNTS))
        report(f"{version} grouped {recipe}", lambda A, B_t, offs: grouped.backend.grouped_mm(A, B_t, offs, grouped.recipe),
               inputs, torch.randn(ROWS, N, dtype=torch.bfloat16))
    monkeypatch.undo()


if __name__ == "__main__":
    main(sys.argv[1])
