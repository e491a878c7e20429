"""Facts between dispatchers: a replica's routings, answers and worker changes, at a peer."""

from __future__ import annotations

import pytest

from prefixrouter.core import Dispatcher, Outcome, RequestId, Router, RoutingRequest, WorkerId
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.dispatch import Admission
from prefixrouter.core.facts import (
    CountedFact,
    FirstTokenFact,
    RoutedFact,
    SettledFact,
    Settlement,
    WorkerChange,
    WorkerFact,
)
from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.types import CacheNamespace, EntrySource
from tests.core.conftest import request, tokens, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")
DOC = tokens(1, 16 * 20)  # 20 blocks of 16 tokens


def replica(policy: str = "prefix_aware") -> Dispatcher:
    return Dispatcher(Router(policy), record_facts=True)


def relay(src: Dispatcher, dst: Dispatcher, origin: str = "a@1", now: float = 0.0) -> list[bool]:
    return [dst.apply_peer(origin, fact, now) for fact in src.drain_facts()]


def test_a_peers_routing_makes_the_document_warm_on_its_worker() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    assert relay(a, b) == [True]
    # B never saw the request, yet predicts it warm (speculative) on A's worker.
    again = b.admit(request("r2", DOC), workers(2), 1.0)
    assert again.worker == adm.worker
    assert again.decision.predicted_cached_tokens > 0
    assert b.load(adm.worker).in_flight == 2  # the peer's request counts in flight here


def test_a_peers_completion_confirms_the_chain_and_ends_its_in_flight_count() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.first_token(adm, 0.2)
    a.complete(adm, Outcome(0, 0.1), 0.5)
    facts = a.drain_facts()
    assert [type(f) for f in facts] == [RoutedFact, FirstTokenFact, SettledFact]
    assert [b.apply_peer("a@1", f, 1.0) for f in facts] == [True, True, True]
    assert b.load(adm.worker).in_flight == 0
    entry = b.router.index.entry(adm.worker, adm.blocks.hashes[-1])
    assert entry is not None and entry.source is EntrySource.CONFIRMED
    assert a.drain_facts() == [] and b.drain_facts() == []  # applied facts are not re-recorded


def test_a_peers_rejection_takes_its_routing_back() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.reject(adm, 0.1)
    assert relay(a, b) == [True, True]
    assert b.index_blocks(adm.worker) == 0
    assert b.load(adm.worker).in_flight == 0


def test_a_gone_peers_in_flight_counts_expire_but_its_placements_stay() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    relay(a, b)
    assert b.peer_inflight("a@1") == 1
    assert b.peer_gone("a@1") == 1
    assert b.load(adm.worker).in_flight == 0
    assert b.index_blocks(adm.worker) == 20  # the engine did get the request
    # A late settlement of the gone peer changes nothing.
    a.complete(adm, Outcome(320, 0.1), 1.0)
    assert relay(a, b) == [False]


def test_facts_of_one_origin_never_settle_another_origins_routing() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    (routed,) = a.drain_facts()
    assert b.apply_peer("a@1", routed, 0.0)
    assert not b.apply_peer("a@1", routed, 0.0)  # heard twice: applied once
    rejected = SettledFact(adm.request.request_id, Settlement.REJECTED, 0)
    assert not b.apply_peer("a@2", rejected, 1.0)  # a restarted A's facts: another origin
    assert b.load(adm.worker).in_flight == 1 and b.index_blocks(adm.worker) == 20


def test_another_tenants_facts_never_make_a_prefix_warm() -> None:
    a, b = replica(), replica()
    alice = CacheNamespace("m", tenant="tenant:alice")
    a.admit(request("r1", DOC, ns=alice), workers(2), 0.0)
    relay(a, b)
    bob = b.admit(request("r2", DOC, ns=CacheNamespace("m", tenant="tenant:bob")), workers(2), 1.0)
    assert bob.decision.predicted_cached_tokens == 0


def test_worker_changes_are_recorded_and_applied() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.complete(adm, Outcome(0, 0.1), 0.5)
    relay(a, b)
    a.worker_down(adm.worker, 2.0)
    a.worker_restarted(adm.worker, 3.0)
    facts = a.drain_facts()
    assert facts == [
        WorkerFact(adm.worker, WorkerChange.DOWN),
        WorkerFact(adm.worker, WorkerChange.RESTARTED),
    ]
    b.apply_peer("a@1", facts[0], 2.0)
    entry = b.router.index.entry(adm.worker, adm.blocks.hashes[0])
    assert entry is not None and entry.source is EntrySource.SPECULATIVE
    b.apply_peer("a@1", facts[1], 3.0)
    assert b.index_blocks(adm.worker) == 0


