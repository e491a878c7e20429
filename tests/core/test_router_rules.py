"""Table-driven tests for each rule of the ``prefixrouter`` policy, on the default profile."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.core import (
    CacheNamespace,
    Decision,
    InflightLedger,
    Outcome,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.events import BlockStored
from prefixrouter.core.policies.prefix_aware import PrefixRouterParams, PrefixRouterPolicy
from prefixrouter.errors import NoWorkerAvailable
from tests.core.conftest import NS, request, tokens, workers

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")


def warm(router: Router, worker: WorkerId, toks: object, now: float = 0.0) -> None:
    """Make ``worker`` hold ``toks`` as if a request had been routed there."""
    req = request(f"warm-{worker}-{now}", toks)  # type: ignore[arg-type]
    router.index.on_routed(worker, router.blocks_for(req).hashes, now)


def hold(router: Router, worker: WorkerId, toks: object, now: float = 0.0) -> None:
    """Make ``worker`` hold ``toks`` for sure (the engine said so in a KV event)."""
    req = request(f"held-{worker}-{now}", toks)  # type: ignore[arg-type]
    router.apply(BlockStored(worker, router.blocks_for(req).hashes), now)


def fill_cache(router: Router, worker: WorkerId, blocks: int = 2_000, now: float = 0.0) -> None:
    """Make ``worker``'s cache full of other prefixes (a copy would evict them)."""
    router.index.set_capacity(worker, blocks)
    warm(router, worker, tokens(10_000 + int(worker[1:]), blocks * 16), now)


def candidate(decision: object, worker: WorkerId) -> object:
    return next(c for c in decision.candidates if c.worker_id == worker)  # type: ignore[attr-defined]


def test_exact_hit_wins_when_loads_are_equal() -> None:
    r = Router()
    doc = tokens(1, 30_000)
    warm(r, W1, doc)
    d = r.route(request("q", doc[:30_000] + tokens(9, 100)), workers(3), 1.0)
    assert d.worker_id == W1 and d.tier == "exact"
    assert d.predicted_cached_tokens == 30_000 - 30_000 % 16


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


@pytest.mark.parametrize(
    ("pending", "abandoned", "reason"),
    [
        (60_000, False, "beyond margin"),  # ~3 s queue: under the max wait, but too slow
        (200_000, True, "max"),  # ~10 s queue: past the max wait for warm preference
    ],
)
def test_cold_wins_when_the_warm_queue_is_too_long(
    pending: int, abandoned: bool, reason: str
) -> None:
    r = Router()
    doc = tokens(1, 8_000)
    warm(r, W0, doc)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=pending)
    d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
    assert d.worker_id == W1 and d.tier == "cold"
    assert d.warm_abandoned is abandoned and reason in d.reason


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
    short = r.route(request("s", doc + tokens(2, 100), max_tokens=8), ws, 1.0)
    long = r.route(request("l", doc + tokens(3, 100), max_tokens=2_000), ws, 1.0)
    assert short.worker_id == W0 and short.tier == "exact"
    assert long.worker_id == W1 and long.tier == "cold"


def test_hot_prefix_warms_a_second_replica() -> None:
    doc = tokens(1, 8_000)

    def route_under_demand(requests_per_s: float, settled: bool = True) -> Decision:
        r = Router()
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], pending_prefill_tokens=9_000)  # warm, but queued
        # a stream of this prefix at the given rate feeds the demand estimate
        for i in range(300):
            t = i / requests_per_s
            d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), ws, t)
            r.policy.on_routed(d.context, W0)
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


