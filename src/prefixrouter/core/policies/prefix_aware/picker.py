"""Step 3, the picker: the best of the warm workers holding the deepest prefix.

Scores within the tie band of the lowest count as equal
(:func:`tie_band_picker`, the band from the workers' calibration,
:func:`calibration_band`); among those the fewest in flight wins, or for
one-off traffic the least recently sent of those whose first token is
within an engine step of the earliest (:func:`one_off_pick`). A router
replica draws two of them by its salt (the rendezvous hash here) so
replicas sharing a stale view do not all pick the same worker.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

import xxhash

from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.types import WorkerId, WorkerView


def deepest_holders(scored: Sequence[CandidateScore], warm: Sequence[int]) -> tuple[int, list[int]]:
    """The deepest prefix any of ``warm`` holds (tokens), and those of them holding it.

    The picker picks among these: leaving them for anyone else (cold, or
    holding a shorter prefix) recomputes part of the prompt, which only a
    rule may decide to pay for.
    """
    deepest = max([scored[i].matched_tokens for i in warm])
    return deepest, [i for i in warm if scored[i].matched_tokens >= deepest]


def holder_kv_wait_rank(scored: list[CandidateScore], holders: Sequence[int]) -> bool:
    """Picker's input, between holders: a holder's score carries its head-of-line KV
    wait as finishing requests free memory, beyond the least of the holders'.

    The cost model's ``memory_risk`` (part of every score) counts the
    shortfall of free KV blocks against all blocks in use. On a worker whose
    cache holds documents pinned by their readers, finishing readers free only
    their own blocks (question and answer), so the queue waits many times
    longer than that (simulated doc-qa with bursts: 2-10 s predicted as
    0.1-1.6 s, and a holder whose KV was full took every request of a
    burst, the best-predicted each time). ``memory_risk_freed_s`` counts the
    shortfall against the blocks the running requests free
    (:class:`~prefixrouter.core.cost.CostModel`). Between holders of one
    prefix nothing is copied, so each holder's score (``scored`` is changed
    in place) gets the excess of that wait over ``memory_risk``, less the
    least excess among the holders. The least burdened holder keeps its
    score and no score falls, so the rules that weigh leaving the holders
    for a copy see the holders at worst at that holder's own prediction: a
    cold worker never gains against a holder that is not blocked (the
    better wait used for every choice made the router copy contexts under
    cache pressure, each copy evicting one asked for again:
    ``benchmarks/tried/kv_admission_own_blocks.patch``). A sole holder is
    left alone. Terms stay as the model predicted them (calibration learns
    from them).

    Returns:
        Whether any score moved (the caller's best may then be another).
    """
    if len(holders) < 2:
        return False
    excess: list[float] = []
    for i in holders:
        t = scored[i].terms
        gap = 0.0 if t is None else t.memory_risk_freed_s - t.memory_risk_s
        excess.append(gap if gap > 0.0 else 0.0)
    least = min(excess)
    moved = False
    for i, gap in zip(holders, excess, strict=True):
        if gap > least:
            c = scored[i]
            score = c.score + gap - least
            scored[i] = CandidateScore(c.worker_id, c.matched_tokens, c.confidence, c.terms, score)
            moved = True
    return moved


def tie_band_picker(
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    indices: Sequence[int],
    band: float,
    best: int,
    salt: int = 0,
    one_off: bool = False,
) -> int:
    """Picker: the best of ``indices``, where scores within a tie band of the best count as equal.

    ``best`` is the index of the lowest score among ``indices`` (:func:`argmin`;
    the cold path knows it already).

    Identical engines' predictions differ by their calibration (each learns
    its own scale from noisy observations, about 20% apart live), and a
    router that always takes the lowest prediction keeps feeding the worker
    whose scale happens to be lowest until its queue shows. The tie band
    ``band`` (relative) is how far the candidates' calibration scales
    disagree (:func:`calibration_band`, which the caller computes once and
    the rules read too); among candidates whose scores are within it of the best, the
    one with the fewest requests in flight wins, then the lowest score. With
    one candidate, or scales that agree, the lowest score wins.

    The count in flight is the right key where later requests follow this
    one (a session's first turn, a new document: the placement is kept, and
    the count spreads the sessions and documents each worker carries). A
    ``one_off`` request (``PrefixAwarePolicy._one_off``: what requests like it
    bring is rarely reused) brings nothing later, so only its own first
    token is at stake: :func:`one_off_pick` ranks its near-equal.

    ``salt`` (this request's on this router replica, :func:`_request_salt`;
    0 for one router) is for replicas that route on one view until their
    peers' routings reach them: sent to the fewest in flight, every request
    that reaches any of them within the lag goes to the same worker (stale
    load information herds; Mitzenmacher, "How useful is old information?",
    2000). With a salt the fewest in flight wins among two of the near-equal
    candidates drawn by the salt's rendezvous hash (the "power of two
    choices", which that paper shows keeps balancing on stale loads), so
    replicas, and one replica's successive requests, spread over the
    workers that count as equal. With two near-equal or fewer the salt
    changes nothing. A replica ranks by the count even for a one-off: its
    view lacks its peers' latest routings, so the count is what it knows,
    and the classic two choices rank by it. Scales that agree (no band) still leave exact ties
    (idle workers that no cache warms, as when a fleet starts): one router
    takes the earliest, a replica draws among them as above, since each
    replica taking the earliest would send a burst that reaches several
    replicas at once to one worker.
    """
    if band <= 0 and not salt:
        return best
    limit = scored[best].score * (1.0 + band)
    near = [i for i in indices if scored[i].score <= limit]
    if salt and len(near) > 2:
        # Two choices among the near-equal, drawn by the salt (see above).
        near = heapq.nlargest(2, near, key=lambda i: rendezvous(salt, scored[i].worker_id))
    elif one_off and not salt:
        return one_off_pick(scored, candidates, near)
    return min(near, key=lambda i: (candidates[i].in_flight, scored[i].score))


def one_off_pick(
    scored: Sequence[CandidateScore], candidates: Sequence[WorkerView], near: Sequence[int]
) -> int:
    """Picker's key for a one-off request's near-equal ``near`` (:func:`tie_band_picker`):
    the least recently sent of the workers whose first token cannot be told
    from the earliest, then the lowest score.

    The calibration factors of the near-equal cannot be told apart, so each
    first token is read on the profile's scale (:func:`profile_first_token`).
    A first token comes at the end of an engine step, and where in the step
    in flight a request lands is unknown: each prediction spans half a step
    either way (``CostTerms.step_s``, the step of the batch it would join).
    The workers whose span overlaps the earliest's are equal for this
    request, and among them the one the router sent a request least
    recently wins (``WorkerView.since_routed_s``). That spaces each worker's
    arrivals as round robin does: a worker's stream of requests is then more
    regular than the fleet's, and a regular stream queues less than a
    random one of the same rate, which is where round robin led the
    load-balancing scenarios (``system-prompt``, ``templates-bad``). A worker
    whose first token is past the span keeps its place behind: a question to
    a 40,000-token document on a worker decoding many of them is tens of
    milliseconds later, a real difference, and spacing there lost
    (``benchmarks/decision_quality_notes.md``). Ranked before by the lowest
    score on the profile's scale, the decode that score weighs beside the
    first token often outranked tens of milliseconds of queue.
    """
    # Each candidate's span on the profile's scale: (first token, half a step).
    spans = {i: (profile_first_token(scored[i]), _profile_step(scored[i]) / 2.0) for i in near}
    first, half = spans[min(near, key=lambda i: spans[i][0])]
    latest = first + half  # the earliest's span ends here
    same = [i for i, (f, h) in spans.items() if f - h <= latest]
    return min(same, key=lambda i: (-candidates[i].since_routed_s, scored[i].score))


def profile_first_token(candidate: CandidateScore) -> float:
    """A candidate's predicted first token without its worker's calibration factor.

    Every term is the profile's prediction times the worker's factor
    (``CostModel.predict``), so this puts candidates whose factors cannot be
    told apart (:func:`tie_band_picker`) on one scale. A candidate without
    terms (a policy that does not use the cost model) reads its score.
    """
    t = candidate.terms
    if t is None or t.scale <= 0.0:
        return candidate.score
    return t.ttft_s / t.scale


def _profile_step(candidate: CandidateScore) -> float:
    """``CostTerms.step_s`` on the profile's scale (0 without terms)."""
    t = candidate.terms
    if t is None or t.scale <= 0.0:
        return 0.0
    return t.step_s / t.scale


def calibration_band(scored: Sequence[CandidateScore], indices: Iterable[int], cap: float) -> float:
    """How far the calibration scales of ``indices`` disagree (relative), at most ``cap``.

    Two predictions closer than this cannot be told apart: each worker's
    scale is learnt from noisy first tokens (live about 20 % apart; in the
    simulator a few percent). When every scale agrees (a fleet whose
    profile is right) predictions are trusted as they are and the band is 0.
    """
    # The lowest and highest scale in one pass: this runs on every request.
    lowest, highest, scales = math.inf, -math.inf, 0
    for i in indices:
        t = scored[i].terms
        if t is not None:
            scales += 1
            s = t.scale
            if s < lowest:
                lowest = s
            if s > highest:
                highest = s
    if scales < 2 or lowest <= 0:
        return 0.0
    return max(0.0, min(cap, highest / lowest - 1.0))


def rendezvous(block: int, worker: WorkerId) -> int:
    """Highest-random-weight score of (prefix, worker): stable across processes."""
    return int(xxhash.xxh3_64_intdigest(worker.encode("utf-8"), block & 0xFFFF_FFFF_FFFF_FFFF))
