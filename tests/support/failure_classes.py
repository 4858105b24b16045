"""The ways FP8 training has silently gone wrong in the field, as checks of one backend, device
profile and recipe (tests/integrations/torchtitan/v0_3/test_failure_classes.py runs them on every backend here,
tests/real_turbo/test_failure_classes.py on Primus-Turbo's own code): gradient accumulation over
microbatches, uninitialized or stale output rows, determinism."""

import torch

import titan_primus as tp
from support.helpers import make_offsets, reference_grouped, reference_linear
from titan_primus.metrics import sqnr
from titan_primus.numerics import fp32_bars


def backend_and_recipe(backend, device, recipe):
    impl = tp.registry.get_backend(backend)
    return impl, impl.recipe_for(recipe, tp.device_profile(device))


def per_row(recipe) -> bool:
    """Output and grad_input rows depend on their own row only (rowwise scales): then a row is
    bit for bit the same whichever batch it is in."""
    return all(c.granularity == "rowwise" for g in (recipe.output, recipe.grad_input) for c in (g.a, g.b))


# --- gradient accumulation ----------------------------------------------------------------


def _linear_steps(impl, recipe, weight, batches):
    """(out, grad_x) of every microbatch and the weight gradient accumulated over them, as a
    trainer accumulates it: one leaf, one backward per microbatch."""
    weight = weight.clone().requires_grad_()
    outs, grads = [], []
    for x, grad_out in batches:
        x = x.clone().requires_grad_()
        out = impl.linear(x, weight, None, recipe)
        out.backward(grad_out)
        outs.append(out)
        grads.append(x.grad)
    return torch.cat(outs), torch.cat(grads), weight.grad


def _grouped_steps(impl, recipe, weight, batches):
    weight = weight.clone().requires_grad_()
    outs, grads = [], []
    for A, offs, grad_out in batches:
        A = A.clone().requires_grad_()
        out = impl.grouped_mm(A, weight.transpose(-2, -1), offs, recipe)
        out.backward(grad_out)
        outs.append(out)
        grads.append(A.grad)
    return outs, grads, weight.grad


def _check_accumulated_weight_gradient(recipe, reference, big, accumulated, first_only):
    """The accumulated gradient is as close to the fp32 gradient of the whole batch as the big
    batch's own FP8 gradient is (3 dB of slack: per-microbatch scales), and within the recipe's
    bar; a gradient that kept only the first microbatch (the PR #1046 failure) is far outside."""
    bar = fp32_bars(recipe)[2]
    baseline = sqnr(reference, big)
    measured = sqnr(reference, accumulated)
    assert measured >= bar and measured >= baseline - 3, (measured, baseline, bar)
    assert sqnr(reference, first_only) < bar - 10  # the check can fail


def linear_gradient_accumulation_equals_one_big_batch(backend, device, recipe):
    impl, made = backend_and_recipe(backend, device, recipe)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=generator).bfloat16()
    weight = (torch.randn(256, 256, generator=generator) * 0.05).bfloat16()  # dims every backend takes
    grad_out = torch.randn(128, 256, generator=generator).bfloat16()
    microbatches = list(zip(x.chunk(4), grad_out.chunk(4)))
    big = _linear_steps(impl, made, weight, [(x, grad_out)])
    accumulated = _linear_steps(impl, made, weight, microbatches)
    first_only = _linear_steps(impl, made, weight, microbatches[:1])[2]
    if per_row(made):  # out and grad_input rows: bit for bit
        assert torch.equal(accumulated[0], big[0]) and torch.equal(accumulated[1], big[1])
    else:  # tensorwise: each microbatch has its own scales
        assert min(sqnr(big[i], accumulated[i]) for i in (0, 1)) >= min(fp32_bars(made)[:2])
    reference = reference_linear(x, weight, None, grad_out)[2]
    _check_accumulated_weight_gradient(made, reference, big[2], accumulated[2], first_only)


def _routed(counts_per_microbatch, generator, k=256, n=256, trailing=0):
    """Microbatches routed to experts (groups), each with ``trailing`` rows past offs[-1], and the
    one big batch of all their routed rows grouped by expert (rows of expert e: microbatch 0's,
    then microbatch 1's, ...)."""
    batches = []
    for counts in counts_per_microbatch:
        rows = sum(counts) + trailing
        batches.append(
            (
                torch.randn(rows, k, generator=generator).bfloat16(),
                make_offsets(counts),
                torch.randn(rows, n, generator=generator).bfloat16(),
            )
        )
    pieces_A, pieces_g, big_counts = [], [], []
    for expert in range(len(counts_per_microbatch[0])):
        big_counts.append(sum(c[expert] for c in counts_per_microbatch))
        for (A, offs, grad_out), counts in zip(batches, counts_per_microbatch):
            start = sum(counts[:expert])
            pieces_A.append(A[start : start + counts[expert]])
            pieces_g.append(grad_out[start : start + counts[expert]])
    big = (torch.cat(pieces_A), make_offsets(big_counts), torch.cat(pieces_g))
    return batches, big