def test_cold_quota_keeps_slots_for_unique_requests_in_a_hot_stream() -> None:
    def run(share: float) -> tuple[dict[WorkerId, int], list[int]]:
        policy = create_policy("prefixrouter", {"cold_reserved_share": share})
        r, ledger = Router(policy), InflightLedger()
        hot = tokens(1, 3_000)
        warm(r, W0, hot)
        free_slots_seen = []
        hot_per_worker: dict[WorkerId, int] = {}
        for i in range(12):
            unique = i % 3 == 2
            toks = tokens(1000 + i, 800) if unique else hot + tokens(500 + i, 40)
            ws = [ledger.fill(WorkerView(WorkerId(f"w{k}"), max_slots=8)) for k in range(3)]
            d = r.route(request(f"r{i}", toks), ws, float(i))
            chosen = next(w for w in ws if w.worker_id == d.worker_id)
            if unique:
                free_slots_seen.append(chosen.max_slots - chosen.in_flight)
            else:
                hot_per_worker[d.worker_id] = hot_per_worker.get(d.worker_id, 0) + 1
            r.on_routed(d, float(i))
            ledger.on_routed(d.context.request.request_id, d.worker_id, 40, 3_040, 128)
        return hot_per_worker, free_slots_seen

    hot, free = run(0.25)
    assert max(hot.values()) <= 6  # hot requests left a slot in reserve on every worker
    assert all(f >= 1 for f in free)  # every unique request found a free slot
    no_quota, _ = run(0.0)
    assert no_quota[W0] > 6  # without the quota the hot stream takes the warm worker's slots


def test_cold_pool_takes_cold_requests_and_warm_ones_stay_warm() -> None:
    policy = create_policy("prefixrouter", {"cold_pool": "cold"})
    r = Router(policy)
    doc = tokens(1, 10_000)
    warm(r, W0, doc)
    ws = [*workers(2), WorkerView(WorkerId("c0"), pool="cold")]
    cold = r.route(request("u", tokens(77, 3_000)), ws, 1.0)
    assert cold.worker_id == "c0" and cold.tier == "cold_pool"
    hot = r.route(request("h", doc + tokens(2, 100)), ws, 1.0)
    assert hot.worker_id == W0 and hot.tier == "exact"


@pytest.mark.parametrize(
    ("worker", "req_kw", "filter_name"),
    [
        (WorkerView(W0, healthy=False), {}, "health"),
        (WorkerView(W0, models=frozenset({"other"})), {"model": "m"}, "model"),
        (WorkerView(W0), {"adapter": "lora-x"}, "adapter"),
        (WorkerView(W0, tenants=frozenset({"acme"})), {"tenant": "b"}, "tenant"),
        (WorkerView(W0, pool="batch"), {"pool": "online"}, "pool"),
    ],
)
def test_filters_run_before_scoring(worker: WorkerView, req_kw: dict, filter_name: str) -> None:  # type: ignore[type-arg]
    r = Router()
    doc = tokens(1, 2_000)
    warm(r, W0, doc)  # the filtered worker is warm: permission still comes first
    other = WorkerView(
        W1,
        models=frozenset({"m"}),
        adapters=frozenset({"lora-x"}),
        pool=req_kw.get("pool", "default"),
    )
    ws = [worker, other]
    d = r.route(request("q", doc, **req_kw), ws, 1.0)
    assert d.worker_id == W1 and d.filtered == {W0: filter_name}
    with pytest.raises(NoWorkerAvailable, match=filter_name):
        r.route(request("q", doc, **req_kw), [worker], 1.0)


@pytest.mark.parametrize(
    "ns",
    [NS, CacheNamespace("m", tenant="tenant:alice")],  # alice shares her cache / keeps it apart
    ids=["sharing", "isolated"],
)
def test_a_workers_tenants_list_admits_the_tenant_by_name(ns: CacheNamespace) -> None:
    # Issue 12: the filter compared the namespace's tenant field ("" or
    # "tenant:alice") with the plain names, so a dedicated worker never matched.
    r = Router()
    ws = [WorkerView(W0, tenants=frozenset({"alice"})), WorkerView(W1, tenants=frozenset({"bob"}))]
    for i in range(4):
        d = r.route(request(f"a{i}", tokens(i, 500), ns=ns, tenant="alice"), ws, 1.0)
        assert d.worker_id == W0 and d.filtered == {W1: "tenant"}
    with pytest.raises(NoWorkerAvailable) as err:
        r.route(request("anon", tokens(9, 500), ns=ns), ws, 1.0)
    assert err.value.filtered == {W0: "tenant", W1: "tenant"}


