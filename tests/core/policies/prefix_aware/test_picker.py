"""``prefix_aware`` step 3: the picker, the tie band among the deepest holders."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import replace

import pytest

from prefixrouter.core import (
    Decision,
    Router,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.policies.prefix_aware import (
    calibration_band,
    deepest_holders,
    holder_band_rule,
    holder_kv_wait_rank,
    one_off_pick,
    profile_first_token,
    tie_band_picker,
)
from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.router import replica_salt
from tests.core.conftest import hold, request, send, tokens, workers
from tests.core.policies.prefix_aware.conftest import (
    SHORT,
    W0,
    W1,
    W2,
    W3,
    calibrate,
    candidate,
    scored,
)

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
