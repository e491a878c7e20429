"""The one percentile definition: nearest rank, a value that occurred."""

from __future__ import annotations

import random

import pytest

from prefixrouter.stats import counted_percentile, nearest_rank, percentile, percentiles


def test_percentiles_are_nearest_rank() -> None:
    assert percentiles([float(v) for v in range(1, 101)]) == {
        "mean": 50.5,
        "p50": 50.0,
        "p90": 90.0,
        "p99": 99.0,
    }
    assert percentiles([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2], 0.5, 1),  # an even count: the lower middle, never their mean
        ([1, 2, 3], 0.5, 2),
        ([3, 1, 2, 4], 0.5, 2),  # any order
        (list(range(1, 11)), 0.99, 10),  # fewer than 100 values: p99 is the largest
        (list(range(1, 11)), 0.9, 9),
        (list(range(1, 11)), 0.0, 1),
        (list(range(1, 11)), 1.0, 10),
        ([7], 0.99, 7),
        ([], 0.5, 0.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_a_percentile_is_always_a_value_that_occurred() -> None:
    rng = random.Random(1)
    for n in range(1, 60):
        xs = [rng.random() for _ in range(n)]
        for q in (0.5, 0.9, 0.99):
            assert percentile(xs, q) in xs
            below = sum(x <= percentile(xs, q) for x in xs)
            assert below >= q * n  # at least a q share of the values is at or below it
            assert below - 1 < q * n or q * n == 0  # and it is the smallest such value


def test_rounding_and_sorted_input() -> None:
    assert percentiles([1.23456, 2.0], digits=2) == {
        "mean": 1.62,
        "p50": 1.23,
        "p90": 2.0,
        "p99": 2.0,
    }
    assert nearest_rank([1.0, 5.0, 9.0], 0.5) == 5.0
    with pytest.raises(ValueError, match="quantile"):
        percentile([1.0], 1.5)


def test_a_frequency_table_gives_what_its_expanded_values_give() -> None:
    rng = random.Random(2)
    for _ in range(200):
        counts = {
            rng.randrange(0, 50) * 16: rng.randrange(1, 6) for _ in range(rng.randrange(1, 9))
        }
        expanded = [v for v, n in counts.items() for _ in range(n)]
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert counted_percentile(counts, q) == percentile(expanded, q)
    assert counted_percentile({}, 0.5) == 0
