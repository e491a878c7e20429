"""The ZMQ subscriber: real sockets on loopback, vLLM's framing, gaps, restarts, replay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.events import AllBlocksCleared
from prefixrouter.core.hashing import BlockHasher, hash_token_blocks
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import EntrySource, WorkerId
from prefixrouter.harness.ports import free_port
from prefixrouter.real_engines.kv_events import END_SEQ
from prefixrouter.real_engines.kv_subscriber import (
    KvEventCollector,
    KvEventSubscriber,
    parse_replay_reply,
)
from prefixrouter.simulated_engine.kv_publisher import KvEventPublisher, binds
from tests.real_engines import fake_publisher
from tests.real_engines.fake_publisher import (
    BS,
    OTHER,
    OTHERS,
    SEED,
    BoundEngine,
    W,
    frames,
    payload,
    sources,
    store,
    subscribers,
    wait_for,
)

TOKENS = fake_publisher.TOKENS[:16]  # the shared document's first four blocks
OURS = fake_publisher.OURS[:4]


@asynccontextmanager
async def feed() -> AsyncIterator[tuple[KvEventSubscriber, zmq.asyncio.Socket, Router]]:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{free_port()}", Dispatcher(router), lambda: 10.0)
    sub.add_worker(W, "kv@w0", lambda lora, salt: SEED)
    await sub.start()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    assert sub.endpoint is not None  # given above: this subscriber binds
    pub.connect(sub.endpoint)  # as vLLM does: the engine connects, the router binds
    # Slow joiner: probe with an unknown topic until the subscriber hears it.
    for _ in range(200):
        await pub.send_multipart(frames("probe", 0, []))
        await asyncio.sleep(0.01)
        if sub.unknown_topics:
            break
    assert sub.unknown_topics, "the subscriber never heard the publisher"
    try:
        yield sub, pub, router
    finally:
        pub.close()
        ctx.term()
        await sub.stop()


def exported(sub: KvEventSubscriber) -> str:
    """The collector's samples, one ``name{labels} value`` a line."""
    return "\n".join(
        f"{s.name}{s.labels} {s.value}" for f in KvEventCollector(sub).collect() for s in f.samples
    )


def held(router: Router) -> int:
    return fake_publisher.held(router, OURS)


async def test_events_over_zmq_reach_the_index() -> None:
    async with feed() as (sub, pub, router):
        await pub.send_multipart(frames("kv@w0", 0, [store([1, 2], None, TOKENS[:8])]))
        await pub.send_multipart(frames("kv@w0", 1, [store([3, 4], 2, TOKENS[8:])]))
        await wait_for(lambda: held(router) == 4)
        assert router.index.entry(W, OURS[3]).source is EntrySource.EVENT  # type: ignore[union-attr]
        await pub.send_multipart(frames("kv@w0", 2, [["BlockRemoved", [4], None]]))
        await wait_for(lambda: held(router) == 3)
        stats = sub.feed(W).stats  # type: ignore[union-attr]
        assert (stats.stored, stats.removed, stats.gaps) == (2, 1, 0)
        text = exported(sub)
        assert "prefixrouter_kv_events_total{'worker': 'w0', 'type': 'BlockStored'} 2" in text
        assert "prefixrouter_kv_event_messages_total{'worker': 'w0'} 3" in text


async def test_gap_demotes_entries_and_restart_clears_them() -> None:
    async with feed() as (sub, pub, router):
        await pub.send_multipart(frames("kv@w0", 0, [store([1, 2, 3, 4], None, TOKENS)]))
        await wait_for(lambda: held(router) == 4)
        await pub.send_multipart(frames("kv@w0", 5, []))  # 1..4 lost
        await wait_for(lambda: sub.feed(W).stats.gaps == 1)  # type: ignore[union-attr]
        entry = router.index.entry(W, OURS[0])
        assert entry is not None and entry.source is EntrySource.SPECULATIVE
        await pub.send_multipart(frames("kv@w0", 0, []))  # a new engine process
        await wait_for(lambda: held(router) == 0)
        assert sub.feed(W).stats.restarts == 1  # type: ignore[union-attr]


