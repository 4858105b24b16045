"""A rank whose experts receive no token, on Primus-Turbo's own code (its Python, its Triton
grouped kernels under the interpreter): zero output and gradients with no row in a group, and
without rows no quantizer and no kernel called (what its HIP kernels would do with 0 elements is
not known, so none is asked). The emulation's cases: tests/unit/test_empty_experts.py."""

import pytest
from support.empty_experts import ALLOCATION_OPS, assert_zero, no_token_step

import titan_primus as tp
from real_turbo.conftest import ARCH, RECIPES
from titan_primus.ops import run_grouped_mm


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("rows", [0, 48], ids=["no rows", "every row past offs[-1]"])
def test_grouped_gemm_of_a_rank_without_tokens_is_zero_on_primus_turbo(recipe, rows):
    made = tp.make_recipe(recipe, "primus_turbo", tp.device_profile(ARCH))
    turbo = tp.registry.get_backend("primus_turbo")
    out, grad_A, grad_B_t, ops = no_token_step(lambda a, b, o: run_grouped_mm(turbo, a, b, o, made), rows)
    assert_zero(out, grad_A, grad_B_t, rows)
    if rows == 0:
        assert ops <= ALLOCATION_OPS, ops - ALLOCATION_OPS
    else:  # its own kernels ran, on the zeroed rows
        assert {str(op) for op in turbo.fp8_gemm_ops()} & ops
