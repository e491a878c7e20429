"""The one reader of Prometheus text exposition (what an engine's ``GET /metrics`` answers).

Parsing is prometheus_client's own text parser (escapes, label quoting,
``_total``/``_bucket`` samples, comments), so what the gateway's pollers, the
bench's engine counters and the harness's idle check read is what a
Prometheus server would read. This module only gives it one shape:

* :func:`samples`: every sample, in page order, as ``(name, labels, value)``
  (a counter's sample keeps its ``_total`` suffix, a histogram's its
  ``_bucket``/``_sum``/``_count``);
* :func:`families`: each metric family the page declares, with its type
  (``counter``, ``gauge``, ``histogram``, ...), samples or not: what a
  page exports, even before its first observation;
* :func:`totals`: named samples summed over their label sets (an engine's
  series per model or per engine, a fleet's pages), the shape a reader of
  counters and gauges wants;
* :func:`histogram` and :func:`histogram_quantile`: a histogram's cumulative
  buckets and a quantile of them (or of two scrapes' difference), as
  Prometheus's ``histogram_quantile`` computes it.

Pure: text in, numbers out (no I/O). A page that is not Prometheus text
raises :class:`ValueError` (prometheus_client's own error).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class Sample(NamedTuple):
    """One sample line: its name, its labels and its value."""

    name: str
    labels: dict[str, str]
    value: float


def samples(text: str) -> Iterator[Sample]:
    """Every sample of an exposition, in page order."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield Sample(s.name, s.labels, float(s.value))


def families(text: str) -> dict[str, str]:
    """Every metric family of an exposition: its name (a counter's without ``_total``) -> type."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def totals(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` summed over every sample of that name; a name never seen is absent.

    Absent, not 0: a reader can tell "the engine does not export it" from
    "the engine counted nothing".
    """
    wanted = frozenset(names)
    out: dict[str, float] = {}
    for s in samples(text):
        if s.name in wanted:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def histogram(text: str, name: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram ``name``, by upper bound, summed over labels.

    ``{le: count}`` with ``inf`` for the ``+Inf`` bucket; empty when the
    histogram is absent. Two scrapes' differences are the observations made
    between them.
    """
    bucket = name + "_bucket"
    out: dict[float, float] = {}
    for s in samples(text):
        if s.name == bucket and "le" in s.labels:
            le = float(s.labels["le"])
            out[le] = out.get(le, 0.0) + s.value
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The ``q``-quantile of cumulative ``buckets``, interpolated linearly within a bucket.

    As Prometheus's ``histogram_quantile``: the bucket where the cumulative
    count first reaches ``q`` of the total, with the observations spread
    evenly between its bounds (from 0 for the first bucket); the highest
    finite bound when the rank falls in ``+Inf``; 0.0 without observations.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower
