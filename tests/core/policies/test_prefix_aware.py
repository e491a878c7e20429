"""The ``prefix_aware`` policy, step by step: scorer, candidate filter, picker, rules.

Each section tests one step of :mod:`prefixrouter.core.policies.prefix_aware`:
first the step function on hand-built figures (the rule itself), then the
router on the default profile (the rule inside a real decision).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.core import (
    BlockHash,
    Decision,
    InflightLedger,
    Outcome,
    PrefixIndex,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.policies.prefix_aware import (
    Choice,
    OutputClassParams,
    PrefixAwareParams,
    PrefixAwarePolicy,
    cache_pressure,
    calibration_band,
    cold_pool_rule,
    cold_quota_filter,
    copy_room_filter,
    copy_rule,
    deepest_holders,
    holder_band_rule,
    holder_kv_wait_rank,
    hot_prefix_rule,
    idle_copy_rule,
    margin_limit,
    max_wait_rule,
    new_home_rule,
    no_room_rule,
    one_off_pick,
    profile_first_token,
    rendezvous_home,
    score_candidates,
    switch_externality,
    switch_score,
    tie_band_picker,
    warm_margin_rule,
)
from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.router import replica_salt
from tests.core.conftest import NS, hold, request, send, tokens, warm, with_loads, workers

W0, W1, W2, W3 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2"), WorkerId("w3")
SHORT = OutputClassParams(warm_margin_rel=0.25, warm_margin_abs_s=0.05, max_warm_wait_s=4.0)


def fill_cache(router: Router, worker: WorkerId, blocks: int = 2_000, now: float = 0.0) -> None:
    """Make ``worker``'s cache full of other prefixes (a copy would evict them)."""
    router.index.set_capacity(worker, blocks)
    warm(router, worker, tokens(10_000 + int(worker[1:]), blocks * 16), now)


def candidate(decision: object, worker: WorkerId) -> object:
    return next(c for c in decision.candidates if c.worker_id == worker)  # type: ignore[attr-defined]


def calibrate(router: Router, worker: WorkerId, factor: float) -> None:
    """Teach the cost model that ``worker`` runs ``factor`` times its profile."""
    for _ in range(300):
        router.cost.observe(worker, CostTerms(0.0, 1.0, 0.0, 0.0, 0.0), factor)


def scored(
    worker: str,
    ttft: float,
    *,
    queue: float = 0.0,
    decode: float = 0.0,
    eviction: float = 0.0,
    scale: float = 1.0,
    matched: int = 0,
    score: float | None = None,
    step: float = 0.0,
) -> CandidateScore:
    """A hand-built candidate: TTFT ``ttft`` of which ``queue`` is queue wait; score = TTFT;
    ``step`` its engine step (``CostTerms.step_s``)."""
    terms = CostTerms(queue, ttft - queue, 0.0, 0.0, decode, eviction, scale, step_s=step)
    return CandidateScore(WorkerId(worker), matched, 1.0, terms, ttft if score is None else score)


def never(*_: object) -> tuple[float, int]:
    raise AssertionError("demand must not be computed")


# ------------------------------------------------------ scorer: the cost terms


def test_scorer_scores_every_candidate_and_marks_the_warm_ones() -> None:
    r = Router()
    doc = tokens(1, 3_000)
    warm(r, W0, doc)  # all of the prompt: only the blocks before its last token count
    warm(r, W1, doc[:48])  # below min_match_tokens (64): not warm
    ws = workers(3)
    ctx = r.route(request("q", doc), ws, 1.0).context
    p = PrefixAwareParams()
    scores, warm_idx = score_candidates(ctx, ws, p, p.short, 128)
    assert warm_idx == [0]
    assert [s.matched_tokens for s in scores] == [2_992, 48, 0]
    for s in scores:
        t = s.terms
        assert t is not None
        assert s.score == t.ttft_s + p.short.decode_weight * t.decode_s + 0.5 * t.eviction_s
    # a cold candidate is predicted as holding nothing, whatever it matched
    assert scores[1].terms.prefill_s == scores[2].terms.prefill_s  # type: ignore[union-attr]
    assert scores[0].terms.prefill_s < scores[2].terms.prefill_s  # type: ignore[union-attr]
    strict = replace(p, min_match_tokens=4_000)
    assert score_candidates(ctx, ws, strict, p.short, 128)[1] == []


def test_scorer_charges_the_eviction_a_copy_would_cause() -> None:
    r = Router()
    ws = workers(2)
    fill_cache(r, W1, blocks=200)  # w1's cache is full of other prefixes
    ctx = r.route(request("q", tokens(1, 1_600)), ws, 1.0).context
    p = PrefixAwareParams()
    (s0, s1), _ = score_candidates(ctx, ws, p, p.short, 128)
    assert s0.terms.eviction_s == 0.0  # type: ignore[union-attr]  # room to spare
    assert s1.terms.eviction_s > 0.0  # type: ignore[union-attr]  # 100 blocks evicted
    assert s1.score > s0.score


def test_exact_hit_wins_when_loads_are_equal() -> None:
    r = Router()
    doc = tokens(1, 30_000)
    warm(r, W1, doc)
    d = r.route(request("q", doc[:30_000] + tokens(9, 100)), workers(3), 1.0)
    assert d.worker_id == W1 and d.tier == "exact"
    assert d.predicted_cached_tokens == 30_000 - 30_000 % 16


def test_partial_hit_of_24k_of_30k_beats_no_hit() -> None:
    r = Router()
    doc = tokens(1, 30_000)
    warm(r, W0, doc[:24_000])
    warm(r, W2, doc)  # the full prefix, but on a worker with a long queue
    ws = workers(3)
    ws[2] = replace(ws[2], pending_prefill_tokens=400_000)
    d = r.route(request("q", doc), ws, 1.0)
    assert d.worker_id == W0 and d.tier == "partial"
    assert d.predicted_cached_tokens == 24_000
    c0, c1 = candidate(d, W0), candidate(d, W1)
    assert c0.terms.prefill_s < c1.terms.prefill_s / 3  # type: ignore[attr-defined]


def test_savings_are_absolute_not_a_percentage() -> None:
    r = Router()
    small, big = tokens(1, 2_100), tokens(2, 100_000)
    warm(r, W0, small[:2_000])
    warm(r, W0, big[:2_000])
    ws = workers(2)
    saved = []
    for toks in (small, big):
        d = r.route(request("q", toks), ws, 1.0)
        assert d.worker_id == W0 and d.predicted_cached_tokens == 2_000
        c0, c1 = candidate(d, W0), candidate(d, W1)
        saved.append(c1.terms.prefill_s - c0.terms.prefill_s)  # type: ignore[attr-defined]
    # 2,000 of 2,100 and 2,000 of 100,000 save the same prefill time
    assert saved[0] == pytest.approx(saved[1], rel=1e-9)
    assert saved[0] > 0


def test_distrusted_affinity_is_scored_cold() -> None:
    r = Router()
    doc = tokens(1, 4_000)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=600)
    q = request("q", doc + tokens(3, 100))
    warm(r, W0, doc)
    assert r.route(q, ws, 1.0).worker_id == W0
    hashes = r.blocks_for(q).hashes
    for i in range(2):  # the engine twice reports far fewer cached tokens than predicted
        r.index.on_completed(W0, hashes, 16.0, 4_000, 0, 2.0 + i)
        warm(r, W0, doc, 2.5 + i)
    assert r.index.trust(W0, 5.0) < 0.5
    d = r.route(q, ws, 5.0)
    assert d.tier == "cold" and d.predicted_cached_tokens == 0
    assert candidate(d, W0).confidence < 0.5  # type: ignore[attr-defined]


def test_long_generations_spread_differently_from_short_answers() -> None:
    r = Router()
    doc = tokens(1, 6_000)
    warm(r, W0, doc)
    ws = workers(2)
    # the warm worker runs a big decode batch
    ws[0] = replace(ws[0], decoding=100, context_tokens=500_000, decode_tokens_remaining=50_000)
    # Answers so far used their whole max_tokens: the cap is the output (core/output.py).
    r.output.observe(2_000, 2_000, "any")
    short = r.route(request("s", doc + tokens(2, 100), max_tokens=8), ws, 1.0)
    long = r.route(request("l", doc + tokens(3, 100), max_tokens=2_000), ws, 1.0)
    assert short.worker_id == W0 and short.tier == "exact"
    assert long.worker_id == W1 and long.tier == "cold"
    # Before any answer, a cap of 2,000 is no forecast: the request is taken
    # for a chat answer (at most 512 tokens) and follows the cache.
    unknown = Router()
    warm(unknown, W0, doc)
    capped = unknown.route(request("c", doc + tokens(3, 100), max_tokens=2_000), ws, 1.0)
    assert capped.context.output_tokens == 512 and capped.worker_id == W0


def test_calibration_learns_the_observed_ratio() -> None:
    r = Router()
    calibrate(r, W0, 2.0)  # observed TTFTs twice what the profile predicts
    assert abs(r.cost.scale(W0) - 2.0) < 0.01
    d = r.route(request("c", tokens(5, 2_000)), workers(1), 1.0)
    assert candidate(d, W0).terms.scale == r.cost.scale(W0)  # type: ignore[attr-defined]


# -------------------------------------------- candidate filter: the cold quota


@pytest.mark.parametrize(
    ("in_flight", "warm_idx", "share", "expected"),
    [
        ((6, 2, 0), [0], 0.25, [1, 2]),  # w0 is at its last quarter of 8 slots
        ((5, 2, 0), [0], 0.25, [0, 1, 2]),  # 5 < 6: room everywhere
        ((6, 6, 7), [0], 0.25, [0, 1, 2]),  # no worker has room: the quota does not apply
        ((6, 2, 0), [], 0.25, [0, 1, 2]),  # no warm candidate: nothing to keep room from
        ((8, 2, 0), [0], 0.0, [0, 1, 2]),  # no quota
    ],
)
def test_cold_quota_filter_keeps_the_last_share_of_slots(
    in_flight: tuple[int, ...], warm_idx: list[int], share: float, expected: list[int]
) -> None:
    ws = [WorkerView(WorkerId(f"w{i}"), max_slots=8, in_flight=n) for i, n in enumerate(in_flight)]
    assert list(cold_quota_filter(ws, warm_idx, share)) == expected


def test_cold_quota_sends_a_hot_request_elsewhere_when_warm_workers_are_full() -> None:
    r = Router()
    doc = tokens(1, 3_000)
    warm(r, W0, doc)
    ws = [WorkerView(W0, max_slots=10, in_flight=9), WorkerView(W1, max_slots=10)]
    d = r.route(request("q", doc + tokens(2, 40)), ws, 1.0)
    assert d.worker_id == W1 and d.tier == "cold" and d.reason.startswith("cold quota")


