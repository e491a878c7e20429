"""The one running mean the router learns its ratios with.

Two estimates learn a ratio from the engines' answers, over all answers and
per prefix: characters per token (:class:`~prefixrouter.core.hashing.TokenEstimator`,
text mode) and the share of ``max_tokens`` an answer decodes
(:class:`~prefixrouter.core.output.OutputEstimate`). Both want the same
behaviour from a new observation, so both fold it in here:

* the first observation **replaces** the prior: an engine's figure beats a
  guess, and a prior crept from by a small step per request under-values
  every early decision (a repeated 47,500-token document was predicted
  38,847, 39,565, ... cached tokens while the estimate crept);
* the first ``cap`` observations are an equal-weight mean (weight ``1/n``);
* later ones move it by ``1/cap`` of their difference at most: an
  exponential mean that follows drift, and one odd prompt or answer cannot
  swing every prediction.

Pure: a function of numbers, no state of its own (each caller stores the
``(mean, count)`` pair the way it needs: a slots record, or a tuple replaced
whole where another thread reads it).
"""

from __future__ import annotations


def fold(mean: float, count: int, value: float, cap: int) -> tuple[float, int]:
    """``(mean, count)`` after one more ``value``: weight ``1/(count+1)``, at least ``1/cap``.

    ``count`` is the observations folded in so far, kept at most ``cap``; with
    ``count == 0`` the value replaces ``mean`` (the prior).
    """
    n = count + 1 if count < cap else cap
    return mean + (value - mean) / n, n
