"""The running mean both learned ratios use (characters per token, output fill)."""

from __future__ import annotations

import pytest

from prefixrouter.core.hashing import TokenEstimator
from prefixrouter.core.output import OutputEstimate
from prefixrouter.core.running_mean import fold


def test_first_value_replaces_the_prior() -> None:
    assert fold(4.0, 0, 3.0, 10) == (3.0, 1)


def test_equal_weights_up_to_the_cap_then_one_over_cap() -> None:
    mean, count = 100.0, 0
    for v in (1.0, 2.0, 3.0, 6.0):
        mean, count = fold(mean, count, v, 4)
    assert mean == pytest.approx(3.0) and count == 4  # the plain mean of four
    mean, count = fold(mean, count, 7.0, 4)
    assert mean == pytest.approx(4.0) and count == 4  # moved by a quarter of 4.0


def test_both_estimates_follow_the_same_rule() -> None:
    samples = [0.5, 0.25, 1.0, 0.75, 0.5, 0.1]
    est = TokenEstimator(chars_per_token=4.0, alpha=0.25)
    out = OutputEstimate(window=4)
    mean, count = 0.0, 0
    for s in samples:
        est.observe(round(s * 1000), 1000)
        out.observe(1000, round(s * 1000), "p")
        mean, count = fold(mean, count, s, 4)
    assert est.chars_per_token == pytest.approx(mean)
    assert out.expected(1000, "p") == round(1000 * mean)