def test_cold_quota_keeps_slots_for_unique_requests_in_a_hot_stream() -> None:
    def run(share: float) -> tuple[dict[WorkerId, int], list[int]]:
        policy = create_policy("prefix_aware", {"cold_reserved_share": share})
        r, ledger = Router(policy), InflightLedger()
        hot = tokens(1, 3_000)
        warm(r, W0, hot)
        free_slots_seen = []
        hot_per_worker: dict[WorkerId, int] = {}
        for i in range(12):
            unique = i % 3 == 2
            toks = tokens(1000 + i, 800) if unique else hot + tokens(500 + i, 40)
            ws = [
                ledger.fill(WorkerView(WorkerId(f"w{k}"), max_slots=8), float(i)) for k in range(3)
            ]
            d = r.route(request(f"r{i}", toks), ws, float(i))
            chosen = next(w for w in ws if w.worker_id == d.worker_id)
            if unique:
                free_slots_seen.append(chosen.max_slots - chosen.in_flight)
            else:
                hot_per_worker[d.worker_id] = hot_per_worker.get(d.worker_id, 0) + 1
            r.on_routed(d, float(i))
            ledger.on_routed(d.context.request.request_id, d.worker_id, 40, 3_040, 128, float(i))
        return hot_per_worker, free_slots_seen

    hot, free = run(0.25)
    assert max(hot.values()) <= 6  # hot requests left a slot in reserve on every worker
    assert all(f >= 1 for f in free)  # every unique request found a free slot
    no_quota, _ = run(0.0)
    assert no_quota[W0] > 6  # without the quota the hot stream takes the warm worker's slots


# ------------------------------ picker: the tie band among the deepest holders


def test_deepest_holders_are_the_warm_candidates_with_the_longest_prefix() -> None:
    cs = [scored("w0", 1.0, matched=320), scored("w1", 1.0, matched=640), scored("w2", 1.0)]
    cs.append(scored("w3", 1.0, matched=640))
    assert deepest_holders(cs, [0, 1, 3]) == (640, [1, 3])
    assert deepest_holders(cs, [0]) == (320, [0])


def pick(
    cs: list[CandidateScore], ws: list[WorkerView], indices: Sequence[int], cap: float,
    best: int, salt: int = 0,
) -> int:  # fmt: skip
    """The picker as the policy calls it: its band is the candidates' calibration
    disagreement, at most ``cap``."""
    return tie_band_picker(cs, ws, indices, calibration_band(cs, indices, cap), best, salt)


@pytest.mark.parametrize(
    ("scales", "band", "expected"),
    [
        ((1.0, 1.0), 0.1, 0),  # scales agree: the lowest score wins
        ((1.0, 1.08), 0.1, 1),  # 8% apart: w1 (5% slower, fewer in flight) ties and wins
        ((1.0, 1.03), 0.1, 0),  # 3% apart: the band is 3%, w1 is outside it
        ((1.0, 1.5), 0.04, 0),  # the band is capped at 4%
        ((1.0, 1.5), 0.1, 1),
    ],
)
def test_tie_band_picker_takes_the_fewest_in_flight_among_near_equal(
    scales: tuple[float, float], band: float, expected: int
) -> None:
    cs = [scored("w0", 1.0, scale=scales[0]), scored("w1", 1.05, scale=scales[1])]
    ws = [WorkerView(W0, in_flight=3), WorkerView(W1, in_flight=1)]
    assert pick(cs, ws, [0, 1], band, 0) == expected
    assert pick(cs, ws, [0], band, 0) == 0  # one candidate: itself


def test_tie_band_picker_breaks_equal_loads_by_score() -> None:
    cs = [scored("w0", 1.0), scored("w1", 1.04, scale=1.1), scored("w2", 1.02)]
    ws = workers(3, in_flight=2)
    assert pick(cs, ws, [0, 1, 2], 0.1, 0) == 0
    ws[2] = replace(ws[2], in_flight=1)
    assert pick(cs, ws, [0, 1, 2], 0.1, 0) == 2


def test_one_off_pick_takes_the_least_recently_sent_whose_first_token_is_within_a_step() -> None:
    # w1's score is the highest only because its calibration factor is: on the
    # profile's scale its first token is the earliest (0.945 s).
    cs = [
        scored("w0", 1.0, step=0.1),
        scored("w1", 1.04, scale=1.1, step=0.11),
        scored("w2", 1.02, step=0.1),
    ]
    assert [round(profile_first_token(c), 3) for c in cs] == [1.0, 0.945, 1.02]
    ws = workers(3, in_flight=2)
    ws = [replace(w, since_routed_s=t) for w, t in zip(ws, (0.3, 0.1, 0.05), strict=True)]
    ws[2] = replace(ws[2], in_flight=1)
    # Steps of 0.1 s: each first token spans 0.05 s either way, and w0's and
    # w2's spans overlap the earliest's (0.945 + 0.05): the least recently
    # sent of the three wins, w0, though w2 has fewer in flight.
    assert one_off_pick(cs, ws, [0, 1, 2]) == 0
    assert tie_band_picker(cs, ws, [0, 1, 2], 0.1, 0, one_off=True) == 0
    assert pick(cs, ws, [0, 1, 2], 0.1, 0) == 2  # not one-off: the fewest in flight
    # Steps of 20 ms: w0 (55 ms later) and w2 are told apart from w1, which wins.
    short = [replace(c, terms=replace(c.terms, step_s=0.02)) for c in cs if c.terms is not None]
    assert one_off_pick(short, ws, [0, 1, 2]) == 1
    # Sent as recently: the lowest score.
    same = [replace(w, since_routed_s=0.2) for w in ws]
    assert one_off_pick(cs, same, [0, 1, 2]) == 0
    # Never sent a request (infinite) is the least recently sent.
    ws[2] = replace(ws[2], since_routed_s=math.inf)
    assert one_off_pick(cs, ws, [0, 1, 2]) == 2
    # A replica keeps the count: w0 and w1 have two in flight each, so the
    # lower score wins (w0), whatever was sent when.
    assert tie_band_picker(cs, ws, [0, 1], 0.1, 0, 7, one_off=True) == 0


def test_a_first_token_on_the_profiles_scale_is_its_terms_without_the_factor() -> None:
    c = scored("w0", 0.25, decode=1.5, scale=1.25, score=0.25 + 0.2 * 1.5)
    assert profile_first_token(c) == pytest.approx(0.25 / 1.25)
    # Without terms (a policy that does not use the cost model) the score stands in.
    assert profile_first_token(CandidateScore(W0, score=0.7)) == 0.7


def _near_equal_pair_after(
    history: Sequence[tuple[str, array[int], WorkerId]],
    *,
    refused: frozenset[str] = frozenset(),
    **params: object,
) -> WorkerId:
    """Where a new question under a shared system prompt goes after ``history``.

    Two workers hold the system prompt; w0's calibration is 8 % below w1's,
    so their scores are near-equal. w0 has 1 request in flight, 100 tokens
    queued and was sent it 10 ms ago; w1 has 3 in flight and was sent one a
    second ago: the fewest in flight is w0; the one-off key's is w1 (its
    first token the earlier on the profile's scale, and the less recently
    sent). ``refused``: the ids of the requests of ``history`` that the
    engine refused.
    """
    r = Router(create_policy("prefix_aware", params))
    calibrate(r, W0, 0.92)
    calibrate(r, W1, 1.0)
    for w in (W0, W1):
        hold(r, w, SYSTEM_PROMPT)
    ws = workers(2)
    for k, (rid, toks, to) in enumerate(history):
        sent = send(r, request(rid, toks), ws, to, float(k))
        if rid in refused:
            r.on_rejected(sent, float(k))
    ws[0] = replace(ws[0], in_flight=1, pending_prefill_tokens=100, since_routed_s=0.01)
    ws[1] = replace(ws[1], in_flight=3, since_routed_s=1.0)
    probe = r.route(request("probe", SYSTEM_PROMPT + tokens(999, 64)), ws, 50.0)
    return probe.worker_id


SYSTEM_PROMPT = tokens(1, 1_600)


def test_one_off_questions_go_by_when_last_sent_session_starts_by_requests_in_flight() -> None:
    questions = [(f"q{i}", SYSTEM_PROMPT + tokens(100 + i, 64), [W0, W1][i % 2]) for i in range(10)]
    sessions = []
    for i in range(10):
        first = SYSTEM_PROMPT + tokens(100 + i, 64)
        sessions.append((f"s{i}", first, [W0, W1][i % 2]))
        sessions.append((f"s{i}-2", first + tokens(300 + i, 64), [W0, W1][i % 2]))
    # Nobody comes back to a one-off question: only its own first token is at
    # stake, and w1's comes sooner.
    assert _near_equal_pair_after(questions) == W1
    # Every session's first turn was followed by a second: where a first turn
    # goes, the rest follows, so the count in flight spreads them.
    assert _near_equal_pair_after(sessions) == W0
    # Nothing seen yet: the count in flight, as before the policy learned anything.
    assert _near_equal_pair_after([]) == W0
    # Questions the engine refused were never prefilled: they teach nothing.
    # Three-turn sessions (20 of 30 turns' new content reused), then twelve
    # refused one-off questions: counted, they would make the head one-off.
    three_turns = []
    for i in range(10):
        turn = SYSTEM_PROMPT + tokens(100 + i, 64)
        for t in range(3):
            three_turns.append((f"s{i}-{t}", turn, [W0, W1][i % 2]))
            turn = turn + tokens(300 + 10 * i + t, 64)
    refused = [(f"r{i}", SYSTEM_PROMPT + tokens(700 + i, 64), W0) for i in range(12)]
    ids = frozenset(rid for rid, _, _ in refused)
    assert _near_equal_pair_after(three_turns) == W0
    assert _near_equal_pair_after([*three_turns, *refused], refused=ids) == W0
    assert _near_equal_pair_after([*three_turns, *refused]) == W1  # not refused: one-off
    # With the share at 0 every request is ranked by the count.
    assert _near_equal_pair_after(questions, one_off_reuse_share=0.0) == W0


def test_a_replica_names_the_count_it_ranked_a_one_offs_near_equal_by() -> None:
    # Unique prompts nobody comes back to make every cold request one-off;
    # one router then ranks the near-equal by their first tokens, a replica
    # by the fewer in flight of two drawn, and its reason must say so.
    r = Router(replica_salt=replica_salt("r1"))
    for w, factor in ((W0, 0.95), (W1, 0.97), (W2, 0.99), (W3, 1.0)):
        calibrate(r, w, factor)
    ws = workers(4)
    for i in range(6):
        send(r, request(f"u{i}", tokens(900 + i, 256)), ws, [W0, W1, W2, W3][i % 4], float(i))
    ws = [replace(w, in_flight=n) for w, n in zip(ws, (3, 1, 2, 0), strict=True)]
    reasons = {r.route(request(f"p{i}", tokens(800 + i, 256)), ws, 10.0).reason for i in range(12)}
    drawn = {x for x in reasons if "among near-equal" in x}
    assert drawn == {"no reusable prefix anywhere: fewest in flight among near-equal"}


def test_tie_band_picker_with_a_salt_takes_the_fewer_in_flight_of_two_drawn() -> None:
    cs = [scored(f"w{i}", 1.0 + i / 100, scale=1.0 + i / 20) for i in range(4)]
    ws = workers(4, in_flight=2)
    ws[3] = replace(ws[3], in_flight=0)
    picks = {pick(cs, ws, range(4), 0.1, 0, salt) for salt in range(1, 65)}
    # A draw holding w3 (the fewest in flight) takes it, any other the lower
    # score of the two drawn: w0 or w1 (w2 loses every pair).
    assert picks == {0, 1, 3}
    assert pick(cs, ws, range(4), 0.1, 0) == 3  # no salt: the fewest in flight
    # Two near-equal or fewer: the salt changes nothing.
    assert {pick(cs, ws, [0, 1], 0.1, 0, salt) for salt in range(1, 65)} == {0}
    # Outside the band the salt changes nothing either.
    far = [scored("w0", 1.0, scale=1.05), *(scored(f"w{i}", 2.0) for i in (1, 2, 3))]
    assert {pick(far, ws, range(4), 0.1, 0, salt) for salt in range(1, 65)} == {0}


def test_tie_band_picker_with_a_salt_spreads_exact_ties_when_scales_agree() -> None:
    # An idle fleet whose calibrations agree: no band, every worker scores the same.
    cs = [scored(f"w{i}", 1.0) for i in range(8)]
    ws = workers(8)
    assert pick(cs, ws, range(8), 0.1, 0) == 0  # one router: the earliest
    picks = [pick(cs, ws, range(8), 0.1, 0, salt) for salt in range(1, 65)]
    assert len(set(picks)) >= 6  # replicas draw over the tied workers
    # A worker that is better, however little, is not a tie: every replica takes it.
    cs[5] = scored("w5", 0.999)
    assert {pick(cs, ws, range(8), 0.1, 5, salt) for salt in range(1, 65)} == {5}


def test_replicas_with_one_stale_view_spread_requests_one_router_does_not() -> None:
    # Four near-equal workers (calibrations 2% apart: the tie band), the same
    # view on every replica: nothing routed reaches the others within the lag.
    def replica(salt: int) -> Router:
        r = Router(replica_salt=salt)
        for i, w in enumerate(workers(4)):
            calibrate(r, w.worker_id, 1.0 + i / 50)
        return r

    ws = workers(4, in_flight=1)
    one = replica(0)
    plain = Router()
    for i, w in enumerate(workers(4)):
        calibrate(plain, w.worker_id, 1.0 + i / 50)
    reqs = [request(f"q{k}", tokens(100 + k, 512)) for k in range(16)]

    # One router (salt 0) is today's order: every request to the same worker.
    def verdict(d: Decision) -> tuple[str, str, str]:
        return d.worker_id, d.tier, d.reason

    alone = [verdict(one.route(q, ws, 1.0)) for q in reqs]
    assert alone == [verdict(plain.route(q, ws, 1.0)) for q in reqs]
    assert {w for w, _, _ in alone} == {W0}
    # Sixteen replicas, one request each, on that same view: spread.
    spread = [replica(k + 1).route(q, ws, 1.0).worker_id for k, q in enumerate(reqs)]
    # (Equal loads: the lower score of the two drawn, so w0 wins the draws
    # that hold it, half of them.)
    assert len(set(spread)) >= 3
    assert spread.count(W0) <= 3 * len(spread) // 4
    # A replica's draw is its own: two replicas split one request differently.
    q = reqs[0]
    assert len({replica(s).route(q, ws, 1.0).worker_id for s in range(1, 9)}) >= 2


def test_an_idle_restarted_worker_gets_the_next_unique_requests() -> None:
    # Three idle engines; w1 restarted, then the others kept learning and
    # drifted 3-6 % below the factor it was given. At a load that leaves
    # nothing in flight, unique prompts went to the lowest calibration (w0)
    # until its queue showed; an engine that has shown nothing must get the
    # next one; once observed, its own factor decides.
    r = Router()
    for w, factor in ((W0, 0.96), (W1, 1.0), (W2, 0.98)):
        calibrate(r, w, factor)
    r.worker_restarted(W1, 1.0)
    calibrate(r, W0, 0.94)
    calibrate(r, W2, 0.95)
    ws = workers(3)
    first = r.route(request("u0", tokens(500, 256)), ws, 2.0)
    assert first.worker_id == W1
    # Once observed, its own factor decides: 4 % slower, the others get them.
    calibrate(r, W1, 1.04)
    later = r.route(request("u1", tokens(501, 256)), ws, 3.0)
    assert later.worker_id == W0


def test_replica_salt_of_an_id_is_stable_distinct_and_zero_for_none() -> None:
    assert replica_salt("") == 0
    assert replica_salt("gw-a") == replica_salt("gw-a") != replica_salt("gw-b")
    assert replica_salt("gw-a") != 0


def test_unseen_prefixes_spread_by_requests_in_flight_within_the_margin() -> None:
    r = Router()
    calibrate(r, W0, 0.92)  # identical engines whose calibrations disagree by ~9%
    calibrate(r, W1, 1.0)
    ws = workers(2)
    # w0 already has three requests that have not started, but its optimistic
    # calibration predicts it faster. A burst of unique prompts should still
    # not pile onto w0.
    ws[0] = replace(ws[0], in_flight=3)
    near = r.route(request("u1", tokens(900, 2_000)), ws, 1.0)
    w0, w1 = candidate(near, W0), candidate(near, W1)
    assert w0.score < w1.score  # type: ignore[attr-defined]
    assert near.worker_id == W1 and near.tier == "cold" and "fewest in flight" in near.reason
    # With calibrations that agree, predictions are trusted as they are: w0
    # queues three requests, w1 decodes some that are not ours, w0 predicts
    # faster and gets it.
    ws[1] = replace(ws[1], decoding=4, context_tokens=40_000)
    agreed = Router().route(request("u2", tokens(901, 2_000)), ws, 1.0)
    assert candidate(agreed, W0).score < candidate(agreed, W1).score  # type: ignore[attr-defined]
    assert agreed.worker_id == W0
    # Far outside the margin, the prediction still decides.
    ws[1] = replace(ws[1], pending_prefill_tokens=200_000)
    far = r.route(request("u2", tokens(901, 2_000)), ws, 1.0)
    assert far.worker_id == W0


def test_workers_holding_the_prefix_share_it_by_requests_in_flight() -> None:
    r = Router()
    calibrate(r, W0, 0.92)
    calibrate(r, W1, 1.0)
    prompt = tokens(1, 3_000)
    ws = workers(2)
    for w in (W0, W1):
        hold(r, w, prompt)
    # Both hold the system prompt; w0's optimistic calibration predicts it
    # faster although three of our requests already wait there.
    ws[0] = replace(ws[0], in_flight=3)
    d = r.route(request("s", prompt + tokens(2, 40)), ws, 1.0)
    w0, w1 = candidate(d, W0), candidate(d, W1)
    assert w0.score < w1.score  # type: ignore[attr-defined]
    assert d.worker_id == W1 and d.tier == "exact"
    # With the tie band off the lowest prediction wins.
    strict = Router(create_policy("prefix_aware", {"tie_band_rel": 0.0}))
    calibrate(strict, W0, 0.92)
    calibrate(strict, W1, 1.0)
    for w in (W0, W1):
        hold(strict, w, prompt)
    assert strict.route(request("s", prompt + tokens(2, 40)), ws, 1.0).worker_id == W0


def test_a_holder_whose_first_token_comes_later_than_the_band_loses_to_the_best_holder() -> None:
    r = Router()
    calibrate(r, W0, 0.92)  # the band: the holders' calibrations 8.7 % apart
    calibrate(r, W1, 1.0)
    prompt = tokens(1, 3_000)
    for w in (W0, W1):
        hold(r, w, prompt)
    ws = workers(2)
    # w0 decodes a long-context batch, w1 (two fewer in flight) has 300
    # tokens of prefill queued: with a 400-token answer the decode term
    # makes their scores near-equal, though w1's first token is about twice
    # as late (40 against 20 ms: within the warm margin, which kept it).
    ws[0] = replace(ws[0], in_flight=32, decoding=32, context_tokens=90_000)
    ws[1] = replace(ws[1], in_flight=30, decoding=29, pending_prefill_tokens=300)
    d = r.route(request("s", prompt + tokens(2, 40), max_tokens=400), ws, 1.0)
    w0, w1 = candidate(d, W0), candidate(d, W1)
    assert w0.score < w1.score <= w0.score * 1.087  # type: ignore[attr-defined]
    assert w1.terms.ttft_s > 1.9 * w0.terms.ttft_s  # type: ignore[attr-defined]
    # The picker's holder (fewest in flight) would copy nothing by leaving,
    # so no warm margin keeps it: the best holder takes the request.
    assert d.worker_id == W0 and d.tier == "exact"
    assert "beyond the calibration band of holder w0" in d.reason


def _memory(worker: str, score: float, risk: float, freed: float) -> CandidateScore:
    """A holder whose head-of-line KV wait reads ``risk`` on all used blocks, ``freed`` on
    the blocks finishing requests free."""
    terms = CostTerms(0.0, 0.05, 0.0, risk, 0.0, memory_risk_freed_s=freed)
    return CandidateScore(WorkerId(worker), 1_000, 1.0, terms, score)


def test_holder_kv_wait_rank_adds_each_holders_excess_wait_beyond_the_least() -> None:
    cs = [
        _memory("w0", 0.30, 0.04, 0.16),  # excess 0.12
        _memory("w1", 0.32, 0.00, 0.02),  # excess 0.02: the least
        _memory("w2", 0.31, 0.00, 0.00),  # not a holder
    ]
    assert holder_kv_wait_rank(cs, [0, 1])
    assert cs[0].score == pytest.approx(0.30 + 0.12 - 0.02)
    assert cs[1].score == 0.32 and cs[2].score == 0.31  # the least burdened holder keeps its score
    assert cs[0].terms.memory_risk_s == 0.04  # type: ignore[union-attr]  # terms as predicted
    # One holder, or holders whose waits read alike: nothing moves.
    assert not holder_kv_wait_rank(cs, [2])
    same = [_memory("w0", 0.3, 0.0, 0.1), _memory("w1", 0.4, 0.0, 0.1)]
    assert not holder_kv_wait_rank(same, [0, 1])


def _doc_on_a_full_and_a_roomy_worker(holders: Sequence[WorkerId], on: bool) -> Decision:
    """A 20,000-token document held by ``holders``; w0's KV is full of it, pinned by its
    40 readers (12 blocks each of their own), w1 has room and a longer queue."""
    r = Router(create_policy("prefix_aware", {"holder_kv_wait": on}))
    doc = tokens(1, 20_000)
    for w in holders:
        hold(r, w, doc)
    readers = {"decoding": 40, "decode_tokens_remaining": 4_000, "context_tokens": 40 * 20_100,
               "decoding_own_tokens": 40 * 12 * 16, "kv_capacity_blocks": 2_000}  # fmt: skip
    full = WorkerView(W0, in_flight=50, pending_prefill_tokens=1_000, kv_used_blocks=1_900,
                      queued_prompt_tokens=10 * 20_100, **readers)  # type: ignore[arg-type]  # fmt: skip
    roomy = WorkerView(W1, in_flight=44, pending_prefill_tokens=4_000, kv_used_blocks=1_300,
                       queued_prompt_tokens=4 * 20_100, **readers)  # type: ignore[arg-type]  # fmt: skip
    return r.route(request("q", doc + tokens(2, 100), max_tokens=100), [full, roomy], 1.0)


