"""The token bucket: a rate with a burst, one token at a time or a piece of work into debt."""

from __future__ import annotations

import pytest

from prefixrouter.core.bucket import TokenBucket


def test_take_refuses_when_empty_and_says_when_the_next_token_comes() -> None:
    b = TokenBucket(rate=2.0, capacity=2)
    assert b.take(0.0) == 0.0 and b.take(0.0) == 0.0
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0


def test_spend_goes_into_debt_once_then_waits_until_it_is_repaid() -> None:
    b = TokenBucket(rate=0.5, capacity=1.0)  # half a second of work per second
    assert b.spend(0.0, 3.0)  # larger than the burst: allowed, 2 s into debt
    assert b.tokens == pytest.approx(-2.0)
    assert not b.spend(3.9, 0.1)  # 1.95 repaid of 2
    assert b.tokens == pytest.approx(-0.05)  # a refusal takes nothing
    assert b.spend(4.1, 0.1)
    # Over a long span the work spent is the burst plus the rate, plus one piece.
    b = TokenBucket(rate=0.5, capacity=1.0)
    spent = sum(0.7 for t in range(100) if b.spend(t / 10, 0.7))
    assert spent <= 1.0 + 0.5 * 9.9 + 0.7


def test_a_bucket_needs_a_positive_rate_and_capacity() -> None:
    with pytest.raises(ValueError, match="rate > 0 and capacity > 0"):
        TokenBucket(rate=0.0, capacity=1.0)
    with pytest.raises(ValueError, match="rate > 0 and capacity > 0"):
        TokenBucket(rate=1.0, capacity=0.0)
