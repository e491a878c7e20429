"""A replica's node without NATS: what it applies, drops and counts, and when it refuses to join.

Messages are fed to :meth:`ClusterNode.on_facts` and :meth:`ClusterNode.on_heartbeat`
as the link would, built by the codec and the envelope from a second
dispatcher's real facts.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import orjson
import pytest

from prefixrouter.cluster import envelope
from prefixrouter.cluster.codec import encode_facts
from prefixrouter.cluster.envelope import FACTS, HEARTBEAT, Envelope
from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.node import ClusterNode, NodeOptions
from prefixrouter.cluster.transport import LinkOptions, NatsLink
from prefixrouter.core import Dispatcher, Outcome, Router, WorkerId
from prefixrouter.core.facts import Fact, WorkerChange, WorkerFact
from tests.core.conftest import request, tokens, workers

DOC = tokens(1, 16 * 20)
FIELDS = {"routing.mode": "token", "routing.block_size": "16"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def node(
    replica: str = "b", fields: dict[str, str] = FIELDS, ttl: float = 5.0, hold: float = 0.0
) -> ClusterNode:
    opts = NodeOptions(
        LinkOptions("nats://127.0.0.1:1"),
        replica,
        heartbeat_s=1.0,
        peer_ttl_s=ttl,
        apply_within_s=hold,
    )
    known = {WorkerId("w0"), WorkerId("w1")}
    lags: list[float] = []
    n = ClusterNode(
        opts,
        Dispatcher(Router("prefix_aware"), record_facts=True),
        known.__contains__,
        Fingerprint.of(fields),
        Clock(),
        lags.append,
    )
    return n


def message(
    facts: list[Fact],
    replica: str = "a",
    epoch: int = 7,
    fields: dict[str, str] = FIELDS,
    seq: int = 0,
) -> bytes:
    head = Envelope(FACTS, replica, epoch, Fingerprint.of(fields).value, time.time(), seq)
    (body,) = encode_facts(facts)
    return envelope.pack(head, body)


def peer_heartbeat(replica: str = "a", epoch: int = 7) -> bytes:
    head = Envelope(HEARTBEAT, replica, epoch, Fingerprint.of(FIELDS).value, time.time())
    return envelope.pack(head, orjson.dumps({"fields": dict(Fingerprint.of(FIELDS).fields)}))


def peer_facts() -> tuple[Dispatcher, list[Fact], WorkerId]:
    a = Dispatcher(Router("prefix_aware"), record_facts=True)
    adm = a.admit(request("r1", DOC), workers(2), 0.0)
    return a, a.drain_facts(), adm.worker


def test_a_peers_routing_is_applied_and_predicts_warm_here() -> None:
    b = node()
    _, facts, worker = peer_facts()
    b.on_facts(message(facts), live=True)
    assert b.stats.applied_facts == 1 and b.stats.dropped == {}
    assert b.dispatcher.peer_inflight("a@7") == 1
    again = b.dispatcher.admit(request("r2", DOC), workers(2), 1.0)
    assert again.worker == worker and again.decision.predicted_cached_tokens > 0
    assert len(b.stats.lags) == 1 and b.stats.sync_cpu_s > 0


def test_own_facts_are_skipped_and_others_dropped_by_reason() -> None:
    b = node()
    _, facts, _ = peer_facts()
    b.on_facts(message(facts, replica="b", epoch=b.epoch), live=True)  # its own
    assert b.stats.applied_facts == 0 and b.stats.dropped == {}
    b.on_facts(message(facts, fields={**FIELDS, "routing.block_size": "32"}), live=True)
    b.on_facts(message([WorkerFact(WorkerId("w9"), WorkerChange.DOWN)]), live=True)
    b.on_facts(message(facts, epoch=9), live=True)  # a restarted: epoch 7 has ended
    b.on_facts(message(facts, epoch=7), live=True)
    b.on_facts(b"\x01", live=True)
    assert b.stats.dropped == {
        "fingerprint": 1,
        "unknown_worker": 1,
        "stale_epoch": 1,
        "malformed": 1,
    }
    assert b.stats.peers_gone == 1  # a@7 ended by a@9
    assert b.dispatcher.peer_inflight("a@7") == 0 and b.dispatcher.peer_inflight("a@9") == 1


def test_a_settlement_of_a_routing_never_heard_is_unmatched() -> None:
    b = node()
    a, _, _ = peer_facts()
    adm = a.admit(request("r2", DOC), workers(2), 1.0)
    a.drain_facts()
    a.complete(adm, Outcome(320, 0.1), 2.0)
    b.on_facts(message(a.drain_facts()), live=True)
    assert b.stats.dropped == {"unmatched": 1}


def test_a_silent_peers_in_flight_counts_expire_after_the_ttl() -> None:
    b = node(ttl=5.0)
    _, facts, worker = peer_facts()
    b.on_facts(message(facts), live=True)
    assert b.dispatcher.load(worker).in_flight == 1
    clock = b.clock
    assert isinstance(clock, Clock)
    clock.now += 4.0
    assert b.sweep() == []
    clock.now += 2.0
    assert b.sweep() == ["a@7"]
    assert b.stats.expired_routings == 0
    assert b.dispatcher.load(worker).in_flight == 0
    assert b.dispatcher.index_blocks(worker) == 20  # the placement stays


def test_a_starting_replica_is_refused_by_an_older_live_peer_that_differs() -> None:
    async def body() -> None:
        old = node("a", {**FIELDS, "routing.block_size": "32"})
        await asyncio.sleep(0)  # a later epoch
        new = node("b")
        new.on_heartbeat(old.heartbeat_message(hello=False))
        assert new.failed.is_set() and new.error is not None
        assert "routing.block_size" in new.error and "'a'" in new.error
        # The older replica only drops the newcomer's facts: it is not refused.
        old.on_heartbeat(new.heartbeat_message(hello=True))
        assert not old.failed.is_set()

    asyncio.run(body())


def test_a_starting_replica_is_refused_by_a_live_older_replica_with_its_own_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        old = node("a")
        await asyncio.sleep(0)  # a later epoch
        new = node("a")
        new.on_heartbeat(old.heartbeat_message(hello=False))
        assert new.failed.is_set() and new.error is not None
        assert f"live replica {old.origin} already uses the id 'a'" in new.error
        assert new.status == "refused" and not new.ready
        # The older one, running (past its check), logs the duplicate once, keeps
        # running and answers the newcomer's hello at once (so it is refused fast).
        old._checked = True
        with caplog.at_level("ERROR", logger="prefixrouter.cluster"):
            old.on_heartbeat(new.heartbeat_message(hello=True))
            old.on_heartbeat(new.heartbeat_message(hello=False))
        assert not old.failed.is_set() and old.error is None
        assert old._heartbeat_now.is_set()
        dup = [r for r in caplog.records if "uses this replica's id" in r.getMessage()]
        assert len(dup) == 1 and new.origin in dup[0].getMessage()

    asyncio.run(body())


def test_a_refused_replica_says_it_once() -> None:
    async def body() -> None:
        a = node("a", {**FIELDS, "routing.block_size": "32"})
        c = node("c", {**FIELDS, "routing.block_size": "64"})
        await asyncio.sleep(0)
        b = node("b")
        b.on_heartbeat(a.heartbeat_message(hello=False))
        first = b.error
        b.on_heartbeat(c.heartbeat_message(hello=False))  # a second peer that differs
        assert b.error == first and "'a'" in (first or "")
        assert b._warned == set()  # no "its facts are dropped" line beside the refusal

    asyncio.run(body())


def test_a_message_of_another_release_is_ignored_and_counted_not_refused() -> None:
    async def body() -> None:
        b = node("b")
        data = bytearray(peer_heartbeat("a", 1))
        data[0] = envelope.VERSION - 1  # an older release's wire version
        b.on_heartbeat(bytes(data))
        _, facts, _ = peer_facts()
        old = bytearray(message(facts, "a", 1, seq=1))
        old[0] = envelope.VERSION - 1
        b.on_facts(bytes(old), live=False)
        assert b.stats.dropped == {"other_version": 2}
        assert b.error is None and b.registry.live() == []

    asyncio.run(body())


def test_status_says_connecting_then_standalone_after_the_wait() -> None:
    async def body() -> None:
        opts = NodeOptions(LinkOptions("nats://127.0.0.1:1"), "b", ready_without_nats_s=30.0)
        clock = Clock()
        b = ClusterNode(
            opts,
            Dispatcher(Router("prefix_aware"), record_facts=True),
            lambda w: True,
            Fingerprint.of(FIELDS),
            clock,
        )
        b._started = clock.now  # as start() records it (without connecting anywhere)
        assert b.status == "connecting" and not b.ready
        clock.now += 29.9
        assert not b.ready
        clock.now += 0.2
        assert b.status == "standalone" and b.ready
        never = ClusterNode(
            NodeOptions(LinkOptions("nats://127.0.0.1:1"), "c"),  # None: wait for NATS
            Dispatcher(Router("prefix_aware"), record_facts=True),
            lambda w: True,
            Fingerprint.of(FIELDS),
            clock,
        )
        never._started = clock.now - 3600.0
        assert never.status == "connecting" and not never.ready

    asyncio.run(body())


def test_a_compatible_heartbeat_makes_a_live_peer() -> None:
    async def body() -> None:
        a, b = node("a"), node("b")
        b.on_heartbeat(a.heartbeat_message(hello=True))
        assert [p.origin for p in b.registry.live()] == [a.origin]
        assert b.error is None and not b.ready  # not replayed yet

    asyncio.run(body())


def test_facts_drained_without_a_connection_are_dropped_and_counted() -> None:
    async def body() -> None:
        b = node()
        b.dispatcher.admit(request("r1", DOC), workers(2), 0.0)
        await b.flush()
        assert b.stats.dropped == {"disconnected": 1}
        assert b.dispatcher.drain_facts() == []  # the outbox never grows without a link

    asyncio.run(body())


def test_a_replica_that_lost_facts_starts_a_new_life() -> None:
    async def body() -> None:
        b = node()

        async def takes(data: bytes) -> bool:
            return True

        b.link.publish_facts = takes  # type: ignore[method-assign]
        b.dispatcher.admit(request("r1", DOC), workers(2), 0.0)
        await b.flush()
        first = b.origin
        assert b.stats.published_facts == 1

        async def refuses(data: bytes) -> bool:
            return False

        b.link.publish_facts = refuses  # type: ignore[method-assign]
        b.dispatcher.admit(request("r2", DOC), workers(2), 1.0)
        await b.flush()
        assert b.stats.dropped == {"disconnected": 1}
        assert b.origin != first  # peers end the old life: nothing of it stays open
        # Its own messages under the new epoch are still its own.
        _, facts, _ = peer_facts()
        b.on_facts(message(facts, replica="b", epoch=b.epoch), live=True)
        assert b.stats.applied_facts == 0
        # Another drop with nothing published in this life keeps the epoch.
        b.dispatcher.admit(request("r3", DOC), workers(2), 2.0)
        second = b.origin
        await b.flush()
        assert b.origin == second

    asyncio.run(body())


def test_a_live_peers_routing_whose_settlement_never_came_expires() -> None:
    b = node(ttl=5.0)
    _, facts, worker = peer_facts()
    b.on_facts(message(facts), live=True)
    clock = b.clock
    assert isinstance(clock, Clock)
    for _ in range(4):  # 1,200 s > max_open_s (900); the peer stays alive meanwhile
        clock.now += 300.0
        b.on_heartbeat(peer_heartbeat())
        b.sweep()
    assert b.stats.expired_routings == 1 and b.stats.peers_gone == 0
    assert b.dispatcher.load(worker).in_flight == 0


def test_a_message_heard_twice_or_late_is_applied_once_and_a_jump_counts_the_missed() -> None:
    b = node()
    a = Dispatcher(Router("prefix_aware"), record_facts=True)
    msgs = []
    for i in range(5):
        a.admit(request(f"r{i}", DOC), workers(2), float(i))
        msgs.append(message(a.drain_facts(), seq=i + 1))
    b.on_facts(msgs[0], live=False)  # the catch-up reads 1 and 2 ...
    b.on_facts(msgs[1], live=False)
    b.on_facts(msgs[1], live=True)  # ... and the live subscription held 2 and 3
    b.on_facts(msgs[2], live=True)
    b.on_facts(msgs[0], live=True)  # late: older than what was taken
    assert b.stats.applied_facts == 3 and b.stats.duplicate_messages == 2
    assert b.stats.dropped == {}  # a duplicate is not a drop: its facts were applied
    b.on_facts(msgs[4], live=True)  # 4 never came
    assert b.stats.missed_messages == 1 and b.stats.applied_facts == 4
    assert b.dispatcher.peer_inflight("a@7") == 4
    # A new life numbers from 1 again; the old life's numbering does not hold it back.
    b.on_facts(message(peer_facts()[1], epoch=8, seq=1), live=True)
    assert b.dispatcher.peer_inflight("a@8") == 1 and b.stats.missed_messages == 1


def test_windows_double_while_facts_keep_coming_and_reset_after_a_quiet_spell() -> None:
    b = node()  # 2 ms base, 4 ms at most
    assert b.next_window(10.0) == 0.002  # quiet: a lone fact goes at once (10 s > 2 ms)
    b.window_s = b.next_window(0.001)  # the next fact came 1 ms after the publish
    assert b.window_s == 0.004
    b.window_s = b.next_window(0.0)
    assert b.window_s == 0.004  # capped
    b.window_s = b.next_window(0.005)  # a gap longer than the window: quiet again
    assert b.window_s == 0.002


def _publishing(b: ClusterNode) -> list[tuple[float, bytes]]:
    sent: list[tuple[float, bytes]] = []

    async def takes(data: bytes) -> bool:
        sent.append((time.monotonic(), data))
        return True

    b.link.publish_facts = takes  # type: ignore[method-assign]
    return sent


def test_a_lone_fact_is_published_when_its_tick_ends_and_a_busy_spell_is_spaced_by_windows() -> (
    None
):
    async def body() -> None:
        b = node()
        sent = _publishing(b)
        task = asyncio.get_running_loop().create_task(b._publisher())
        await asyncio.sleep(0)  # the publisher listens
        # Routed and answered in one callback: one message, once the callback returns.
        adm = b.dispatcher.admit(request("r1", DOC), workers(2), 0.0)
        b.dispatcher.complete(adm, Outcome(0, 0.1), 0.0)
        assert sent == []  # not inside the recording call
        for _ in range(3):  # a few loop turns, no timer: no window was waited
            await asyncio.sleep(0)
        assert len(sent) == 1 and b.stats.published_facts == 2
        head, _ = envelope.unpack(sent[0][1])
        assert time.time() - head.sent_wall < 1.0  # dated by its first fact
        # Facts that keep coming: one message per window, none waits longer than the longest.
        start = time.monotonic()
        for i in range(20):  # a fact per loop turn: microseconds apart
            b.dispatcher.admit(request(f"s{i}", tokens(100 + i, 64)), workers(2), 1.0)
            await asyncio.sleep(0)
        for _ in range(100):  # bounded: 1 s at most
            if b.stats.published_facts == 22:
                break
            await asyncio.sleep(0.01)
        assert b.stats.published_facts == 22
        busy = [t for t, _ in sent[1:]]
        assert len(busy) < 10  # batched (a loaded machine may stall a turn past a window)
        assert all(t2 - t1 >= 0.0019 for t1, t2 in itertools.pairwise(busy))
        assert busy[0] - start < 0.5  # a bound for a loaded machine, far above the window
        task.cancel()

    asyncio.run(body())


def test_a_message_over_the_servers_limit_is_dropped_and_counted_without_a_new_life(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(NatsLink, "max_payload", property(lambda self: 64 * 1024))

    async def body() -> None:
        b = node()
        sent = _publishing(b)
        origin = b.origin
        huge = tokens(3, 16 * 20_000)  # 20,000 blocks: 160 KB of hashes, over 64 KB
        b.dispatcher.admit(request("big", huge), workers(2), 0.0)
        b.dispatcher.admit(request("small", DOC), workers(2), 0.0)
        await b.flush()
        # The big routing alone is lost; the small one goes in a message of its own.
        assert b.stats.dropped == {"too_large": 1}
        assert b.stats.published_facts == 1 and len(sent) == 1
        assert b.origin == origin  # nothing of the lost fact is open anywhere

    asyncio.run(body())


def test_held_peer_facts_are_applied_before_the_next_routing_or_within_the_bound() -> None:
    async def body() -> None:
        b = node(hold=0.05)
        a, facts, worker = peer_facts()
        b.on_facts(message(facts, seq=1), live=True)
        assert b.stats.applied_facts == 0 and len(b.stats.lags) == 0  # held
        # Routing reads the state: what was heard before is applied first.
        again = b.dispatcher.admit(request("r2", DOC), workers(2), 1.0)
        assert b.stats.applied_facts == 1 and len(b.stats.lags) == 1
        assert again.worker == worker and again.decision.predicted_cached_tokens > 0
        # Heard while nothing reads the state: applied once the bound has passed.
        a.admit(request("r3", tokens(9, 16 * 20)), workers(2), 2.0)
        b.on_facts(message(a.drain_facts(), seq=2), live=True)
        assert b.stats.applied_facts == 1
        for _ in range(200):  # bounded: 2 s at most for a 50 ms bound
            if b.stats.applied_facts == 2:
                break
            await asyncio.sleep(0.01)
        assert b.stats.applied_facts == 2 and b.dispatcher.peer_inflight("a@7") == 2
        # A catch-up's message (not live) is applied at once, after anything held.
        a.admit(request("r4", tokens(11, 16 * 20)), workers(2), 3.0)
        b.on_facts(message(a.drain_facts(), seq=3), live=True)
        a.admit(request("r5", tokens(12, 16 * 20)), workers(2), 3.0)
        b.on_facts(message(a.drain_facts(), seq=4), live=False)
        assert b.stats.applied_facts == 4 and b.stats.duplicate_messages == 0

    asyncio.run(body())


def test_held_facts_wait_through_heartbeats_and_sweeps_that_change_nothing() -> None:
    async def body() -> None:
        b = node(hold=5.0)
        b.on_heartbeat(peer_heartbeat())  # a@7 is a live peer
        _, facts, _ = peer_facts()
        b.on_facts(message(facts, seq=1), live=True)
        b.on_heartbeat(peer_heartbeat())  # the same life: nothing to order against
        b.sweep()  # nobody silent
        assert b.stats.applied_facts == 0 and b.stats.apply_passes == 0
        # A heartbeat of a new life ends the old one: what it said before goes first.
        b.on_heartbeat(peer_heartbeat(epoch=8))
        assert b.stats.applied_facts == 1 and b.stats.peers_gone == 1
        assert b.dispatcher.peer_inflight("a@7") == 0  # applied, then settled by the end

    asyncio.run(body())