def test_between_holders_a_full_kv_waits_for_what_finishing_readers_free() -> None:
    # All used blocks as the base read w0's wait for memory as 41 ms; its 40
    # readers free only their own 480 blocks as they end (the document
    # stays pinned), which reads it as 163 ms: w1's longer queue is sooner.
    d = _doc_on_a_full_and_a_roomy_worker([W0, W1], on=True)
    w0 = candidate(d, W0)
    assert w0.terms.memory_risk_freed_s > 3 * w0.terms.memory_risk_s  # type: ignore[attr-defined]
    assert d.worker_id == W1 and d.tier == "exact"
    assert _doc_on_a_full_and_a_roomy_worker([W0, W1], on=False).worker_id == W0
    # A sole holder is judged against the cold worker as before: leaving it
    # would copy the document (each copy evicting one asked for again).
    scores = []
    for on in (True, False):
        alone = _doc_on_a_full_and_a_roomy_worker([W0], on=on)
        assert alone.worker_id == W0
        scores.append(candidate(alone, W0).score)  # type: ignore[attr-defined]
    assert scores[0] == scores[1]


@pytest.mark.parametrize(
    ("picked_ttft", "band", "kept"),
    [
        (0.0495, 0.1, True),  # 0.0495 <= 0.045 * 1.1
        (0.0500, 0.1, False),
        (0.0450, 0.0, True),  # no band: no later than the best
        (0.0451, 0.0, False),
    ],
)
def test_holder_band_rule_keeps_the_picked_holder_within_the_band(
    picked_ttft: float, band: float, kept: bool
) -> None:
    cs = [scored("w0", picked_ttft, decode=1.0), scored("w1", 0.045, decode=2.0)]
    choice = holder_band_rule(cs, 0, 1, SHORT, band, 0.5)
    assert choice.index == (0 if kept else 1) and not choice.abandoned
    assert ("the picker's holder within the band" in choice.reason) is kept


def test_calibration_band_is_the_scales_disagreement_capped() -> None:
    cs = [scored("w0", 1.0, scale=0.9), scored("w1", 1.0, scale=1.0), scored("w2", 1.0, scale=1.5)]
    assert calibration_band(cs, [0, 1], 0.2) == pytest.approx(1.0 / 0.9 - 1.0)
    assert calibration_band(cs, [0, 1, 2], 0.2) == 0.2  # capped
    assert calibration_band(cs, [1], 0.2) == 0.0  # one scale: nothing to disagree
    agree = [scored("w0", 1.0), scored("w1", 2.0)]
    assert calibration_band(agree, [0, 1], 0.2) == 0.0


# ---------------------------------------------------------- rule 1: hot prefix


def test_hot_prefix_rule_warms_the_best_other_worker_when_demand_needs_it() -> None:
    cs = [scored("w0", 2.0), scored("w1", 1.5, queue=1.0), scored("w2", 1.2, queue=0.5)]
    demand = lambda: (40.0, 2)  # noqa: E731
    choice = hot_prefix_rule(cs, [0, 1, 2], [0], True, SHORT, demand)
    assert choice is not None and choice.index == 2 and not choice.abandoned
    assert choice.reason == "hot prefix: 40.0 req/s needs 2 replicas, 1 hold it; warming w2"
    assert hot_prefix_rule(cs, [0, 1, 2], [0, 2], True, SHORT, demand) is None  # 2 hold it
    assert hot_prefix_rule(cs, [0, 1, 2], [0], True, SHORT, lambda: (0.1, 1)) is None


def test_hot_prefix_rule_waits_for_a_settled_copy_and_a_free_other_worker() -> None:
    cs = [scored("w0", 2.0), scored("w1", 6.0, queue=5.0)]
    # only speculatively held: no demand read
    assert hot_prefix_rule(cs, [0, 1], [0], False, SHORT, never) is None
    # the other worker queues past the maximum wait (4 s): no demand read
    assert hot_prefix_rule(cs, [0, 1], [0], True, SHORT, never) is None
    # nobody else is eligible (the cold quota left only the holder)
    assert hot_prefix_rule(cs, [0], [0], True, SHORT, never) is None


def test_hot_prefix_warms_a_second_replica() -> None:
    doc = tokens(1, 8_000)

    def route_under_demand(
        requests_per_s: float,
        settled: bool = True,
        first_token: bool = False,
        proactive: bool = False,
        queued_on_holder: int = 9_000,
    ) -> Decision:
        # The rule's own verdict: the request itself goes to the new replica
        # (proactive copy off; with it on, the router sends the copy instead).
        r = Router(create_policy("prefix_aware", {"proactive_copy": proactive}))
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], pending_prefill_tokens=queued_on_holder)  # warm, but queued
        # a stream of this prefix at the given rate feeds the demand estimate
        for i in range(300):
            t = i / requests_per_s
            d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), ws, t)
            r.policy.on_routed(d.context, W0)
            if first_token and i == 0:
                r.on_first_token(replace(d, worker_id=W0), t)  # its prefill is done on w0
        now = 300 / requests_per_s
        if settled:
            hold(r, W0, doc, now)  # the engine has it (first copy prefilled)
        else:
            warm(r, W0, doc, now)  # only routed there: its first prefill may be running
        fill_cache(r, W1, 20_000, now)  # and w1 busy with other prefixes
        return r.route(request("x", doc + tokens(7, 50)), ws, now)

    calm, hot = route_under_demand(0.2), route_under_demand(50.0)
    assert calm.worker_id == W0 and "hot prefix" not in calm.reason
    assert hot.worker_id == W1 and "hot prefix" in hot.reason
    # The same demand while the only copy is still unconfirmed: no second copy yet.
    early = route_under_demand(50.0, settled=False)
    assert early.worker_id == W0 and "hot prefix" not in early.reason
    # Still unconfirmed in the index (the answer is decoding), but a first
    # token came from w0: the first copy is prefilled, so the second is warmed.
    prefilled = route_under_demand(50.0, settled=False, first_token=True)
    assert prefilled.worker_id == W1 and "hot prefix" in prefilled.reason
    # Proactive copy: the request stays warm (its first token sooner on the
    # holder's shorter queue), the copy is the router's.
    copied = route_under_demand(50.0, proactive=True, queued_on_holder=6_000)
    assert copied.worker_id == W0 and copied.warm_up == W1
    assert "warming w1 with a prefill-only copy" in copied.reason
    # A longer queue on the holder: the request's first token comes no later
    # on the copy, cold prefill included, so it warms the copy itself (rule 5)
    # and the router sends no copy of its own, though its score is higher
    # there (w1's long contexts decode slower): the rule compares first tokens.
    queued = route_under_demand(50.0, proactive=True)
    ttft = {c.worker_id: c.terms.ttft_s for c in queued.candidates if c.terms is not None}
    score = {c.worker_id: c.score for c in queued.candidates}
    assert ttft[W1] <= ttft[W0] and score[W1] > score[W0]
    assert queued.worker_id == W1 and queued.warm_up is None and "hot prefix" in queued.reason
    assert Router().policy.params.proactive_copy  # the default (decision_quality_notes.md)


def _hot_copy_route(
    *, suffix_tokens: int = 50, pending_on_holder: int = 6_000, pending_on_target: int = 0
) -> Decision:
    """An 8,000-token document asked 50 times a second, held (settled) only on
    w0, whose queue holds ``pending_on_holder`` tokens; w1 busy with other
    prefixes and ``pending_on_target`` tokens of prefill. The next request's
    decision, proactive copies on."""
    doc = tokens(1, 8_000)
    r = Router(create_policy("prefix_aware", {"proactive_copy": True}))
    warm(r, W0, doc)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=pending_on_holder)
    for i in range(300):
        t = i / 50.0  # 50 requests a second: hot
        d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), ws, t)
        r.policy.on_routed(d.context, W0)
    hold(r, W0, doc, 6.0)
    fill_cache(r, W1, 20_000, 6.0)
    ws[1] = replace(ws[1], pending_prefill_tokens=pending_on_target)
    return r.route(request("x", doc + tokens(7, suffix_tokens)), ws, 6.0)


def test_no_prefill_only_copy_of_a_prefix_that_is_a_small_part_of_the_prompt() -> None:
    """A copy is the request's whole prompt with max_tokens 1: for a hot prefix
    that is under ``copy_min_prefix_share`` of the prompt, most of the copy
    would be this request's own text. The request then makes the copy itself,
    as with proactive copies off."""
    short = _hot_copy_route(suffix_tokens=50)  # the prefix is nearly all of the prompt
    assert short.worker_id == W0 and short.warm_up == W1  # the router copies it
    long = _hot_copy_route(suffix_tokens=12_000)  # 8,000 of 20,000 tokens: the request goes
    assert long.warm_up is None
    assert long.worker_id == W1 and "hot prefix" in long.reason


def test_no_prefill_only_copy_into_a_worker_with_a_prefill_pending() -> None:
    """A chunked-prefill engine prefills every admitted request's chunk in one
    step and each first token comes at its end: a copy sent to a worker with a
    user's prefill pending would delay that user's first token by the copy's
    prefill. The router then sends no copy; a later request asks again."""
    idle = _hot_copy_route(pending_on_holder=2_000)  # warm, a little queued
    assert idle.worker_id == W0 and idle.warm_up == W1
    # another request's 500 tokens still to prefill on w1
    busy = _hot_copy_route(pending_on_holder=2_000, pending_on_target=500)
    assert busy.worker_id == W0 and busy.warm_up is None
    assert "prefill-only copy" not in busy.reason


def test_copy_rule_lets_the_request_pay_the_copy_when_that_costs_it_nothing() -> None:
    cs = [scored("w0", 0.70, queue=0.6), scored("w1", 0.65), scored("w2", 0.9)]
    copy = Choice(1, "hot prefix: warming w1")
    kept = Choice(0, "warm within margin")
    assert copy_rule(cs, kept, copy) is copy  # sooner on the copy: the request goes
    assert copy_rule([*cs[:1], scored("w1", 0.70), cs[2]], kept, copy) is copy  # a tie too
    assert copy_rule([cs[0], scored("w1", 0.71), cs[2]], kept, copy) is kept  # later: stays
    assert copy_rule(cs, Choice(1, "lowest"), copy).reason == "lowest"  # already there