def test_decision_record_names_everything() -> None:
    r = Router()
    doc = tokens(1, 3_000)
    warm(r, W0, doc)
    d = r.route(request("q1", doc, prefix_class="document"), workers(2), 1.0)  # type: ignore[arg-type]
    rec = d.to_dict()
    assert rec["request_id"] == "q1" and rec["selected_worker"] == "w0"
    assert rec["namespace"] == NS.key and rec["tier"] == "exact" and rec["reason"]
    assert rec["predicted_cached_tokens"] == 2_992 and len(rec["prefix_key"]) == 16
    assert rec["prefix_class"] == "document" and rec["policy"] == "prefixrouter"
    assert rec["prompt_tokens"] == 3_000 and rec["time"] == 1.0
    assert rec["filtered"] == {} and rec["warm_abandoned"] is False
    assert d.context.request.request_id == "q1" and d.context.now == 1.0
    cands = {c["worker"]: c for c in rec["candidate_workers"]}
    assert set(cands) == {"w0", "w1"}
    for key in ("queue_wait_ms", "prefill_ms", "decode_impact_ms", "memory_risk_ms"):
        assert key in cands["w0"]
    assert cands["w0"]["prefill_ms"] < cands["w1"]["prefill_ms"]


def test_route_is_pure_and_feedback_calibrates() -> None:
    r = Router()
    doc = tokens(1, 3_000)
    q = request("q", doc)
    ws = workers(2)
    first = r.route(q, ws, 1.0).to_dict()
    assert r.route(q, ws, 1.0).to_dict() == first
    assert len(r.index) == 0  # routing alone indexed nothing
    d = r.route(q, ws, 1.0)
    r.on_routed(d, 1.0)
    predicted = d.predicted_ttft_s
    assert predicted is not None
    for _ in range(100):  # the engine is twice as slow as its profile says
        r.on_completed(d, Outcome(actual_cached_tokens=0, ttft_s=2 * predicted), 2.0)
    assert r.cost.scale(d.worker_id) == pytest.approx(2.0, rel=0.05)


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
        create_policy("prefixrouter", {"short": {"warm_margin_rell": 1}})
    with pytest.raises(ConfigError, match="'min_match_tokens' must be int"):
        create_policy("prefixrouter", {"min_match_tokens": "many"})
    with pytest.raises(UnknownNameError, match=r"known: .*round_robin"):
        create_policy("nope")
    p = create_policy("prefixrouter", {"long": {"decode_weight": 2}}).params
    assert isinstance(p, PrefixRouterParams) and p.long.decode_weight == 2.0
    assert p.long.warm_margin_rel == PrefixRouterParams().long.warm_margin_rel


def calibrate(router: Router, worker: WorkerId, factor: float) -> None:
    """Teach the cost model that ``worker`` runs ``factor`` times its profile."""
    for _ in range(300):
        router.cost.observe(worker, CostTerms(0.0, 1.0, 0.0, 0.0, 0.0), factor)


def test_unseen_prefixes_spread_by_requests_in_flight_within_the_margin() -> None:
    r = Router()
    calibrate(r, W0, 0.92)  # identical engines whose calibrations disagree by ~9%
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
    strict = Router(create_policy("prefixrouter", {"tie_band_rel": 0.0}))
    calibrate(strict, W0, 0.92)
    for w in (W0, W1):
        hold(strict, w, prompt)
    assert strict.route(request("s", prompt + tokens(2, 40)), ws, 1.0).worker_id == W0


def test_calibration_learns_the_observed_ratio() -> None:
    r = Router()
    calibrate(r, W0, 2.0)  # observed TTFTs twice what the profile predicts
    assert abs(r.cost.scale(W0) - 2.0) < 0.01
    d = r.route(request("c", tokens(5, 2_000)), workers(1), 1.0)
    assert candidate(d, W0).terms.scale == r.cost.scale(W0)  # type: ignore[attr-defined]


def test_demand_survives_a_clock_that_steps_back() -> None:
    r = Router()
    doc = tokens(1, 2_000)
    for t in (5.0, 1.0e9, 3.0):  # math.exp overflowed on the step back
        d = r.route(request(f"c{t}", doc + tokens(2, 10)), workers(2), t)
        r.on_routed(d, t)
    assert isinstance(r.policy, PrefixRouterPolicy)
    assert r.policy.prefix_rate(r.blocks_for(request("q", doc)).hashes[0], 3.0) > 0


def test_a_rejected_routing_is_taken_back_in_the_index_and_the_demand() -> None:
    router = Router()
    policy = router.policy
    assert isinstance(policy, PrefixRouterPolicy)
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
