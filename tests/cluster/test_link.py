"""Two nodes over a real nats-server: every fact applied exactly once across the switches.

A publishes a steady stream of routings and settlements; B starts while it
does (it replays the stream, holding what it hears live, then switches to
live), then the NATS server is stopped and restarted with its store while A
keeps publishing (A's client buffers; B catches up from the stream and goes
live again). B must end with exactly the facts the stream kept applied, each
once: a fact applied twice shows up as more applied than kept (a routing
applied again after its settlement opens anew); one lost, as fewer. What the
server itself lost when it stopped (written by A's client just before, never
stored: core publish has no acknowledgement) is what B counts as missed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from prefixrouter.cluster import envelope
from prefixrouter.cluster.codec import decode_facts
from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.node import ClusterNode, NodeOptions
from prefixrouter.cluster.transport import LinkOptions
from prefixrouter.core import Dispatcher, Outcome, Router
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


async def _kept(url: str, stream: str, subject: str) -> tuple[int, int]:
    """The facts messages and the facts the stream holds (read with a fresh consumer)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subject, stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        pending = (await sub.consumer_info()).num_pending or 0
        messages = facts = 0
        while pending:
            for msg in await sub.fetch(min(pending, 256), timeout=5):
                _, body = envelope.unpack(msg.data)
                messages += 1
                facts += len(decode_facts(body))
                pending -= 1
        return messages, facts
    finally:
        await nc.close()


def test_every_fact_is_applied_once_across_replay_switch_and_nats_restart() -> None:
    async def body(nats: NatsServer) -> None:
        a = _node(nats.url, "a")
        b = _node(nats.url, "b")
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
            assert kept > 1000  # the server kept most of it (it may lose what was in flight)
            await _until(
                lambda: b.stats.applied_facts >= kept and b.link.live and b.link.connected,
                f"b to apply the {kept} facts the stream kept (applied {b.stats})",
            )
            assert b.stats.applied_facts == kept
            assert b.stats.missed_messages == a.stats.published_messages - messages
            assert b.stats.dropped.keys() <= {"unmatched"}  # a lost routing's settlement
            assert b.link.catch_ups >= 2  # the replay, and after the restart
        finally:
            await b.stop()
            await a.stop()

    with NatsServer() as nats:
        asyncio.run(body(nats))