def test_copy_rule_compares_first_tokens_not_scores() -> None:
    """A score adds the answer's weighted decode (seconds) to a first token of
    tens of milliseconds: an idle copy target decodes faster, so its score can
    be lower while its cold prefill makes the first token three times later.
    The request then stays on the holder and the router's own copy warms the
    target (templates at load 0.6: four such requests were the p99)."""
    holder = scored("w0", 0.045, queue=0.01, decode=2.4, score=0.525)
    target = scored("w1", 0.150, decode=1.6, score=0.470)  # lower score, later first token
    kept = Choice(0, "the picker's holder within the band")
    copy = Choice(1, "hot prefix: warming w1")
    assert copy_rule([holder, target], kept, copy) is kept
    sooner = scored("w1", 0.045, decode=1.6, score=0.365)  # no later: it makes the copy
    assert copy_rule([holder, sooner], kept, copy) is copy


def test_copy_room_filter_keeps_workers_with_room_for_the_copy() -> None:
    ws = [
        WorkerView(W0, kv_capacity_blocks=1_000, kv_used_blocks=900),  # the holder
        WorkerView(W1, kv_capacity_blocks=1_000, kv_used_blocks=300),  # 300 + 500 <= 800
        WorkerView(W2, kv_capacity_blocks=1_000, kv_used_blocks=400),  # 400 + 500 > 800
    ]
    cs = [scored("w0", 1.0, matched=8_000), scored("w1", 2.0), scored("w2", 2.0)]
    assert copy_room_filter(ws, cs, [0, 1, 2], [0], 8_000, 0.8) == [0, 1]
    # a worker that reports no capacity is kept: nothing is known against it
    unknown = [ws[0], ws[1], WorkerView(W2)]
    assert copy_room_filter(unknown, cs, [0, 1, 2], [0], 8_000, 0.8) == [0, 1, 2]


def test_copy_room_filter_beside_holders_keeps_a_worker_less_full_than_every_holder() -> None:
    """The hot-prefix rule's reading: a copy past the share still has room when
    the worker would be less full of pinned blocks than the least full holder,
    where the request would otherwise wait for memory."""
    ws = [
        WorkerView(W0, kv_capacity_blocks=1_000, kv_used_blocks=960),  # holders: 96 %
        WorkerView(W1, kv_capacity_blocks=1_000, kv_used_blocks=980),  # and 98 % pinned
        WorkerView(W2, kv_capacity_blocks=1_000, kv_used_blocks=400),  # 900 < 960
        WorkerView(W3, kv_capacity_blocks=1_000, kv_used_blocks=460),  # 960: no less full
    ]
    cs = [scored("w0", 1.0, matched=8_000), scored("w1", 1.0, matched=8_000),
          scored("w2", 2.0), scored("w3", 2.0)]  # fmt: skip
    assert copy_room_filter(ws, cs, [0, 1, 2, 3], [0, 1], 8_000, 0.8) == [0, 1]
    beside = copy_room_filter(ws, cs, [0, 1, 2, 3], [0, 1], 8_000, 0.8, beside_holders=True)
    assert beside == [0, 1, 2]
    # Holders with room: the share alone decides, as without.
    roomy = [replace(ws[0], kv_used_blocks=500), *ws[1:]]
    kept = copy_room_filter(roomy, cs, [0, 1, 2, 3], [0, 1], 8_000, 0.8, beside_holders=True)
    assert kept == [0, 1]


def _hot_doc_on_holders_pinned_full(beside_holders: bool) -> Decision:
    """An 8,000-token document asked 50 times a second, settled on w0, whose KV
    its readers pin to 97 %; w1 is finishing another document's questions
    (1,300 of 2,000 blocks pinned: 1,800 with the copy, past the 80 % share)."""
    doc = tokens(1, 8_000)
    params = {"proactive_copy": False, "copy_room_beside_holders": beside_holders}
    r = Router(create_policy("prefix_aware", params))
    warm(r, W0, doc)
    full = WorkerView(W0, in_flight=40, decoding=38, kv_capacity_blocks=2_000,
                      kv_used_blocks=1_940, pending_prefill_tokens=9_000)  # fmt: skip
    busy = WorkerView(W1, in_flight=20, decoding=20, kv_capacity_blocks=2_000, kv_used_blocks=1_300)
    for i in range(300):
        d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), [full, busy], i / 50.0)
        r.policy.on_routed(d.context, W0)
    hold(r, W0, doc, 6.0)
    return r.route(request("x", doc + tokens(7, 50)), [full, busy], 6.0)


def test_hot_prefix_warms_a_worker_less_full_than_its_pinned_holders() -> None:
    beside = _hot_doc_on_holders_pinned_full(True)
    assert beside.worker_id == W1 and "hot prefix" in beside.reason
    # The record says why a worker past the share had room.
    assert beside.reason.endswith(
        "(room beside its holders: 90% pinned with the copy, the holders at least 97%)"
    )
    alone = _hot_doc_on_holders_pinned_full(False)
    assert alone.worker_id == W0 and "hot prefix" not in alone.reason


def no_share() -> float:
    raise AssertionError("the traffic share must not be read")


def test_idle_copy_rule_warms_an_idle_worker_while_the_holders_are_busy() -> None:
    # A 4,000-token prefix on w0 and w1, 200-220 ms there; cold on the idle
    # workers 300 and 250 ms, of which 205 ms is the prefix's prefill.
    cs = [
        scored("w0", 0.20, matched=4_000),
        scored("w1", 0.22, matched=4_000),
        scored("w2", 0.30),
        scored("w3", 0.25),
    ]
    busy_two = with_loads(20, 20, 0, 0)
    choice = idle_copy_rule(cs, busy_two, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, lambda: 1.0)
    assert choice is not None and choice.index == 3 and not choice.abandoned
    assert choice.reason == (
        "hot prefix: 100% of the traffic, 4 of 4 workers' share, 2 hold it, all busy, "
        "w3 idle; warming w3"
    )
    # Half the traffic is two workers' share, and two hold it.
    assert (
        idle_copy_rule(cs, busy_two, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, lambda: 0.5)
        is None
    )
    assert (
        idle_copy_rule(cs, busy_two, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, lambda: 0.51)
        is not None
    )
    # An idle holder takes the prefix's next request: no copy, no share read.
    idle_holder = with_loads(20, 0, 0, 0)
    assert (
        idle_copy_rule(cs, idle_holder, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, no_share)
        is None
    )


def test_idle_copy_rule_copies_only_a_prefix_whose_prefill_keeps_the_idle_worker_out() -> None:
    """Warm, w3 would answer in 45 ms against the holders' 200: a copy pays.
    A 500-token prefix (29 ms of prefill) leaves it at 221 ms, no better than
    the holders: within the warm margin, so no copy."""
    busy = with_loads(20, 20, 0, 0)
    long_prefix = [scored("w0", 0.20, matched=4_000), scored("w1", 0.21), scored("w2", 0.3),
                   scored("w3", 0.25)]  # fmt: skip
    assert idle_copy_rule(long_prefix, busy, [0, 1, 2, 3], [0], 0, SHORT, 4_050, 0.2, lambda: 1.0)
    short_prefix = [replace(long_prefix[0], matched_tokens=500), *long_prefix[1:]]
    assert (
        idle_copy_rule(short_prefix, busy, [0, 1, 2, 3], [0], 0, SHORT, 4_050, 0.2, no_share)
        is None
    )


def test_idle_copy_rule_copies_only_where_it_costs_nothing() -> None:
    cs = [scored("w0", 0.20, matched=4_000), scored("w1", 0.30, eviction=0.2), scored("w2", 0.25)]
    busy = with_loads(20, 0, 1)
    # w1 is idle but its copy would evict cached prefixes; w2 has a request in flight.
    assert idle_copy_rule(cs, busy, [0, 1, 2], [0], 0, SHORT, 4_050, 0.2, no_share) is None
    # A prefill pending is work in progress too (the copy would delay its first token).
    pending = [busy[0], replace(busy[1], in_flight=0), replace(busy[2], in_flight=0)]
    pending[2] = replace(pending[2], pending_prefill_tokens=500)
    assert idle_copy_rule(cs, pending, [0, 1, 2], [0], 0, SHORT, 4_050, 0.2, no_share) is None
    # Outside the room filter (``eligible``): not a target either.
    assert (
        idle_copy_rule(cs, with_loads(20, 0, 0), [0, 1], [0], 0, SHORT, 4_050, 0.2, no_share)
        is None
    )
    choice = idle_copy_rule(
        cs, with_loads(20, 0, 0), [0, 1, 2], [0], 0, SHORT, 4_050, 0.2, lambda: 1.0
    )
    assert choice is not None and choice.index == 2


def test_idle_copy_rule_leaves_an_idle_worker_room_for_the_next_prefix() -> None:
    """An idle worker is where the next new prefix goes: a copy may take no
    more of its KV than the headroom the room filter keeps (1 - 0.8). Live,
    four replicas copied a 20,000-token document, 42 % of an engine's KV,
    into the last idle engine just before the next document came (doc-qa
    mean TTFT 820-1,525 ms against 743-753 ms without the copy)."""
    cs = [scored("w0", 0.20, matched=4_000), scored("w1", 0.25)]
    small = with_loads(20, 0)
    small[1] = replace(small[1], kv_capacity_blocks=1_000, block_size=16)  # 254 > 200 blocks
    assert idle_copy_rule(cs, small, [0, 1], [0], 0, SHORT, 4_050, 0.2, no_share) is None
    large = [small[0], replace(small[1], kv_capacity_blocks=2_000)]  # 254 <= 400 blocks
    assert idle_copy_rule(cs, large, [0, 1], [0], 0, SHORT, 4_050, 0.2, lambda: 1.0)


def _shared_prompt_on_two_busy_workers(**params: object) -> Decision:
    """A 4,000-token system prompt that every request shares, 7 requests a
    second, settled on w0 and w1, each with 20 requests in flight and 1,500
    tokens to prefill, beside two idle workers. Answers are short, so the
    demand read at the profile's speed is one replica's (live, the engines
    decoded slower than the profile: the two idle engines got no request for
    a whole run)."""
    prompt = tokens(1, 4_000)
    r = Router(create_policy("prefix_aware", params))
    ws = [
        replace(w, pending_prefill_tokens=1_500) if w.in_flight else w
        for w in with_loads(20, 20, 0, 0)
    ]
    for i in range(140):
        t = i / 7.0
        d = r.route(request(f"s{i}", prompt + tokens(100 + i, 50), max_tokens=64), ws, t)
        r.policy.on_routed(d.context, W0 if i % 2 else W1)
    hold(r, W0, prompt, 20.0)
    hold(r, W1, prompt, 20.0)
    return r.route(request("x", prompt + tokens(7, 50), max_tokens=64), ws, 20.0)


def test_a_prefix_all_traffic_shares_is_copied_to_an_idle_worker() -> None:
    d = _shared_prompt_on_two_busy_workers()
    assert d.worker_id in (W0, W1) and d.warm_up in (W2, W3)
    assert "2 hold it, all busy" in d.reason and "with a prefill-only copy" in d.reason
    # Without the rule the demand reads one replica: the idle workers stay idle.
    off = _shared_prompt_on_two_busy_workers(idle_copy=False)
    assert off.worker_id in (W0, W1) and off.warm_up is None