def test_restart_whose_first_messages_were_lost_clears_the_worker() -> None:
    # ZMQ's slow joiner: a restarted engine's publisher reconnects and its
    # first messages (seq 0) are gone; the feed resumes at a lower number.
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber("tcp://127.0.0.1:1", Dispatcher(router), lambda: 10.0)
    sub.add_worker(W, "t", lambda lora, salt: SEED)
    sub.handle(frames("t", 0, [store([1, 2, 3, 4], None, TOKENS)]))
    for seq in range(1, 50):
        sub.handle(frames("t", seq, []))
    assert held(router) == 4
    sub.handle(frames("t", 1, [store([11, 12], None, OTHER[:8])]))
    sub.handle(frames("t", 2, [store([13, 14], 12, OTHER[8:])]))
    stats = sub.feed(W).stats  # type: ignore[union-attr]
    assert (stats.restarts, stats.gaps, stats.last_seq) == (1, 0, 2)
    assert held(router) == 0 and router.index.blocks_of(W) == 4
    assert sub.feed(W).translator.own_hash(1) is None  # type: ignore[union-attr]
    for block in OTHERS:
        entry = router.index.entry(W, block)
        assert entry is not None and entry.source is EntrySource.EVENT


async def test_garbage_is_counted_not_fatal() -> None:
    async with feed() as (sub, pub, router):
        await pub.send_multipart([b"kv@w0", b"\x00" * 8, b"\xc1\xc1"])
        await pub.send_multipart([b"kv@w0", b"short", b""])
        await pub.send_multipart(frames("kv@w0", 0, [store([1, 2, 3, 4], None, TOKENS)]))
        await wait_for(lambda: held(router) == 4)
        assert sub.feed(W).stats.decode_errors == 2  # type: ignore[union-attr]


@asynccontextmanager
async def replay_feed(
    buffered: dict[int, list[object]], requests: list[int]
) -> AsyncIterator[tuple[KvEventSubscriber, Router]]:
    """A started subscriber whose worker's replay socket serves ``buffered`` (seq -> events).

    The engine's replay socket, as vLLM 0.32 runs it: ROUTER, [id, b"", start]
    in (recorded in ``requests``), one [id, b"", topic, seq, payload] per
    buffered batch from ``start`` on out, then [id, b"", b"", END_SEQ, b""].
    """
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{free_port()}", Dispatcher(router), lambda: 10.0)
    replay_ep = f"tcp://127.0.0.1:{free_port()}"
    sub.add_worker(W, "kv@w0", lambda lora, salt: SEED, replay_endpoint=replay_ep)
    ctx = zmq.asyncio.Context()
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind(replay_ep)

    async def serve_replay() -> None:
        ident, _, start = await replay.recv_multipart()
        requests.append(int.from_bytes(start, "big"))
        for seq, events in buffered.items():
            if seq >= requests[-1]:
                reply = [ident, b"", b"kv@w0", seq.to_bytes(8, "big"), payload(events, 1.0)]
                await replay.send_multipart(reply)
        await replay.send_multipart([ident, b"", b"", END_SEQ, b""])

    server = asyncio.get_running_loop().create_task(serve_replay())
    await sub.start()
    try:
        yield sub, router
    finally:
        server.cancel()
        replay.close()
        ctx.term()
        await sub.stop()


async def test_gap_is_filled_from_the_replay_socket() -> None:
    requests: list[int] = []
    async with replay_feed({1: [store([3, 4], 2, TOKENS[8:])]}, requests) as (sub, router):
        sub.handle(frames("kv@w0", 0, [store([1, 2], None, TOKENS[:8])]))
        sub.handle(frames("kv@w0", 2, []))  # seq 1 was lost: replay from 1
        await wait_for(lambda: held(router) == 4)
        assert requests == [1]
        assert sub.feed(W).stats.replayed == 1  # type: ignore[union-attr]
        assert "prefixrouter_kv_event_replayed_batches_total{'worker': 'w0'} 1" in exported(sub)


async def test_replayed_clears_and_removals_do_not_undo_newer_live_events() -> None:
    # Lost live, heard only through the replay: a cache reset, an eviction and
    # a stored block, all older than seq 2 (which stored the chain again). The
    # live seq 2 is held until the replay is in, and applied after seq 1.
    lost = [["AllBlocksCleared"], ["BlockRemoved", [2], None], store([21], None, OTHER[:4])]
    requests: list[int] = []
    async with replay_feed({1: lost}, requests) as (sub, router):
        sub.handle(frames("kv@w0", 0, [store([1, 2], None, TOKENS[:8])]))
        sub.handle(frames("kv@w0", 2, [store([1, 2, 3, 4], None, TOKENS)]))
        stats = sub.feed(W).stats  # type: ignore[union-attr]
        await wait_for(lambda: stats.replayed == 1)
        assert requests == [1]
        assert held(router) == 4
        for block in OURS:
            entry = router.index.entry(W, block)
            assert entry is not None and entry.source is EntrySource.EVENT
        assert sub.feed(W).translator.own_hash(2) == OURS[1]  # type: ignore[union-attr]
        # The replayed stored block still counts (speculative: this fake engine
        # stamps its replayed batches at ts 1.0, long before the subscriber started).
        entry = router.index.entry(W, OTHERS[0])
        assert entry is not None and entry.source is EntrySource.SPECULATIVE
        # The clear was applied in its place, before seq 2; the removal named a
        # block the clear had already dropped.
        assert (stats.cleared, stats.removed, stats.stored) == (1, 0, 3)
        # The next live event extends the chain: the hash map was kept.
        sub.handle(frames("kv@w0", 3, [store([5], 4, OTHER[:4])]))
        assert router.index.entry(W, hash_token_blocks(OURS[3], OTHER[:4], BS)[0]) is not None


