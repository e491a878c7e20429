"""``prefix_aware`` steps 1 and 2: the scorer's cost terms and the cold quota's filter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import (
    InflightLedger,
    Router,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.policies.prefix_aware import (
    PrefixAwareParams,
    cold_quota_filter,
    score_candidates,
)
from tests.core.conftest import request, tokens, warm, workers
from tests.core.policies.prefix_aware.conftest import (
    W0,
    W1,
    W2,
    calibrate,
    candidate,
    fill_cache,
)

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