# -------------------------------------------------------- rule 2: maximum wait


@pytest.mark.parametrize(
    ("warm_queue", "best_queue", "best_ttft", "leaves"),
    [
        (5.0, 0.0, 1.0, True),  # past 4 s; leaving avoids it and is sooner
        (3.0, 0.0, 1.0, False),  # within the maximum wait
        (5.0, 4.5, 4.8, False),  # the other queue is past it too (overload)
        (5.0, 0.0, 6.0, False),  # leaving would not bring the first token sooner
    ],
)
def test_max_wait_rule_leaves_a_warm_queue_past_the_limit(
    warm_queue: float, best_queue: float, best_ttft: float, leaves: bool
) -> None:
    cs = [
        scored("w0", warm_queue + 0.5, queue=warm_queue),
        scored("w1", best_ttft, queue=best_queue),
    ]
    choice = max_wait_rule(cs, 0, 1, SHORT)
    if not leaves:
        assert choice is None
        return
    assert choice is not None and choice.index == 1 and choice.abandoned
    assert choice.reason == "left warm w0: queue wait 5000 ms > max 4000 ms"


def test_max_wait_rule_counts_a_wait_for_kv_memory_as_a_wait() -> None:
    # No queue on the warm worker, but its memory is pinned: 5 s until running
    # requests release enough of it.
    pinned = CostTerms(0.0, 0.5, 0.0, 5.0, 0.0)
    cs = [
        CandidateScore(W0, 8_000, 1.0, pinned, pinned.ttft_s),
        scored("w1", 1.0),
    ]
    choice = max_wait_rule(cs, 0, 1, SHORT)
    assert choice is not None and choice.index == 1 and choice.abandoned
    assert choice.reason == "left warm w0: queue wait 5000 ms > max 4000 ms"


def test_max_wait_rule_stays_when_the_copy_would_cost_the_queued_more_than_it_saves() -> None:
    # Leaving saves this request 4.5 s, and puts 1.0 s of cold prefill before
    # the five requests that will queue on w1 (the warm prefill of 0.5 s is
    # spared before none): 5 s, weighed 1.
    cs = [scored("w0", 5.5, queue=5.0), scored("w1", 1.0)]
    external = switch_externality(cs[0].terms, cs[1].terms, 0, 5, 1.0)
    assert external == pytest.approx(5.0)
    assert max_wait_rule(cs, 0, 1, SHORT, external) is None
    assert max_wait_rule(cs, 0, 1, SHORT, 4.0) is not None  # 1.0 + 4.0 < 5.5


def test_waiting_counts_the_requests_not_past_their_first_token() -> None:
    assert WorkerView(W0, in_flight=6, decoding=2).waiting == 4  # queued or prefilling
    assert WorkerView(W1, in_flight=3, decoding=3).waiting == 0  # all decoding
    # a view drawn between a first token and its completion never goes below 0
    assert WorkerView(W2, in_flight=1, decoding=2).waiting == 0


def test_switch_externality_is_the_prefill_added_before_the_target_queue_less_the_spared() -> None:
    warm_, cold = scored("w0", 1.2, queue=1.0).terms, scored("w1", 0.8).terms
    # cold prefills 0.8 s before 3 waiting; warm would prefill 0.2 s before 4
    assert switch_externality(warm_, cold, 4, 3, 1.0) == pytest.approx(0.8 * 3 - 0.2 * 4)
    assert switch_externality(warm_, cold, 4, 3, 10.0) == pytest.approx(16.0)  # weighed
    assert switch_externality(warm_, cold, 0, 0, 10.0) == 0.0  # an idle target delays no one
    assert switch_externality(warm_, cold, 20, 3, 10.0) == 0.0  # staying delays more
    assert switch_externality(warm_, cold, 4, 3, 0.0) == 0.0  # off
    assert switch_externality(None, cold, 4, 3, 1.0) == 0.0


def test_a_warm_worker_past_the_max_wait_is_kept_when_the_copy_would_delay_a_busy_target() -> None:
    # w0 holds the 8,000-token prompt behind a queue of about 10 s; w1 is
    # cold. Idle, w1 takes the copy: no one queues behind it. With requests
    # waiting on it (a short queue, within the maximum wait), the copy's
    # prefill would delay each of the requests that follow them, and the
    # request stays warm.
    doc = tokens(1, 8_000)

    def route(cold_waiting: int, weight: float = 10.0) -> tuple[WorkerId, bool, str]:
        r = Router(PrefixAwarePolicy(PrefixAwareParams(switch_backlog_weight=weight)))
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], in_flight=4, pending_prefill_tokens=200_000)
        ws[1] = replace(ws[1], in_flight=cold_waiting, pending_prefill_tokens=200 * cold_waiting)
        d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
        return d.worker_id, d.warm_abandoned, d.reason

    assert route(0)[:2] == (W1, True)
    worker, abandoned, reason = route(6)
    assert (worker, abandoned) == (W0, False), reason
    assert route(6, weight=0.0)[:2] == (W1, True)  # this request's first token alone


def test_switch_externality_counts_the_arrivals_during_the_copy_and_credits_the_prefix() -> None:
    # The copy prefills 2 s on an idle w1; w0 would prefill 0.2 s behind 3 s of queue.
    warm_, cold = scored("w0", 3.2, queue=3.0).terms, scored("w1", 2.0).terms
    # 0.5 requests a second for other prefixes reach each worker: 1 arrives
    # during the copy (0.1 during the warm prefill it spares), weighed 10.
    assert switch_externality(warm_, cold, 0, 0, 10.0, other_rate=0.5) == pytest.approx(
        10.0 * (2.0 * 0.5 * 2.0 - 0.2 * 0.5 * 0.2)
    )
    # The prefix's own requests arriving during w0's 3 s wait could use the
    # copy instead: 0.4/s x 3^2 / 2 = 1.8 s saved, taken off the cost.
    charged = switch_externality(warm_, cold, 0, 0, 10.0, other_rate=0.5, own_rate=0.4)
    assert charged == pytest.approx(10.0 * (2.0 - 0.02) - 1.8)
    # A hot prefix's copy pays for itself: never below 0.
    assert switch_externality(warm_, cold, 0, 0, 10.0, other_rate=0.5, own_rate=10.0) == 0.0
    assert switch_externality(warm_, cold, 0, 0, 0.0, other_rate=0.5) == 0.0  # off


def test_a_long_copy_is_charged_the_fleet_traffic_it_delays_unless_its_prefix_makes_it() -> None:
    # w0 holds a 30,000-token prompt behind about 12 s of queue; w1 is idle
    # and cold. With no traffic in the last seconds the copy delays no one
    # and the request leaves. With 10 requests a second for other prefixes,
    # about 5 a second reach w1, and the copy's prefill of about 2 s would
    # delay those arriving during it: it stays. When the prefix's own
    # requests make that traffic (a hot document), they would use the copy:
    # it leaves.
    doc = tokens(1, 30_000)

    def route(traffic: str) -> tuple[WorkerId, bool, str]:
        r = Router(PrefixAwarePolicy())
        warm(r, W0, doc)
        ws = workers(2)
        for i in range(60):
            if traffic.startswith("other prefixes"):
                d = send(r, request(f"o{i}", tokens(100 + i, 300)), ws, W1, i * 0.1)
                if traffic == "other prefixes, all refused":
                    r.on_rejected(d, i * 0.1)  # the engine did no prefill: no arrival
            elif traffic == "its own prefix":
                send(r, request(f"d{i}", doc + tokens(500 + i, 50)), ws, W0, i * 0.1)
        ws[0] = replace(ws[0], in_flight=4, pending_prefill_tokens=200_000)
        d = r.route(request("q", doc + tokens(5, 200)), ws, 6.0)
        return d.worker_id, d.warm_abandoned, d.reason

    assert route("none")[:2] == (W1, True)
    worker, abandoned, reason = route("other prefixes")
    assert (worker, abandoned) == (W0, False), reason
    assert "of it the queue behind" in reason
    assert route("its own prefix")[:2] == (W1, True)
    assert route("other prefixes, all refused")[:2] == (W1, True)


# -------------------------------------------------------- rule 3: no room for a copy


@pytest.mark.parametrize(
    ("roomy", "needed", "kept"),
    [
        ([0, 2], 1, False),  # w2 has room for the copy: the margin rule decides
        ([0], 1, True),  # room nowhere else, one replica serves the demand: stay
        ([0], 2, False),  # room nowhere else, but the prefix needs a second replica
    ],
)
def test_no_room_rule_keeps_the_warm_worker_when_no_other_has_room(
    roomy: list[int], needed: int, kept: bool
) -> None:
    # w1, the best score, would wait 0.5 s for KV memory.
    waits = CostTerms(0.0, 0.5, 0.0, 0.5, 0.0)
    cs = [scored("w0", 2.0), CandidateScore(W1, 0, 1.0, waits, waits.ttft_s)]
    choice = no_room_rule(cs, 0, 1, [0], lambda: roomy, lambda: needed)
    if not kept:
        assert choice is None
        return
    assert choice is not None and choice.index == 0 and not choice.abandoned
    assert "no room for a copy elsewhere" in choice.reason
    # With room elsewhere, a best that holds the prefix too (moving copies
    # nothing) or a best with the memory free now, the demand is never computed.
    assert no_room_rule(cs, 0, 1, [0], lambda: [0, 1], lambda: int(never())) is None
    assert no_room_rule(cs, 0, 1, [0, 1], lambda: never(), lambda: int(never())) is None
    free = [cs[0], scored("w1", 1.0)]
    assert no_room_rule(free, 0, 1, [0], lambda: never(), lambda: int(never())) is None


def test_a_full_fleet_keeps_a_customer_on_its_warm_worker_the_margin_would_leave() -> None:
    # The warm worker is slower than the margin allows, but every other
    # worker's memory is pinned by running requests (the copy would wait for
    # them): one-off copies would thrash every cache.
    r = Router()
    doc = tokens(1, 8_000)
    warm(r, W0, doc)
    pinned = WorkerView(
        W1,
        in_flight=2,
        decoding=2,
        decode_tokens_remaining=200,
        kv_capacity_blocks=2_000,
        kv_used_blocks=1_800,
    )
    ws = [
        WorkerView(W0, in_flight=6, pending_prefill_tokens=40_000, kv_capacity_blocks=2_000),
        pinned,
    ]
    d = r.route(request("q", doc), ws, 1.0)
    assert d.worker_id == W0 and "no room for a copy elsewhere" in d.reason
    # The same with room on w1: the margin rule sends it there.
    ws[1] = WorkerView(W1, kv_capacity_blocks=2_000)
    d = r.route(request("q", doc), ws, 1.0)
    assert d.worker_id == W1 and "beyond margin" in d.reason