async def test_topics_are_exclusive_and_removal_stops_a_feed() -> None:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber("tcp://127.0.0.1:1", Dispatcher(router), lambda: 0.0)
    sub.add_worker(W, "t", lambda lora, salt: SEED)
    with pytest.raises(KeyError):
        sub.add_worker(WorkerId("w1"), "t", lambda lora, salt: SEED)
    sub.remove_worker(W)
    sub.handle(frames("t", 0, [store([1, 2, 3, 4], None, TOKENS)]))
    assert sub.unknown_topics == 1 and held(router) == 0
    assert "prefixrouter_kv_event_unknown_topics_total{} 1" in exported(sub)


def test_untranslatable_blocks_are_counted_and_exported() -> None:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber("tcp://127.0.0.1:1", Dispatcher(router), lambda: 10.0)
    sub.add_worker(W, "t", lambda lora, salt: SEED if salt is None else None)
    sub.handle(frames("t", 0, [store([3, 4], 2, TOKENS[8:])]))  # parent never heard
    salted = ["BlockStored", [5], None, TOKENS[:4], BS, None, None, None, [["x"]]]
    sub.handle(frames("t", 1, [salted]))  # a salt whose namespace is unknown
    assert held(router) == 0
    assert "prefixrouter_kv_event_untranslated_blocks_total{'worker': 'w0'} 3" in exported(sub)