def test_a_dispatcher_not_recording_keeps_no_outbox() -> None:
    d = Dispatcher(Router("prefix_aware"))
    d.admit(request("r1", DOC), workers(2), 0.0)
    assert d.drain_facts() == []


def test_the_first_fact_of_a_batch_tells_the_listener_once() -> None:
    a = replica()
    calls: list[int] = []
    a.on_first_fact(lambda: calls.append(1))
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.first_token(adm, 0.2)
    a.complete(adm, Outcome(0, 0.1), 0.5)
    assert len(calls) == 1  # one batch: told once, when the outbox was empty
    assert len(a.drain_facts()) == 3
    a.worker_down(adm.worker, 1.0)
    assert len(calls) == 2
    a.on_first_fact(None)
    a.drain_facts()
    a.worker_restarted(adm.worker, 2.0)
    assert len(calls) == 2


def test_peer_routings_older_than_the_bound_expire_and_younger_stay() -> None:
    a, b = replica(), replica()
    old = a.admit(request("r1", DOC), workers(2), 0.0)
    relay(a, b, now=0.0)
    a.admit(request("r2", tokens(2, 16 * 4)), workers(2), 5.0)
    relay(a, b, now=5.0)
    assert b.peer_inflight("a@1") == 2
    assert b.peer_expire(before=3.0) == 1  # r1's settlement never came
    assert b.peer_inflight("a@1") == 1
    assert b.index_blocks(old.worker) >= 20  # its placement stays
    a.complete(old, Outcome(320, 0.1), 6.0)
    assert relay(a, b, now=6.0) == [False]  # a late settlement changes nothing


def test_a_completions_prompt_length_teaches_characters_per_token_here_and_at_peers() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.complete(adm, Outcome(0, 0.1), 0.5, prompt_chars=1200, prompt_tokens=200)
    routed, settled = a.drain_facts()
    assert isinstance(settled, SettledFact)
    assert (settled.prompt_chars, settled.prompt_tokens) == (1200, 200)
    # 6.0 characters per token observed: the first answer sets the estimate, here and there.
    assert a.chars_per_token == pytest.approx(6.0) and b.chars_per_token == 4.0
    assert b.apply_peer("a@1", routed, 0.0) and b.apply_peer("a@1", settled, 1.0)
    assert b.chars_per_token == pytest.approx(a.chars_per_token)


def test_a_completion_without_an_observation_records_none_and_teaches_nothing() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.complete(adm, Outcome(0, 0.1), 0.5, prompt_chars=1200)  # no token count: no observation
    facts = a.drain_facts()
    assert [b.apply_peer("a@1", f, 1.0) for f in facts] == [True, True]
    settled = facts[-1]
    assert isinstance(settled, SettledFact)
    assert (settled.prompt_chars, settled.prompt_tokens) == (0, 0)
    assert a.chars_per_token == b.chars_per_token == 4.0


def test_a_peers_answer_calibrates_the_workers_speed_as_the_origins_does() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    predicted = adm.decision.predicted_ttft_s
    assert predicted is not None and predicted > 0
    a.complete(adm, Outcome(0, 3 * predicted), 0.5)  # the worker is three times slower
    routed, settled = a.drain_facts()
    assert isinstance(routed, RoutedFact) and isinstance(settled, SettledFact)
    assert routed.predicted_ttft_s == pytest.approx(predicted)  # scale 1 at the start
    assert settled.ttft_s == pytest.approx(3 * predicted)
    assert a.router.cost.scale(adm.worker) > 1.0
    assert b.apply_peer("a@1", routed, 0.0) and b.apply_peer("a@1", settled, 1.0)
    assert b.router.cost.scale(adm.worker) == pytest.approx(a.router.cost.scale(adm.worker))
    other = W1 if adm.worker == W0 else W0
    assert b.router.cost.scale(other) == 1.0


def test_an_answer_without_a_measured_ttft_calibrates_nothing_at_peers() -> None:
    a, b = replica(), replica()
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.complete(adm, Outcome(0, None), 0.5)
    routed, settled = a.drain_facts()
    assert isinstance(settled, SettledFact) and settled.ttft_s == -1.0
    assert b.apply_peer("a@1", routed, 0.0) and b.apply_peer("a@1", settled, 1.0)
    assert b.router.cost.scale(adm.worker) == 1.0