@pytest.mark.parametrize(
    ("pending", "max_wait", "reason"),
    [
        (60_000, None, "beyond margin"),  # ~3 s queue: too slow
        (200_000, None, "beyond margin"),  # ~10 s: no cap by default, the margin decides
        (60_000, 4.0, "beyond margin"),  # under a cap of 4 s, but too slow
        (200_000, 4.0, "max"),  # past the cap an operator set
    ],
)
def test_cold_wins_when_the_warm_queue_is_too_long(
    pending: int, max_wait: float | None, reason: str
) -> None:
    params = PrefixAwareParams()  # None: the default
    if max_wait is not None:
        params = replace(params, short=replace(params.short, max_warm_wait_s=max_wait))
    r = Router(PrefixAwarePolicy(params))
    doc = tokens(1, 8_000)
    warm(r, W0, doc)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=pending)
    d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
    assert d.worker_id == W1 and d.tier == "cold"
    assert d.warm_abandoned and reason in d.reason, d.reason


def test_no_cap_by_default_a_warm_queue_within_the_margin_keeps_the_request() -> None:
    # w0 holds the 8,000-token prompt behind about 4.2 s of queue; w1 is cold
    # with about 3.4 s of its own. Within the warm margin of w1's first token
    # (the copy's prefill on top of w1's queue: 4.35 s against 3.90 s, the
    # margin 0.5 s) the request stays: the old 4 s cap would have sent it to
    # w1, a copy whose prediction is no better by more than the margin, and
    # under overload every queue is past any cap.
    doc = tokens(1, 8_000)

    def route(max_wait: float | None) -> tuple[WorkerId, bool, str]:
        params = PrefixAwareParams(switch_backlog_weight=0.0)  # the defaults otherwise
        if max_wait is not None:
            params = replace(params, short=replace(params.short, max_warm_wait_s=max_wait))
        r = Router(PrefixAwarePolicy(params))
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], in_flight=4, pending_prefill_tokens=78_000)
        ws[1] = replace(ws[1], in_flight=4, pending_prefill_tokens=64_000)
        d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
        return d.worker_id, d.warm_abandoned, d.reason

    worker, abandoned, reason = route(None)
    assert (worker, abandoned) == (W0, False) and "warm within margin" in reason, reason
    worker, abandoned, reason = route(4.0)
    assert (worker, abandoned) == (W1, True) and "max" in reason, reason


# --------------------------------------------------------- rule 3: warm margin


@pytest.mark.parametrize(
    ("warm_ttft", "pressure", "kept"),
    [
        (1.30, 1.0, True),  # 1.30 <= 1.0 + 1.0 * (1.0 * 0.25 + 0.05) = 1.30
        (1.31, 1.0, False),
        (1.15, 0.5, True),  # half the margin: limit 1.15
        (1.16, 0.5, False),
    ],
)
def test_warm_margin_rule_keeps_warm_within_the_margin(
    warm_ttft: float, pressure: float, kept: bool
) -> None:
    cs = [scored("w0", warm_ttft), scored("w1", 1.0)]
    choice = warm_margin_rule(cs, 0, 1, SHORT, pressure, 0.5)
    # Leaving the warm worker is marked: its wait made it too slow (a copy).
    assert choice.index == (0 if kept else 1) and choice.abandoned is not kept
    assert ("warm within margin" in choice.reason) is kept


def test_warm_margin_rule_counts_what_the_copy_costs_the_requests_queued() -> None:
    # 1.31 s warm against 1.0 s cold is past the margin (1.30) when the copy
    # delays no one; with one request to queue behind it on w1 the cold side
    # pays the 1.0 s of prefill it adds, less the warm's 0.31 s spared before none.
    cs = [scored("w0", 1.31, queue=1.0), scored("w1", 1.0)]
    assert warm_margin_rule(cs, 0, 1, SHORT, 1.0, 0.5).index == 1
    external = switch_externality(cs[0].terms, cs[1].terms, 0, 1, 1.0)
    kept = warm_margin_rule(cs, 0, 1, SHORT, 1.0, 0.5, external)
    assert kept.index == 0
    assert "(best cold w1 2000 ms, 1000 ms of it the queue behind)" in kept.reason


def test_warm_margin_rule_weighs_decode_by_the_switch_weight() -> None:
    # the warm worker decodes a big batch: 1 s more decode, weighed 0 for short answers
    cs = [scored("w0", 1.1, decode=2.0), scored("w1", 1.0, decode=1.0)]
    assert switch_score(cs[0], SHORT, 0.5) == pytest.approx(1.1)
    assert warm_margin_rule(cs, 0, 1, SHORT, 1.0, 0.5).index == 0
    weighs_decode = replace(SHORT, switch_decode_weight=1.0)
    assert switch_score(cs[0], weighs_decode, 0.5) == pytest.approx(3.1)
    assert warm_margin_rule(cs, 0, 1, weighs_decode, 1.0, 0.5).index == 1


def test_cache_pressure_is_how_full_the_cache_would_be() -> None:
    index = PrefixIndex()
    index.set_capacity(W0, 1_000)
    assert cache_pressure(index, W0, 250) == 0.25
    assert cache_pressure(index, W0, 5_000) == 1.0  # capped
    index.on_routed(W0, [BlockHash(h) for h in range(500)], 0.0)  # what it holds counts
    assert cache_pressure(index, W0, 250) == 0.75


def test_margin_limit_scales_with_the_best_ttft_not_its_score() -> None:
    best = scored("w1", 1.0, score=3.0)  # decode weighed into the score
    assert margin_limit(best, SHORT, 1.0) == pytest.approx(3.0 + 0.25 + 0.05)
    assert margin_limit(best, SHORT, 0.5) == pytest.approx(3.0 + 0.15)


@pytest.mark.parametrize(("cold_cache_full", "expected"), [(True, W0), (False, W1)])
def test_warm_wins_within_the_margin_when_a_copy_would_evict(
    cold_cache_full: bool, expected: WorkerId
) -> None:
    r = Router()
    doc = tokens(1, 1_000)
    warm(r, W0, doc)
    if cold_cache_full:
        fill_cache(r, W1)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=3_500)  # a short queue on the warm worker
    d = r.route(request("q", doc + tokens(5, 2_000)), ws, 1.0)
    c0, c1 = candidate(d, W0), candidate(d, W1)
    assert c0.score > c1.score  # type: ignore[attr-defined]  # pure cost says cold...
    # ...the margin keeps it warm when copying the prefix to w1 would evict others,
    # and vanishes when w1's cache has room (replicas warm up in parallel)
    assert d.worker_id == expected
    if cold_cache_full:
        assert "warm within margin" in d.reason


# --------------------------------------- cold path: cold pool, rendezvous home


def test_cold_pool_rule_takes_the_pool_only_within_the_margin() -> None:
    ws = [WorkerView(W0), WorkerView(W1), WorkerView(WorkerId("c0"), pool="cold")]
    cs = [scored("w0", 1.0), scored("w1", 1.1), scored("c0", 1.2)]
    assert cold_pool_rule(cs, ws, 0, "cold", SHORT) == 2  # 1.2 <= 1.3
    cs[2] = scored("c0", 1.4)
    assert cold_pool_rule(cs, ws, 0, "cold", SHORT) is None  # a busy pool: not worth the wait
    assert cold_pool_rule(cs, ws, 0, "batch", SHORT) is None  # no such pool


def test_new_home_rule_takes_the_emptiest_cache_within_the_margin() -> None:
    r = Router()
    warm(r, W0, tokens(1, 3_200))  # 200 blocks
    warm(r, W1, tokens(2, 1_600))  # 100 blocks
    warm(r, W3, tokens(3, 800))  # 50 blocks; w2 holds nothing
    cs = [scored("w0", 1.0), scored("w1", 1.05), scored("w2", 1.4), scored("w3", 1.2)]
    ws = workers(4)
    # The margin of the best (1.0 s) ends at 1.3 s: w2, empty, is past it.
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 3
    cs[2] = scored("w2", 1.3)
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 2
    # Equal caches: the fewest in flight, then the score.
    warm(r, W2, tokens(4, 800))
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 3  # w2 and w3 hold 50: the score
    ws[2] = replace(ws[2], in_flight=0)
    ws[3] = replace(ws[3], in_flight=2)
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 2
    # One candidate within the margin: no rule.
    far = [cs[0], *(scored(f"w{i}", 2.0) for i in (1, 2, 3))]
    assert new_home_rule(r.index, far, ws, 0, SHORT, 10) is None
    # A cache without room for the prompt: no rule (full caches hold what recency left).
    r.index.set_capacity(W0, 205)
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 4) == 2
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 5) is None


def _group(g: int, q: int) -> array[int]:
    """Group ``g``'s 1,600-token system prompt and its question ``q``."""
    return tokens(100 + g, 1_600) + tokens(1_000 * g + q, 64)


def test_a_new_group_goes_to_the_emptiest_cache_not_the_fewest_in_flight() -> None:
    def route_new_group(params: dict[str, object]) -> Decision:
        r = Router(create_policy("prefix_aware", params))
        ws = workers(3)
        # Group 0's home is w0 and its second question found it there: what
        # follows a new prompt is reused, so a new prompt makes a home.
        send(r, request("g0-0", _group(0, 0)), ws, W0, 0.0)
        send(r, request("g0-1", _group(0, 1)), ws, W0, 0.1)
        # w0 is idle now; w1 and w2 run one request each.
        busy = [ws[0], replace(ws[1], in_flight=1), replace(ws[2], in_flight=1)]
        return r.route(request("g1-0", _group(1, 0)), busy, 1.0)

    d = route_new_group({})
    assert d.tier == "cold" and d.worker_id in (W1, W2)
    assert "a new home: the emptiest cache" in d.reason
    # Off: the picker among all, by requests in flight.
    assert route_new_group({"new_home_emptiest": False}).worker_id == W0


def test_one_off_prompts_and_replicas_keep_the_picker_on_the_cold_path() -> None:
    ws = workers(3)
    busy = [ws[0], replace(ws[1], in_flight=1), replace(ws[2], in_flight=1)]
    r = Router()
    # Unique prompts that nobody reuses: the root's new content is one-off.
    for i in range(4):
        send(r, request(f"u{i}", tokens(500 + i, 1_664)), ws, W0, 0.1 * i)
    d = r.route(request("u", tokens(600, 1_664)), busy, 1.0)
    assert "new home" not in d.reason and d.worker_id == W0
    # A replica (salted) draws two as before, whatever a cache holds.
    rep = Router(replica_salt=replica_salt("r1"))
    send(rep, request("g0-0", _group(0, 0)), ws, W0, 0.0)
    send(rep, request("g0-1", _group(0, 1)), ws, W0, 0.1)
    assert "new home" not in rep.route(request("g1-0", _group(1, 0)), busy, 1.0).reason


