"""Shared test helpers. The fp32 references, forward+backward runners and SQNR bars live in
titan_primus.numerics (the parity command and the sentinel use them too); they are re-exported here
under the names the tests use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_primus import DeviceProfile, device_profile, make_recipe
from titan_primus.numerics import (
    fp32_bars,
    make_offsets,
    reference_grouped,
    reference_linear,
    run_grouped,
    run_linear,
    sqnrs,
)

__all__ = [
    "Hardware",
    "attention_grads",
    "sgd_losses",
    "bars",
    "expert_parallel_sqnrs",
    "make_offsets",
    "reference_grouped",
    "reference_linear",
    "run_grouped",
    "run_linear",
    "sqnrs",
]


def bars(recipe: str) -> tuple[float, float, float]:
    """Minimum SQNR (dB) vs fp32 for (out, grad_input, grad_weight) under the recipe's TorchAO definition."""
    return fp32_bars(make_recipe(recipe, "torchao", device_profile("cpu")))


@dataclass(frozen=True)
class Hardware:
    """Where a hardware test's body runs (the ``hardware`` fixture): on the GPU its marker names,
    or, for an MI300 test, in the real-code tier too (tests/real_turbo: Primus-Turbo's own code
    on CPU tensors under Triton's interpreter, the architecture given to routing as a profile)."""

    device: str
    """The tensors' device."""
    profile: DeviceProfile
    """The device routing is asked about."""
    compile_backend: str = "inductor"
    """torch.compile's backend (the tier's interpreter runs ``aot_eager``: no Triton code generation)."""
    group_lens: Callable[[torch.Tensor], torch.Tensor] = lambda lens: lens
    """``group_lens`` as Primus-Turbo's public grouped op takes them (it asserts ``is_cuda``)."""
    backend: str = "auto"
    """The backend asked for: routing's choice, or one named where routing here would take
    another (TorchAO on a CPU, where routing takes the emulation)."""

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def expert_parallel_sqnrs(grouped_mm, recipe, seed: int = 0) -> list[tuple[list[float], list[float]]]:
    """Per expert, the SQNR vs fp32 of (out, grad_A, grad_W) when one device runs all 4 experts'
    grouped GEMM, and when 2 expert-parallel ranks each run their 2 experts on the tokens routed
    to them. Experts' tokens and weights differ in magnitude (x0.25 to x4), so scales taken over a
    rank's experts differ from one device's."""
    g = torch.Generator().manual_seed(seed)
    counts, k, n = [300, 96, 210, 150], 256, 256
    magnitude = torch.tensor([1.0, 4.0, 0.25, 2.0])
    A = torch.cat([torch.randn(c, k, generator=g) * m for c, m in zip(counts, magnitude)]).bfloat16()
    W = (torch.randn(len(counts), n, k, generator=g) * k**-0.5 * magnitude.flip(0).view(-1, 1, 1)).bfloat16()
    grad = torch.randn(sum(counts), n, generator=g) * 1e-3

    def per_expert(result, experts: slice):
        bounds = make_offsets([0, *counts[experts]]).tolist()
        out, grad_A, grad_W = result
        return [(out[s:e], grad_A[s:e], grad_W[i]) for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]

    def run(rows: slice, experts: slice):
        fp8 = lambda A, B_t, offs: grouped_mm(A, B_t, offs, recipe)  # noqa: E731
        return per_expert(run_grouped(fp8, A[rows], W[experts], make_offsets(counts[experts]), grad[rows]), experts)

    everything, half = slice(None), sum(counts[:2])
    reference = per_expert(reference_grouped(A, W, make_offsets(counts), grad), everything)
    one_device = run(everything, everything)
    ranks = run(slice(None, half), slice(None, 2)) + run(slice(half, None), slice(2, None))
    return [(sqnrs(r, one), sqnrs(r, ep)) for r, one, ep in zip(reference, one_device, ranks)]


def sgd_losses(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, steps: int, lr: float = 0.5
) -> list[float]:
    """The losses of ``steps`` SGD steps of ``model`` on one batch (cross entropy of its logits).
    SGD rather than AdamW: AdamW's normalised updates amplify any last-bit gradient difference,
    and these comparisons are about one module's numerics."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, -2).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def attention_grads(fn, q, k, v, dout):
    """``fn(q, k, v)`` and, for the output gradient ``dout``, the gradients of q, k and v:
    (out, dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out.detach(), *(leaf.grad for leaf in leaves)
