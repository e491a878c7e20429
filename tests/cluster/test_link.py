"""Two nodes over a real nats-server: every fact applied exactly once across the switches.

A publishes a steady stream of routings and settlements; B starts while it
does (it replays the stream, holding what it hears live, then switches to
live), then the NATS server is stopped and restarted with its store while A
keeps publishing (A's client buffers; B catches up from the stream and goes
live again). B must apply every fact the stream kept, each once, and
nothing A did not publish; facts are told apart by kind and request id. What
the server itself lost when it stopped (written by A's client just before,
never stored: core publish has no acknowledgement) B counts as missed,
unless it heard the message live before the stop: such a fact is applied
though the stream no longer holds it, so B's facts are the stream's plus
those, and its missed messages are exactly the ones it never took.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from prefixrouter.cluster import envelope
from prefixrouter.cluster.codec import decode_facts
from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.node import ClusterNode, NodeOptions
from prefixrouter.cluster.transport import LinkOptions
from prefixrouter.core import Dispatcher, Outcome, Router
from prefixrouter.core.facts import Fact
from prefixrouter.harness.nats import NatsServer
from tests.cluster.live import BOUND_S
from tests.core.conftest import request, tokens, workers

FIELDS = {"routing.mode": "token", "routing.block_size": "16"}


def _node(url: str, replica: str) -> ClusterNode:
    opts = NodeOptions(
        LinkOptions(url, cluster="link-test", reconnect_s=0.1),
        replica,
        heartbeat_s=0.2,
        peer_ttl_s=30.0,  # no peer life ends during the outage: every fact must land
    )
    dispatcher = Dispatcher(Router("prefix_aware"), record_facts=True)
    return ClusterNode(opts, dispatcher, lambda _w: True, Fingerprint.of(FIELDS))


async def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


FactId = tuple[str, str]  # a fact's kind and its request id


def _fact_id(fact: object) -> FactId:
    return type(fact).__name__, str(getattr(fact, "request_id", ""))


async def _kept(url: str, stream: str, subject: str) -> tuple[int, set[FactId]]:
    """The facts messages and the facts the stream holds (read with a fresh consumer)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subject, stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        pending = (await sub.consumer_info()).num_pending or 0
        messages = 0
        facts: set[FactId] = set()
        while pending:
            for msg in await sub.fetch(min(pending, 256), timeout=5):
                _, body = envelope.unpack(msg.data)
                messages += 1
                facts.update(_fact_id(f) for f in decode_facts(body))
                pending -= 1
        return messages, facts
    finally:
        await nc.close()


def test_every_fact_is_applied_once_across_replay_switch_and_nats_restart() -> None:
    async def body(nats: NatsServer) -> None:
        a = _node(nats.url, "a")
        b = _node(nats.url, "b")
        # What B applies, fact by fact, and how many of A's messages it takes
        # (a message is taken when B's last sequence number for A moves).
        applied: Counter[FactId] = Counter()
        taken = 0
        apply_peer, apply_message = b.dispatcher.apply_peer, b._apply

        def recording_apply_peer(
            origin: str, fact: Fact, now: float, routed_at: float | None = None
        ) -> bool:
            ok = apply_peer(origin, fact, now, routed_at)
            if ok:
                applied[_fact_id(fact)] += 1
            return ok

        def counting_apply(data: bytes, live: bool, now: float, wall: float) -> None:
            nonlocal taken
            before = dict(b._heard)
            apply_message(data, live, now, wall)
            taken += b._heard != before

        b.dispatcher.apply_peer = recording_apply_peer  # type: ignore[method-assign]
        b._apply = counting_apply  # type: ignore[method-assign]
        await a.start()
        await _until(lambda: a.link.replayed, "a to connect")
        started_b = stopped = restarted = False
        try:
            for i in range(600):
                adm = a.dispatcher.admit(request(f"r{i}", tokens(i * 1000, 64)), workers(2), i)
                a.dispatcher.complete(adm, Outcome(0, 0.01), i + 0.5)
                if i == 150:  # B joins mid-stream: replay, held live messages, switch
                    await b.start()
                    started_b = True
                if i == 300:
                    await _until(lambda: b.link.replayed, "b to replay")
                    await asyncio.to_thread(nats.stop)
                    stopped = True
                if i == 400:
                    await asyncio.to_thread(nats.start)
                    restarted = True
                await asyncio.sleep(0.002)
            assert started_b and stopped and restarted
            await _until(lambda: a.connected, "a to reconnect")
            await a.flush()
            assert a.stats.dropped == {}  # a's client buffered through the outage
            assert a.stats.published_facts == 1200
            opts = a.link.options
            messages, kept = await _kept(nats.url, a.link.stream, opts.facts_subject)
            assert len(kept) > 1000  # the server kept most of it (it may lose what was in flight)
            await _until(
                lambda: kept <= applied.keys() and b.link.live and b.link.connected,
                f"b to apply the {len(kept)} facts the stream kept (applied {b.stats})",
            )
            published = {
                (kind, f"r{i}") for i in range(600) for kind in ("RoutedFact", "SettledFact")
            }
            assert max(applied.values()) == 1  # each fact once
            assert kept <= applied.keys() <= published  # all the stream kept, nothing else
            assert b.stats.applied_facts == applied.total()
            assert taken >= messages
            assert b.stats.missed_messages == a.stats.published_messages - taken
            assert b.stats.dropped.keys() <= {"unmatched"}  # a lost routing's settlement
            assert b.link.catch_ups >= 2  # the replay, and after the restart
        finally:
            await b.stop()
            await a.stop()

    with NatsServer() as nats:
        asyncio.run(body(nats))
