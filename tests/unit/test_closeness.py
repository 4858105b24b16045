"""The tests' closeness checks (tests/support/closeness.py, titan_primus.sqnr): NaN and inf never pass."""

import math

import pytest
import torch
from support.closeness import assert_bitwise, assert_losses_within, assert_sqnr_at_least, fraction_beyond

import titan_primus as tp

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("bad", NON_FINITE)
def test_sqnr_of_a_non_finite_tensor_is_minus_inf_on_either_side(bad):
    good = torch.ones(8)
    spoiled = good.clone()
    spoiled[3] = bad
    assert tp.sqnr(good, spoiled) == -math.inf and tp.sqnr(spoiled, good) == -math.inf
    assert tp.sqnr(spoiled, spoiled) == -math.inf  # equal, and still no pass
    with pytest.raises(AssertionError, match="NaN or inf"):
        assert_sqnr_at_least(spoiled, good, 0.0)


@pytest.mark.parametrize("bad", NON_FINITE)
def test_bitwise_equal_non_finite_tensors_do_not_pass(bad):
    spoiled = torch.ones(8)
    spoiled[0] = bad
    with pytest.raises(AssertionError, match="NaN or inf"):
        assert_bitwise(spoiled, spoiled.clone())


@pytest.mark.parametrize("bad", NON_FINITE)
def test_a_non_finite_loss_is_never_within_a_bound(bad):
    assert assert_losses_within({1: 8.0, 2: 7.0}, {1: 8.0, 2: 7.007}, 0.001) == pytest.approx(0.001, rel=1e-3)
    for actual, expected in (({1: 8.0, 2: bad}, {1: 8.0, 2: 7.0}), ({1: 8.0, 2: 7.0}, {1: 8.0, 2: bad})):
        with pytest.raises(AssertionError, match="not finite"):
            assert_losses_within(actual, expected, 1.0)
    with pytest.raises(AssertionError, match="steps"):
        assert_losses_within({1: 8.0}, {1: 8.0, 2: 7.0}, 1.0)


def test_a_non_finite_difference_counts_as_beyond_the_bound():
    diff = torch.tensor([0.0, math.nan, math.inf, 0.5])
    assert fraction_beyond(diff, torch.ones(4)) == 0.5