def _in_big_batch_order(tensors, counts_per_microbatch):
    """Microbatch results (routed rows only) reordered like the big batch's rows."""
    pieces = []
    for expert in range(len(counts_per_microbatch[0])):
        for t, counts in zip(tensors, counts_per_microbatch):
            start = sum(counts[:expert])
            pieces.append(t[start : start + counts[expert]])
    return torch.cat(pieces)


def grouped_gradient_accumulation_equals_one_big_batch(backend, device, recipe):
    """Each microbatch routes its tokens its own way (an expert empty in one, not in another)."""
    impl, made = backend_and_recipe(backend, device, recipe)
    routing = [(40, 0, 24, 16), (8, 32, 0, 40), (24, 16, 16, 8)]
    batches, (A, offs, grad_out) = _routed(routing, torch.Generator().manual_seed(1), trailing=8)
    weight = (torch.randn(4, 256, 256, generator=torch.Generator().manual_seed(2)) * 0.05).bfloat16()
    big = _grouped_steps(impl, made, weight, [(A, offs, grad_out)])
    accumulated = _grouped_steps(impl, made, weight, batches)
    first_only = _grouped_steps(impl, made, weight, batches[:1])[2]
    out, grad_A = (_in_big_batch_order(accumulated[i], routing) for i in (0, 1))
    if per_row(made):
        assert torch.equal(out, big[0][0]) and torch.equal(grad_A, big[1][0])
    else:
        assert min(sqnr(big[0][0], out), sqnr(big[1][0], grad_A)) >= min(fp32_bars(made)[:2])
    reference = reference_grouped(A, weight, offs, grad_out)[2]
    _check_accumulated_weight_gradient(made, reference, big[2], accumulated[2], first_only)


# --- uninitialized and stale rows --------------------------------------------------------------


def _poison_the_allocator(rows: int, cols: int) -> None:
    """Hand the allocator memory full of NaN, so an output allocated uninitialized shows it."""
    for dtype in (torch.bfloat16, torch.float32):
        garbage = torch.full((rows, cols), float("nan"), dtype=dtype)
        del garbage


def rows_past_the_routed_tokens_and_idle_experts_get_exact_zeros_after_any_routing(
    backend,
    device,
    recipe,
):
    """Output and grad_A rows past offs[-1], and the weight gradient of experts that got no
    token, are exactly zero, also after a step with a different routing; a step's results do
    not depend on the step before."""
    impl, made = backend_and_recipe(backend, device, recipe)
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(4, 256, 256, generator=generator) * 0.05).bfloat16()
    (first,), _ = _routed([(64, 32, 48, 16)], generator, trailing=0)
    (second,), _ = _routed([(0, 80, 8, 0)], generator, trailing=72)  # experts 0 and 3 idle, 72 rows past
    fresh = _grouped_steps(impl, made, weight, [second])
    _poison_the_allocator(160, 256)
    _grouped_steps(impl, made, weight, [first])
    _poison_the_allocator(160, 256)
    (out,), (grad_A,), grad_W = _grouped_steps(impl, made, weight, [second])
    end = int(second[1][-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:])) and torch.equal(
        grad_A[end:], torch.zeros_like(grad_A[end:])
    )
    assert torch.equal(grad_W[[0, 3]], torch.zeros_like(grad_W[[0, 3]]))
    assert torch.isfinite(out).all() and torch.isfinite(grad_A).all() and torch.isfinite(grad_W).all()
    assert torch.equal(out, fresh[0][0]) and torch.equal(grad_A, fresh[1][0]) and torch.equal(grad_W, fresh[2])


# --- determinism ---------------------------------------------------------------------------


def two_identical_steps_give_identical_results(backend, device, recipe):
    impl, made = backend_and_recipe(backend, device, recipe)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(96, 256, generator=generator).bfloat16()
    weight = (torch.randn(256, 256, generator=generator) * 0.05).bfloat16()
    grad_out = torch.randn(96, 256, generator=generator).bfloat16()
    runs = [_linear_steps(impl, made, weight, [(x, grad_out)]) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    if backend != "torchao":  # TorchAO's grouped GEMM has no CPU kernel
        batch, _ = _routed([(30, 0, 50, 16)], generator, trailing=4)
        weight = (torch.randn(4, 256, 256, generator=generator) * 0.05).bfloat16()
        runs = [_grouped_steps(impl, made, weight, batch) for _ in range(2)]
        assert all(
            torch.equal(a, b)
            for a, b in zip(runs[0][0] + runs[0][1] + [runs[0][2]], runs[1][0] + runs[1][1] + [runs[1][2]])
        )


# Each check, called as check(backend, device, recipe).
FAILURE_CLASSES = (
    linear_gradient_accumulation_equals_one_big_batch,
    grouped_gradient_accumulation_equals_one_big_batch,
    rows_past_the_routed_tokens_and_idle_experts_get_exact_zeros_after_any_routing,
    two_identical_steps_give_identical_results,
)