def test_rendezvous_home_is_stable_and_among_the_near_workers() -> None:
    cs = [scored(f"w{i}", 1.0 + 0.01 * i) for i in range(4)]
    homes = {b: rendezvous_home(cs, 0, b, SHORT)[0] for b in range(64)}
    assert set(homes.values()) == {0, 1, 2, 3}  # prefixes partition over the workers
    assert all(rendezvous_home(cs, 0, b, SHORT)[0] == h for b, h in homes.items())
    cs[3] = scored("w3", 2.0)  # outside the margin: never a home
    assert rendezvous_home(cs, 0, 7, SHORT)[1] == 3
    assert all(rendezvous_home(cs, 0, b, SHORT)[0] != 3 for b in range(64))


def test_a_prefix_seen_before_and_evicted_everywhere_goes_home() -> None:
    r = Router()
    doc = tokens(1, 2_000)
    ws = workers(4)
    first = r.route(request("a", doc), ws, 0.0)
    r.on_routed(first, 0.0)  # counted in the demand: seen before
    r.index.clear_worker(first.worker_id)  # and evicted
    again = [r.route(request(f"b{i}", doc), ws, 1.0) for i in range(3)]
    assert {d.tier for d in again} == {"cold"} and len({d.worker_id for d in again}) == 1
    assert "its home among 4 within margin" in again[0].reason


def test_cold_pool_takes_cold_requests_and_warm_ones_stay_warm() -> None:
    policy = create_policy("prefix_aware", {"cold_pool": "cold"})
    r = Router(policy)
    doc = tokens(1, 10_000)
    warm(r, W0, doc)
    ws = [*workers(2), WorkerView(WorkerId("c0"), pool="cold")]
    cold = r.route(request("u", tokens(77, 3_000)), ws, 1.0)
    assert cold.worker_id == "c0" and cold.tier == "cold_pool"
    hot = r.route(request("h", doc + tokens(2, 100)), ws, 1.0)
    assert hot.worker_id == W0 and hot.tier == "exact"


# --------------------------------------------- demand, determinism, parameters


def test_the_deprecated_name_builds_the_same_policy() -> None:
    old = create_policy("prefixrouter", {"min_match_tokens": 32})
    assert isinstance(old, PrefixAwarePolicy) and old.name == "prefix_aware"
    assert old.params == replace(PrefixAwareParams(), min_match_tokens=32)
    assert Router("prefixrouter").route(request("q", tokens(1, 100)), workers(2), 0.0).policy == (
        "prefix_aware"
    )


def test_demand_survives_a_clock_that_steps_back() -> None:
    r = Router()
    doc = tokens(1, 2_000)
    for t in (5.0, 1.0e9, 3.0):  # math.exp overflowed on the step back
        d = r.route(request(f"c{t}", doc + tokens(2, 10)), workers(2), t)
        r.on_routed(d, t)
    assert isinstance(r.policy, PrefixAwarePolicy)
    assert r.policy.prefix_rate(r.blocks_for(request("q", doc)).hashes[0], 3.0) > 0


def test_a_rejected_routing_is_taken_back_in_the_index_and_the_demand() -> None:
    router = Router()
    policy = router.policy
    assert isinstance(policy, PrefixAwarePolicy)
    ws = workers(2)
    doc = tokens(1, 2048)
    served = router.route(request("doc", doc), ws, 0.0)
    router.on_routed(served, 0.0)
    router.on_completed(served, Outcome(0, 0.1), 0.5)  # the engine holds the document
    before = (len(router.index), dict(policy._demand), router.index.speculative_entries)
    rates = {k: policy.prefix_rate(k, 5.0) for k in policy._demand}
    # a request past the context length: it shares the document and extends it
    too_long = request("long", [*doc, *tokens(2, 40_000)])
    d = router.route(too_long, ws, 1.0)
    assert d.worker_id == served.worker_id and d.predicted_cached_tokens > 0
    router.on_routed(d, 1.0)
    router.on_rejected(d, 1.2)  # the engine answered 400: no prefill
    assert (len(router.index), dict(policy._demand), router.index.speculative_entries) == before
    assert {k: policy.prefix_rate(k, 5.0) for k in policy._demand} == pytest.approx(rates)
    retry = router.route(request("long-retry", [*doc, *tokens(2, 40_000)]), ws, 2.0)
    assert retry.predicted_cached_tokens == served.prompt_tokens  # the document only
    # a new prefix refused outright leaves nothing: its retry is routed as never seen
    new = request("new", tokens(3, 4096))
    d = router.route(new, ws, 3.0)
    router.on_routed(d, 3.0)
    router.on_rejected(d, 3.0)
    again = router.route(request("new-retry", tokens(3, 4096)), ws, 4.0)
    assert again.predicted_cached_tokens == 0 and again.tier == "cold"
    assert router.blocks_for(new).hashes[0] not in policy._demand


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 5_000)), max_size=12),
    st.integers(0, 3),
    st.integers(1, 4_000),
)
def test_same_inputs_same_decision(
    history: list[tuple[int, int, int]], doc_id: int, max_tokens: int
) -> None:
    def build() -> tuple[Router, list[WorkerView]]:
        r = Router()
        ws = workers(3)
        for i, (w, d, pending) in enumerate(history):
            warm(r, WorkerId(f"w{w}"), tokens(d, 2_000), float(i))
            ws[w] = replace(ws[w], pending_prefill_tokens=pending)
        return r, ws

    q = RoutingRequest(RequestId("q"), NS, tokens=tokens(doc_id, 2_100), max_tokens=max_tokens)
    (r1, ws1), (r2, ws2) = build(), build()
    assert r1.route(q, ws1, 50.0).to_dict() == r2.route(q, ws2, 50.0).to_dict()


def test_params_validation_names_the_field() -> None:
    from prefixrouter.errors import ConfigError, UnknownNameError

    with pytest.raises(ConfigError, match="warm_margin_rell"):
        create_policy("prefix_aware", {"short": {"warm_margin_rell": 1}})
    with pytest.raises(ConfigError, match="'min_match_tokens' must be int"):
        create_policy("prefix_aware", {"min_match_tokens": "many"})
    with pytest.raises(UnknownNameError, match=r"known: .*round_robin"):
        create_policy("nope")
    p = create_policy("prefix_aware", {"long": {"decode_weight": 2}}).params
    assert isinstance(p, PrefixAwareParams) and p.long.decode_weight == 2.0
    assert p.long.warm_margin_rel == PrefixAwareParams().long.warm_margin_rel


# ------------------------------------------------- rule 4a: prefill in progress


def _second_request_for_a_prefix_being_prefilled(
    gap_s: float, **params: object
) -> tuple[WorkerId, str]:
    """A 4,000-token prefix is routed to one worker of three and its prefill
    starts; ``gap_s`` later a second request for it arrives. Where does it go?"""
    r, ledger = Router(create_policy("prefix_aware", params)), InflightLedger()
    prefix = tokens(7, 4_000)
    views = [ledger.fill(WorkerView(w), 0.0) for w in (W0, W1, W2)]
    first = r.route(request("a", [*prefix, *tokens(8, 40)]), views, 0.0)
    r.on_routed(first, 0.0)
    ledger.on_routed(RequestId("a"), first.worker_id, 4_040, 4_040, 16, 0.0)
    views = [ledger.fill(WorkerView(w), gap_s) for w in (W0, W1, W2)]
    second = r.route(request("b", [*prefix, *tokens(9, 40)]), views, gap_s)
    holder = first.worker_id
    return (holder if second.worker_id == holder else WorkerId("idle")), second.reason


def test_a_prefill_just_started_is_not_waited_for_beside_an_idle_worker() -> None:
    # 10 ms into a ~200 ms prefill: waiting costs about as much as an idle
    # worker's cold prefill, and the requests that arrive meanwhile would
    # join this one's engine step; the margin alone kept it waiting.
    where, reason = _second_request_for_a_prefix_being_prefilled(0.01)
    assert where == "idle" and "its prefill in progress" in reason
    where, reason = _second_request_for_a_prefix_being_prefilled(0.01, wait_on_prefill=False)
    assert where != "idle" and "warm within margin" in reason


def test_a_prefill_nearly_done_is_waited_for() -> None:
    # 170 ms into it: what is left plus this request's own prefill comes
    # well before an idle worker's whole prefill.
    where, reason = _second_request_for_a_prefix_being_prefilled(0.17)
    assert where != "idle" and reason.startswith("warm, its prefill in progress")


def test_a_prefix_asked_for_slower_than_its_prefill_is_left_to_the_margin() -> None:
    # Asked for once per 2 s, a ~200 ms prefill is long done by the next
    # request: the rule does not apply (the margin rule decides).
    _, reason = _second_request_for_a_prefix_being_prefilled(2.0)
    assert "prefill in progress" not in reason


# ------------------------------------- rule 1a: every holder on its first prefill


def _after_three_first_prefills(
    shared: int, tails: tuple[int, int, int], tail: int, **params: object
) -> Decision:
    """Three prompts that share their first ``shared`` tokens, with tails of
    ``tails`` tokens, reach W0, W1 and W2 30 ms apart; at 90 ms, before any
    first token, a fourth with a ``tail``-token tail is routed."""
    r, ledger = Router(create_policy("prefix_aware", params)), InflightLedger()
    head = tokens(7, shared)
    for k, (w, n) in enumerate(zip((W0, W1, W2), tails, strict=True)):
        t = 0.03 * k
        rid = RequestId(f"r{k}")
        prompt = [*head, *tokens(10 + k, n)]
        d = r.route(request(rid, prompt), [ledger.fill(WorkerView(w), t)], t)
        r.on_routed(d, t)
        ledger.on_routed(rid, w, len(prompt), len(prompt), 16, t)
    views = [ledger.fill(WorkerView(w), 0.09) for w in (W0, W1, W2)]
    return r.route(request("q", [*head, *tokens(20, tail)]), views, 0.09)


def test_every_holder_on_its_first_prefill_the_one_that_ends_first_takes_it() -> None:
    # A shared 4,000-token prompt reached three workers 30 ms apart (a fleet
    # starting on one system prompt); at 90 ms none has sent a first token
    # and none is idle. The scores count each holder's whole queued prefill,
    # so the worker that started last (the shortest prompt) scored lowest;
    # the one whose prefill has run longest ends first.
    d = _after_three_first_prefills(4_000, (400, 200, 40), 40)
    assert d.worker_id == W0 and d.reason.startswith("every holder still on its first prefill")
    d = _after_three_first_prefills(4_000, (400, 200, 40), 40, earliest_prefill=False)
    assert d.worker_id == W2 and "first prefill" not in d.reason


def test_holders_of_a_short_shared_head_are_left_to_the_other_rules() -> None:
    # Three 4,000-token prompts that share only a 64-token head (a chat
    # template's first blocks) went to three workers 30 ms apart. Every
    # worker "holds" the head and none has answered, but their queues hold
    # other prompts: how long those have run says nothing of this request's
    # first token, so the rule stays out of it (unless the share is 0).
    tails = (4_000, 4_000, 4_000)
    assert "first prefill" not in _after_three_first_prefills(64, tails, 4_000).reason
    d = _after_three_first_prefills(64, tails, 4_000, earliest_prefill_min_share=0.0)
    assert d.reason.startswith("every holder")