def test_replay_replies_of_both_vllm_layouts_parse() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_replay_reply([b"", b"topic", seq, b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", seq, b"p"]) == (5, b"p")
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_replay_reply([b"", END_SEQ, b""]) is None
    assert parse_replay_reply([b"", b"x"]) is None
    assert parse_replay_reply([b"", b"topic", b"short", b"p"]) is None


def test_backlog_from_before_the_subscriber_started_is_speculative() -> None:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber(
        "tcp://127.0.0.1:1", Dispatcher(router), lambda: 10.0, wall_clock=lambda: 1000.0
    )
    sub.add_worker(W, "t", lambda lora, salt: SEED)
    # Published at wall time 900, queued by the engine's PUB socket, heard now.
    stale = frames("t", 7, [store([1, 2], None, TOKENS[:8])], ts=900.0)
    sub.handle(stale)
    entry = router.index.entry(W, OURS[0])
    assert entry is not None and entry.source is EntrySource.SPECULATIVE
    assert sub.feed(W).stats.backlog == 1  # type: ignore[union-attr]
    fresh = frames("t", 8, [store([3, 4], 2, TOKENS[8:])], ts=999.5)
    sub.handle(fresh)
    entry = router.index.entry(W, OURS[3])
    assert entry is not None and entry.source is EntrySource.EVENT


def test_simulated_engines_publisher_drops_silently_when_nobody_listens() -> None:
    # Nothing is bound at the endpoint: past the send queue (100,000 messages)
    # the PUB socket drops messages; publishing never fails an engine step.
    pub = KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", "t", BS, 16)
    try:
        for _ in range(100_010):
            pub.publish([AllBlocksCleared(W)])
        assert pub.seq == 100_010
    finally:
        pub.close()


# ------------------------------------------------------------------ connect mode


@asynccontextmanager
async def replicas(
    n: int,
) -> AsyncIterator[tuple[BoundEngine, list[KvEventSubscriber], list[Router]]]:
    """An engine that binds, and ``n`` subscribers (as ``n`` gateway replicas) connected to it."""
    engine = BoundEngine("kv@w0")
    try:
        async with subscribers(engine, n) as (subs, routers):
            yield engine, subs, routers
    finally:
        await engine.close()


async def test_two_replicas_connected_to_one_bound_publisher_apply_the_same_events() -> None:
    async with replicas(2) as (engine, subs, routers):
        await engine.publish([store([1, 2], None, TOKENS[:8])])
        await engine.publish([store([3, 4], 2, TOKENS[8:]), store([21], None, OTHER[:4])])
        await engine.publish([["BlockRemoved", [21], None]])
        for router in routers:
            await wait_for(lambda r=router: held(r) == 4)  # type: ignore[misc]
        for sub, router in zip(subs, routers, strict=True):
            stats = sub.feed(W).stats  # type: ignore[union-attr]
            assert (stats.messages, stats.stored, stats.removed, stats.gaps) == (3, 3, 1, 0)
            assert stats.last_seq == 2
            assert sources(router, OURS) == [EntrySource.EVENT] * 4
            assert router.index.entry(W, OTHERS[0]) is None
        # Each replica's SUB socket holds its own connection: one stopping
        # leaves the other's feed running.
        await subs[0].stop()
        await engine.publish([store([5], 4, OTHER[:4])])
        chained = hash_token_blocks(OURS[3], OTHER[:4], BS)[0]
        await wait_for(lambda: routers[1].index.entry(W, chained) is not None)


async def test_engine_restart_is_a_sequence_reset_in_connect_mode() -> None:
    async with replicas(1) as (engine, (sub,), (router,)):
        for i in range(6):  # the old process got to seq 5
            await engine.publish([store([1, 2, 3, 4], None, TOKENS)] if i == 0 else [])
        await wait_for(lambda: sub.feed(W).stats.last_seq == 5)  # type: ignore[union-attr]
        assert held(router) == 4
        # The engine process dies and a new one binds the same addresses. The
        # subscriber's socket reconnects by itself; the new process counts from 0.
        pub_port = int(engine.publisher.rsplit(":", 1)[1])
        replay_port = int(engine.replay_endpoint.rsplit(":", 1)[1])
        await engine.close()
        engine = BoundEngine("kv@w0", pub_port, replay_port)
        try:
            await engine.heard_by(sub)
            await engine.publish([store([11, 12, 13, 14], None, OTHER)])
            stats = sub.feed(W).stats  # type: ignore[union-attr]
            await wait_for(lambda: stats.restarts == 1)
            assert (stats.gaps, stats.last_seq) == (0, 0)
            assert held(router) == 0  # the old process's blocks are gone
            assert sources(router, OTHERS) == [EntrySource.EVENT] * 4
            assert sub.feed(W).translator.own_hash(1) is None  # type: ignore[union-attr]
            assert engine.requests == []
        finally:
            await engine.close()


async def test_a_gap_is_replayed_from_the_engine_in_connect_mode() -> None:
    async with replicas(2) as (engine, subs, routers):
        await engine.publish([store([1, 2], None, TOKENS[:8])])
        await engine.publish([store([3, 4], 2, TOKENS[8:])], lose=True)  # seq 1 lost
        await engine.publish([])
        for sub, router in zip(subs, routers, strict=True):
            stats = sub.feed(W).stats  # type: ignore[union-attr]
            await wait_for(lambda s=stats: s.replayed == 1)  # type: ignore[misc]
            assert (stats.gaps, stats.last_seq) == (1, 2)
            # The replay repaired the gap completely: nothing was demoted, and
            # 3-4 came back through it as exact entries.
            assert sources(router, OURS) == [EntrySource.EVENT] * 4
        assert engine.requests == [1, 1]  # each replica asked for itself


async def test_a_publisher_is_one_workers_and_removal_disconnects_it() -> None:
    async with replicas(1) as (engine, (sub,), (router,)):
        with pytest.raises(KeyError, match="publisher"):
            sub.add_worker(
                WorkerId("w1"), "kv@w1", lambda lora, salt: SEED, publisher=engine.publisher
            )
        sub.remove_worker(W)
        sub.add_worker(W, "kv@w0", lambda lora, salt: SEED, publisher=engine.publisher)
        await engine.heard_by(sub)
        await engine.publish([store([1, 2, 3, 4], None, TOKENS)])
        await wait_for(lambda: held(router) == 4)
        await engine.publish([])
        stats = sub.feed(W).stats  # type: ignore[union-attr]
        await wait_for(lambda: stats.last_seq == 1)
        # One connection, not two: each message was heard once.
        assert (stats.messages, stats.restarts, stats.gaps) == (2, 0, 0)


def test_the_simulated_engine_binds_where_vllm_binds() -> None:
    # vLLM 0.32's ZmqEventPublisher._is_bind_endpoint, case by case.
    for endpoint in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert binds(endpoint), endpoint
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://engine-0:5557"):
        assert not binds(endpoint), endpoint
