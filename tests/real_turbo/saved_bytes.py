"""Bytes one FP8 layer keeps from forward to backward on Primus-Turbo's own code: its public ops
(what titan-primus's eager path called before it kept no weight copy) against titan-primus's
path, eager and compiled; weight-sized tensors that are not the weight's storage are counted
apart (docs/measurements.md).

Run with the tier's environment, e.g.
``TRITON_INTERPRET=1 TITAN_PRIMUS_TURBO_BUILD=v0.4.0 TITAN_PRIMUS_TURBO_ARCH=gfx942
PYTHONPATH=.:tests python tests/real_turbo/saved_bytes.py``."""

import torch

import titan_primus as tp
from real_turbo import loader

TURBO, why_not = loader.from_environment()
assert TURBO is not None, why_not

from real_turbo.conftest import ARCH, BUILD, RECIPES  # noqa: E402
from real_turbo.calls import SavedTensors, turbo_own  # noqa: E402

# The tests' shapes, scaled up: x [1024, 1024] and weight [2048, 1024]; A [1024, 1024] in
# three groups and B_t [3, 1024, 2048] (TorchTitan's view of [E, N, K] expert weights).
LINEAR = (torch.randn(1024, 1024, dtype=torch.bfloat16), torch.randn(2048, 1024, dtype=torch.bfloat16))
GROUPED = (torch.randn(1024, 1024, dtype=torch.bfloat16), torch.randn(3, 2048, 1024, dtype=torch.bfloat16))
GROUP_ENDS = torch.tensor([384, 384, 1024], dtype=torch.int32)


def measure(fn, inputs) -> tuple[int, int]:
    """(bytes of weight-sized copies, bytes of everything else but the weight itself)."""
    x, w = (t.clone().requires_grad_() for t in inputs)
    with SavedTensors() as saved:
        fn(x, w)
    storage = w.untyped_storage().data_ptr()
    rest = sum(t.numel() * t.element_size() for t in saved.saved if t.untyped_storage().data_ptr() != storage)
    return saved.copies_of(w), rest - saved.copies_of(w)


def main():
    print(
        f"Primus-Turbo {BUILD} on {ARCH}: bytes kept from forward to backward besides the weight itself "
        f"(weight-sized copies / activations, scales, offsets): Primus-Turbo's public op | titan-primus eager | compiled"
    )
    for op, inputs in (("linear", LINEAR), ("grouped_mm", GROUPED)):
        for recipe in RECIPES:
            decision = tp.select_backend(op, recipe, ARCH, "primus_turbo", k=1024, n=2048)
            if op == "linear":
                ours = lambda x, w: decision.backend.linear(x, w, None, decision.recipe)  # noqa: E731
            else:
                ours = lambda A, W: decision.backend.grouped_mm(A, W.transpose(-2, -1), GROUP_ENDS, decision.recipe)  # noqa: E731
            torch._dynamo.reset()
            compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
            rows = [
                measure(turbo_own(op, recipe, GROUP_ENDS), inputs),
                measure(ours, inputs),
                measure(compiled, inputs),
            ]
            print(f"| {op} | {recipe} | " + " | ".join(f"{copy:,} / {total:,}" for copy, total in rows) + " |")


if __name__ == "__main__":
    main()
