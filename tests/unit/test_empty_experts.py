"""A rank whose experts receive no token (expert parallelism with uneven routing): the grouped
GEMM of every definition on A without rows, and on rows that are all past ``offs[-1]``, gives
zero output and zero gradients, eager and compiled; without rows it launches no quantizer and
no GEMM (titan_primus.ops.run_grouped_mm). On Primus-Turbo's own code:
tests/real_turbo/test_empty_experts.py."""

import pytest
import torch
from support.doubles import torchao_grouped_kernels
from support.empty_experts import ALLOCATION_OPS, EXPERTS, K, N, assert_zero, no_token_step
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import titan_primus as tp
from titan_primus.ops import run_grouped_mm
from titan_primus.recipes import RECIPE_NAMES


def _emulated_definitions() -> list:
    backend, params = tp.registry.get_backend("emulated"), []
    for arch in ("cpu", "gfx942", "gfx950"):
        for name in RECIPE_NAMES:
            recipe = backend.recipe_for(name, tp.device_profile(arch))
            params.append(pytest.param(recipe, id=f"{arch}-{name}-{recipe.definition}"))
    return params


@pytest.mark.parametrize("recipe", _emulated_definitions())
@pytest.mark.parametrize("rows", [0, 48], ids=["no rows", "every row past offs[-1]"])
def test_grouped_gemm_of_a_rank_without_tokens_is_zero_on_every_emulated_definition(recipe, rows):
    backend = tp.registry.get_backend("emulated")
    out, grad_A, grad_B_t, ops = no_token_step(lambda a, b, o: run_grouped_mm(backend, a, b, o, recipe), rows)
    assert_zero(out, grad_A, grad_B_t, rows)
    if rows == 0:
        assert ops <= ALLOCATION_OPS, ops - ALLOCATION_OPS


@pytest.mark.parametrize("rows", [0, 48], ids=["no rows", "every row past offs[-1]"])
def test_grouped_gemm_of_a_rank_without_tokens_is_zero_on_torchao(rows, monkeypatch):
    """TorchAO's rowwise grouped GEMM, its own Python on the CPU stand-ins of its kernels
    (tests/support/doubles/torchao_grouped_kernels.py, which leave rows past the groups NaN as the
    kernels leave them undefined): no quantizer reached without rows."""
    received = torchao_grouped_kernels.install(monkeypatch)
    decision = tp.select_backend("grouped_mm", "rowwise", "sm90", "torchao")

    def gemm(a, b, offs):
        return run_grouped_mm(decision.backend, a, b, offs, decision.recipe)

    out, grad_A, grad_B_t, _ = no_token_step(gemm, rows)
    assert_zero(out, grad_A, grad_B_t, rows)
    assert any(received.values()) == (rows > 0)


def test_the_public_op_takes_a_rank_without_tokens():
    A = torch.randn(0, K, dtype=torch.bfloat16, requires_grad=True)
    B_t = torch.randn(EXPERTS, K, N, requires_grad=True)  # float32: its gradient in float32
    out = tp.fp8_grouped_mm(A, B_t, torch.zeros(EXPERTS, dtype=torch.int32), recipe="rowwise", device="gfx942")
    out.sum().backward()
    assert out.shape == (0, N) and out.dtype == torch.bfloat16
    assert B_t.grad.dtype == torch.float32 and torch.equal(B_t.grad, torch.zeros_like(B_t))


@pytest.mark.parametrize("name, arch", [("rowwise", "gfx942"), ("mxfp8", "cpu"), ("tensorwise", "gfx950")])
def test_compiled_steps_with_and_without_tokens_compile_twice(name, arch):
    """torch.compile (fullgraph, dynamic shapes) over steps with 64, 0, 48, 0 and 32 rows: two
    graphs, the one dynamic shapes specialise for 0 rows and the one for the others (measured:
    2), every result zero where no row is in a group and equal to eager elsewhere."""
    backend = tp.registry.get_backend("emulated")
    recipe = backend.recipe_for(name, tp.device_profile(arch))
    torch._dynamo.reset()

    def gemm(a, b, offs):
        return run_grouped_mm(backend, a, b, offs, recipe)

    compiled = torch.compile(gemm, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (64, 0, 48, 0, 32):
        g = torch.Generator().manual_seed(rows)
        A = torch.randn(rows, K, generator=g).bfloat16()
        W = (torch.randn(EXPERTS, N, K, generator=g) * 0.05).bfloat16()
        counts = [rows // 2, 0, rows - rows // 2 - rows // 8, 0]  # the last rows past offs[-1]
        offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        results = []
        for fn in (gemm, compiled):
            a, w = A.clone().requires_grad_(), W.clone().requires_grad_()
            out = fn(a, w.transpose(-2, -1), offs)
            out.backward(torch.ones_like(out))
            results.append((out, a.grad, w.grad))
        for eager, graph in zip(*results):
            assert torch.equal(eager, graph), rows
        if rows == 0:
            assert_zero(results[1][0], results[1][1], results[1][2].transpose(-2, -1), 0)
    # Compiled graphs kept for gemm (dynamo may trace a frame twice before keeping one).
    graphs = _debug_get_cache_entry_list(gemm.__code__)
    assert len(graphs) == 2, len(graphs)
