"""The 0.2 adapter computes what the 0.3 path computes on the same weights and inputs, on the
emulation under both recipe definitions (tests/integrations/torchtitan/v0_2/adapter_numerics.py says how, and why bitwise)."""

import pytest
from adapter_numerics import CASES, TOKENS_PER_EXPERT, fp8_experts_match_the_shared_op, fp8_linear_matches_the_shared_op


@pytest.mark.parametrize("backend, device, recipe", CASES)
def test_fp8_linear_matches_the_shared_op(backend, device, recipe):
    fp8_linear_matches_the_shared_op(backend, device, recipe)


@pytest.mark.parametrize("tokens", TOKENS_PER_EXPERT)
@pytest.mark.parametrize("pad_token_groups", [False, True], ids=["ragged", "padded"])
@pytest.mark.parametrize("backend, device, recipe", CASES)
def test_fp8_experts_match_the_shared_op(backend, device, recipe, pad_token_groups, tokens):
    fp8_experts_match_the_shared_op(backend, device, recipe, pad_token_groups, tokens)