def test_an_engines_token_count_teaches_the_prefix_here_and_at_peers() -> None:
    """Text mode: ``counted`` (the engine's /tokenize) travels as a CountedFact."""

    def text_replica() -> Dispatcher:
        return Dispatcher(Router("prefix_aware", BlockHasher()), "text", record_facts=True)

    ns = CacheNamespace("m")
    doc = "abcdefghij" * 2_000  # 20,000 characters the engine counts 5 to a token

    def ask(d: Dispatcher, rid: str) -> Admission:
        req = RoutingRequest(RequestId(rid), ns, text=doc + f" question {rid}")
        return d.admit(req, workers(2), 0.0)

    a, b = text_replica(), text_replica()
    adm = ask(a, "r1")
    assert a.wants_token_count(adm)
    a.counted(adm, len(doc) + 12, (len(doc) + 12) // 5)
    routed, counted = a.drain_facts()
    assert isinstance(routed, RoutedFact) and isinstance(counted, CountedFact)
    assert counted.prompt_tokens == (len(doc) + 12) // 5
    assert b.apply_peer("a@1", routed, 0.0) and b.apply_peer("a@1", counted, 0.0)
    later = ask(b, "r2")
    assert not b.wants_token_count(later)
    # B predicts the peer's copy at the document's own 5 characters a token.
    assert abs(later.decision.predicted_cached_tokens - 4_000) <= 200
    assert not any(isinstance(f, CountedFact) for f in b.drain_facts())  # not re-recorded
    # A count of a routing never heard here is refused.
    assert not b.apply_peer("a@1", CountedFact(RequestId("nope"), 100, 20), 0.0)


def test_a_restarted_engine_takes_the_fleets_best_calibration_here_and_at_peers() -> None:
    a, b = replica(), replica()
    for w, factor in ((W0, 0.5), (W1, 1.5)):  # w1 learned a slow factor under its old load
        for _ in range(100):
            a.router.cost.observe(w, CostTerms(0.0, 1.0, 0.0, 0.0, 0.0), factor)
            b.router.cost.observe(w, CostTerms(0.0, 1.0, 0.0, 0.0, 0.0), factor)
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    a.complete(adm, Outcome(0, None), 0.5)
    a.drain_facts()
    held = a.index_blocks(adm.worker)
    # Its KV events reported the restart first: the entries stay, nothing is published.
    a.worker_restarted(adm.worker, 1.0, clear_entries=False)
    fleet = a.router.cost.scale(W1 if adm.worker == W0 else W0)
    assert a.router.cost.scale(adm.worker) == pytest.approx(fleet, rel=1e-5)
    assert a.index_blocks(adm.worker) == held and a.drain_facts() == []
    # Seen from its metrics: entries cleared, and the peers do the same.
    other = W1 if adm.worker == W0 else W0
    a.worker_restarted(other, 2.0)
    assert a.index_blocks(other) == 0
    assert relay(a, b) == [True]
    assert b.router.cost.scale(other) == pytest.approx(b.router.cost.scale(adm.worker), rel=1e-5)


def test_a_shortfall_behind_a_running_prefill_costs_no_trust_here_or_at_peers() -> None:
    # r2 is predicted warm on r1's worker from r1's routing alone (nothing
    # confirmed it) and reuses nothing: r1 was still prefilling. The origin
    # does not count that against the worker's cache; neither may a peer,
    # which would otherwise score the worker cold and send the document
    # elsewhere while the origin keeps it (replicas at no lag diverged so).
    a, b = replica(), replica()
    first = a.admit(request("r1", DOC), workers(2), 0.0)
    second = a.admit(request("r2", [*DOC, *tokens(2, 16)]), workers(2), 0.01)
    assert second.worker == first.worker and second.decision.predicted_cached_tokens > 0
    assert second.decision.rests_on_speculative
    a.complete(second, Outcome(0, 0.2), 0.3)
    a.complete(first, Outcome(0, 0.2), 0.3)
    facts = a.drain_facts()
    routed = [f for f in facts if isinstance(f, RoutedFact)]
    assert [f.speculative for f in routed] == [False, True]
    assert all(b.apply_peer("a@1", f, 0.3) for f in facts)
    assert a.router.index.unexplained_misses == b.router.index.unexplained_misses == 0
    assert b.router.index.trust(first.worker, 0.3) == a.router.index.trust(first.worker, 0.3) == 1.0
