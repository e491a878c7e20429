"""Peers' routings a replica cannot see yet: the estimate, and replicas routing behind it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from prefixrouter.core import (
    Decision,
    Dispatcher,
    PromptBlocks,
    Router,
    RoutingRequest,
    WorkerView,
)
from prefixrouter.core.router import Steering
from prefixrouter.core.unseen import MAX_REROUTES, UnseenPeers
from tests.core.conftest import request, tokens, workers

LAG = 0.01


def test_without_peers_or_without_lag_nothing_is_unseen() -> None:
    alone = UnseenPeers()
    for i in range(50):
        alone.on_own(i * 0.001)
    assert alone.expected == 0.0 and alone.ahead("r1", salt=7) == 0
    instant = UnseenPeers()  # peers' routings arrive the moment they are made
    for i in range(50):
        instant.on_own(i * 0.1)
        instant.on_peer("b@1", i * 0.1 + 0.05, i * 0.1 + 0.05)
    assert instant.expected == 0.0


def test_routings_further_apart_than_the_lag_all_see_each_other() -> None:
    u = UnseenPeers()
    for i in range(40):
        u.on_own(i * 0.1)
        u.on_peer("b@1", i * 0.1 + 0.05, i * 0.1 + 0.05 + LAG)
    assert u.expected == 0.0


def test_a_burst_of_m_simultaneous_routings_leaves_each_m_minus_1_over_2_unseen() -> None:
    u = UnseenPeers()
    m = 8
    for burst in range(30):
        t = burst * 1.0
        u.on_own(t)
        for peer in range(m - 1):
            u.on_peer(f"p{peer}@1", t, t + LAG)
    assert abs(u.expected - (m - 1) / 2) < 0.15  # the decay weighs a burst's later pairs more


def test_steady_traffic_leaves_the_other_replicas_rate_times_the_lag_unseen() -> None:
    u = UnseenPeers()
    # This replica routes every 40 ms, one peer every 4 ms (250/s), 10 ms lag:
    # about 2.5 of the peer's routings are unseen by each of ours, and each of
    # ours by about 0.25 of the peer's (in 10 ms after ours it routes 2.5, of 11).
    for i in range(2000):
        t = i * 0.004
        if i % 10 == 0:
            u.on_own(t)
        if i >= 3:
            u.on_peer("b@1", t - 0.012 + 0.002, t)
    pairs_per_routing = (2.5 + 2.5) / 11  # both directions, over 11 routings a cycle
    assert abs(u.expected - pairs_per_routing) < 0.1


def test_places_are_drawn_per_request_and_replica_uniformly_up_to_twice_the_estimate() -> None:
    u = UnseenPeers()
    for burst in range(30):
        u.on_own(float(burst))
        for peer in range(6):
            u.on_peer(f"p{peer}@1", float(burst), burst + LAG)
    span = 2 * u.expected  # about 6
    places = [u.ahead(f"r{i}", salt=3) for i in range(2000)]
    assert places == [u.ahead(f"r{i}", salt=3) for i in range(2000)]  # reproducible
    assert places != [u.ahead(f"r{i}", salt=4) for i in range(2000)]  # per replica
    assert min(places) == 0 and max(places) <= int(span) + 1
    assert abs(statistics.mean(places) - span / 2) < 0.3
    assert u.ahead("r1", salt=0) == 0  # one router never stands behind anyone


def _burst(replicas: list[Dispatcher], t: float, doc0: int) -> list[str]:
    """Each replica admits one new document at ``t`` on its own view; returns the workers.

    The view's workers differ by a few queued tokens, so no two are exact ties
    (replicas draw among exact ties without knowing of each other, see
    ``tie_band_picker``): the best is one worker, as a stale view of a busy
    fleet usually shows.
    """
    view = [replace(w, pending_prefill_tokens=k) for k, w in enumerate(workers(8))]
    return [
        d.admit(request(f"r{doc0 + i}", tokens(doc0 + i, 16 * 8)), view, t).worker
        for i, d in enumerate(replicas)
    ]


def _relay_all(replicas: list[Dispatcher], routed_at: float | None, now: float) -> None:
    batches = [d.drain_facts() for d in replicas]
    for i, facts in enumerate(batches):
        for j, d in enumerate(replicas):
            if j != i:
                for fact in facts:
                    d.apply_peer(f"r{i}@1", fact, now, routed_at)


def test_replicas_that_learnt_the_bursts_spread_the_next_one_instead_of_herding() -> None:
    def cluster() -> list[Dispatcher]:
        return [
            Dispatcher(Router("prefix_aware", replica_salt=101 + s), record_facts=True)
            for s in range(6)
        ]

    # Without knowing when the peers' routings were made (routed_at None), every
    # replica routes the second burst of new documents on one stale view: one worker.
    blind = cluster()
    _burst(blind, 0.0, 0)
    _relay_all(blind, None, LAG)
    assert len(set(_burst(blind, 1.0, 100))) == 1
    # Knowing it, each learnt that 5 others route in the same instant, and
    # routes behind its share of them: the burst spreads over idle workers.
    aware = cluster()
    assert len(set(_burst(aware, 0.0, 0))) == 1  # the first burst: nothing to learn from yet
    _relay_all(aware, 0.0, LAG)
    second = _burst(aware, 1.0, 100)
    assert len(set(second)) >= 3
    assert all(d.router.replica_salt for d in aware)


def test_many_stand_ins_cost_a_bounded_number_of_routings() -> None:
    d = Dispatcher(Router("prefix_aware", replica_salt=7), record_facts=True)
    peers = [Dispatcher(Router("prefix_aware"), record_facts=True) for _ in range(30)]
    d.admit(request("own0", tokens(500, 16 * 8)), workers(8), 0.0)
    for i, p in enumerate(peers):  # a burst of 31 at one instant: E about 15
        p.admit(request(f"p{i}", tokens(600 + i, 16 * 8)), workers(8), 0.0)
        for fact in p.drain_facts():
            d.apply_peer(f"p{i}@1", fact, LAG, 0.0)
    real, calls = d.router.route, []

    def counting(
        request: RoutingRequest,
        workers: Sequence[WorkerView],
        now: float,
        blocks: PromptBlocks | None = None,
        steering: Steering | None = None,
    ) -> Decision:
        calls.append(1)
        return real(request, workers, now, blocks, steering)

    d.router.route = counting  # type: ignore[method-assign]
    aheads = []
    for i in range(40):
        calls.clear()
        adm = d.admit(request(f"own{i + 1}", tokens(700 + i, 16 * 8)), workers(8), 1.0)
        aheads.append(adm.decision.reason)
        assert len(calls) <= 1 + MAX_REROUTES
    assert any(f"behind {n} unseen" in r for r in aheads for n in range(MAX_REROUTES + 1, 17))
