"""The one percentile definition of every figure the project reports.

**Nearest rank.** The ``q``-quantile (``0 <= q <= 1``) of ``n`` values is the
value at rank ``ceil(q * n)`` of the values sorted ascending, rank 1 being
the smallest (``q = 0`` gives the smallest). So every percentile is a value
that occurred: a TTFT some request had, never a blend of two requests. p50 of
an even count is the lower of the two middle values; p99 of fewer than 100
values is the largest. An empty sample reports 0.

Used by the simulator's reports, the live bench and demo, the load generator,
``benchmarks/`` and ``prefixrouter analyze`` (on its frequency table of
shared-prefix lengths, which holds every value with its count). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

REPORTED = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
"""The percentiles a report shows, by key."""


def rank_index(n: int, q: float) -> int:
    """The 0-based index of the ``q``-quantile among ``n`` sorted values (module doc)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    return max(0, math.ceil(q * n) - 1)


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The ``q``-quantile of values already sorted ascending (0.0 when empty)."""
    return ordered[rank_index(len(ordered), q)] if ordered else 0.0


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-quantile of ``values`` in any order (0.0 when empty)."""
    return nearest_rank(sorted(values), q)


def percentiles(values: Iterable[float], digits: int = 3) -> dict[str, float]:
    """Mean, p50, p90 and p99 of ``values``, each rounded to ``digits`` decimals.

    The mean is :func:`math.fsum` over the sorted values (the same float for
    the same multiset, whatever the input order); all zero when empty.
    """
    ordered = sorted(values)
    if not ordered:
        return {"mean": 0.0, **{key: 0.0 for key, _ in REPORTED}}
    out = {"mean": round(math.fsum(ordered) / len(ordered), digits)}
    for key, q in REPORTED:
        out[key] = round(nearest_rank(ordered, q), digits)
    return out


def counted_percentile(counts: Mapping[int, int], q: float) -> int:
    """The ``q``-quantile of a frequency table (value -> how many times it occurred).

    The same nearest rank as :func:`nearest_rank`, taken over the values
    repeated by their counts, without expanding them. 0 when the table is empty.
    """
    total = sum(counts.values())
    if total <= 0:
        return 0
    index = rank_index(total, q)
    seen = 0
    for value, n in sorted(counts.items()):
        seen += n
        if seen > index:
            return value
    return max(counts)  # pragma: no cover - seen reaches total > index
