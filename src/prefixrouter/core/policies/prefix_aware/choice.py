"""What a rule returns, and the readings of candidate scores the rules share.

Every step returns a :class:`Choice` (a candidate's position and the
sentence the decision record shows). The readings here are the ones more
than one step takes: the lowest score among some candidates, a candidate's
predicted first token, whether storing the prompt evicts anything, the
score a warm worker and a cold one are compared by, how full a cache would
be, and the highest score within the warm margin of the best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.index import PrefixIndex
from prefixrouter.core.policies.prefix_aware.params import OutputClassParams
from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.types import WorkerId


@dataclass(frozen=True, slots=True)
class Choice:
    """A step's verdict: which candidate, and why.

    Attributes:
        index: The chosen candidate's position in the candidate list.
        reason: One sentence for the decision record.
        abandoned: Warm preference was given up: the warm worker's wait made it too slow.
    """

    index: int
    reason: str
    abandoned: bool = False


def argmin(scored: Sequence[CandidateScore], indices: Sequence[int]) -> int:
    """Index of the lowest score; ties go to the earliest (deterministic)."""
    best = -1
    best_score = math.inf
    for i in indices:
        s = scored[i].score
        if s < best_score:
            best, best_score = i, s
    return best


def predicted_ttft(c: CandidateScore) -> float:
    """The candidate's predicted first token (its score when it has no cost terms)."""
    return c.terms.ttft_s if c.terms is not None else c.score


def evicts_nothing(c: CandidateScore) -> bool:
    """Whether storing the prompt on the candidate evicts no cached block."""
    return c.terms is not None and c.terms.eviction_s == 0.0


def switch_score(c: CandidateScore, cls: OutputClassParams, eviction_weight: float) -> float:
    """The score that compares a warm worker with a cold one (see :func:`warm_margin_rule`)."""
    t = c.terms
    assert t is not None
    return t.ttft_s + cls.switch_decode_weight * t.decode_s + eviction_weight * t.eviction_s


def cache_pressure(index: PrefixIndex, worker: WorkerId, blocks: int) -> float:
    """How full ``worker``'s cache would be with ``blocks`` more, in [0, 1] (per the index).

    The warm margin is the price of copying a prefix into another cache: a
    worker with room takes the copy without evicting anything (no margin, so
    cold replicas warm up in parallel, as round robin would); a full one would
    evict other prefixes (the whole margin).
    """
    capacity = index.capacity(worker)
    if capacity <= 0:
        return 1.0
    return min(1.0, (index.blocks_of(worker) + blocks) / capacity)


def margin_limit(best: CandidateScore, cls: OutputClassParams, pressure: float) -> float:
    """The highest score that counts as within the margin of ``best``.

    The relative part of the margin applies to the best candidate's
    predicted TTFT, not its whole score, so weighing decode time does not
    widen it; ``pressure`` in [0, 1] scales the whole margin.
    """
    return best.score + pressure * (
        predicted_ttft(best) * cls.warm_margin_rel + cls.warm_margin_abs_s
    )
