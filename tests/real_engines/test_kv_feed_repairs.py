"""The KV-event feed's repairs, over real ZMQ sockets on loopback.

Repeated and out-of-order messages, two spellings of one publisher, two
engines on one topic, malformed events inside a good batch, gaps repaired by
the replay socket (the index stays exact; the message that revealed the gap is
applied after the replayed ones; a second gap during a replay), and a restart
whose first batches were lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import BlockHash, EntrySource, WorkerId
from prefixrouter.real_engines import kv_subscriber
from prefixrouter.real_engines.kv_subscriber import KvEventSubscriber
from tests.real_engines import fake_publisher
from tests.real_engines.fake_publisher import (
    BS,
    OTHER,
    OTHERS,
    OURS,
    SEED,
    TOKENS,
    BoundEngine,
    W,
    payload,
    sources,
    subscribers,
    wait_for,
)

pytestmark = pytest.mark.timeout(30)


def store(first: int, n: int, tokens: Sequence[int] = TOKENS) -> list[object]:
    """``BlockStored`` of blocks ``first .. first+n-1`` of ``tokens`` (engine hashes 1, 2, ...)."""
    hashes = list(range(first + 1, first + n + 1))
    return fake_publisher.store(
        hashes, first if first else None, tokens[first * BS : (first + n) * BS]
    )


class Clock:
    """The gateway's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def connected(
    engine: BoundEngine, clock: Callable[[], float] = lambda: 10.0, replay: bool = True
) -> AsyncIterator[tuple[KvEventSubscriber, Router]]:
    """A started subscriber connected to ``engine``'s publisher (as a gateway replica)."""
    async with subscribers(engine, 1, clock, replay) as ((sub,), (router,)):
        yield sub, router


async def settle(sub: KvEventSubscriber) -> None:
    """Until no replay is under way (bounded)."""
    feed = sub.feed(W)
    assert feed is not None
    await wait_for(lambda: not feed.replaying)


def held(router: Router, blocks: Sequence[BlockHash] = OURS) -> int:
    return fake_publisher.held(router, blocks)


def stats(sub: KvEventSubscriber) -> kv_subscriber.FeedStats:
    feed = sub.feed(W)
    assert feed is not None
    return feed.stats


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


# ------------------------------------------------------------------ duplicates, restarts


async def test_a_repeated_message_is_ignored_not_taken_for_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = BoundEngine()
    try:
        async with connected(engine, replay=False) as (sub, router):
            await engine.publish([store(0, 2)])
            body = await engine.publish([store(2, 2)])
            await wait_for(lambda: stats(sub).last_seq == 1)
            assert held(router) == 4
            # The same message again (a second connection to the publisher).
            await engine.pub.send_multipart([engine.topic, (1).to_bytes(8, "big"), body])
            await engine.publish([store(4, 2)])
            await wait_for(lambda: stats(sub).last_seq == 2)
            assert held(router) == 6
            assert sources(router, OURS) == [EntrySource.EVENT] * 6
            assert (stats(sub).restarts, stats(sub).gaps, stats(sub).messages) == (0, 0, 3)
            assert stats(sub).duplicates == 1
            assert len(said(caplog, "heard twice")) == 1
    finally:
        await engine.close()


async def test_every_message_heard_twice_keeps_the_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The subscriber's socket reaches one publisher twice (what two spellings
    # of one address did): ZMQ delivers every message once per connection.
    engine = BoundEngine()
    try:
        async with connected(engine, replay=False) as (sub, router):
            assert sub._sock is not None
            port = engine.publisher.rsplit(":", 1)[1]
            sub._sock.connect(f"tcp://localhost:{port}")
            for _ in range(300):  # until a probe is heard over both connections
                before = sub.unknown_topics
                await engine.pub.send_multipart([b"probe", bytes(8), payload([])])
                await asyncio.sleep(0.02)
                if sub.unknown_topics - before == 2:
                    break
            else:
                raise AssertionError("the second connection never subscribed")
            for first in range(0, 6, 2):
                await engine.publish([store(first, 2)])
            await wait_for(lambda: stats(sub).duplicates == 3)
            assert held(router) == 6
            assert (stats(sub).restarts, stats(sub).gaps, stats(sub).messages) == (0, 0, 3)
            assert len(said(caplog, "heard twice")) == 1  # said once, not per copy
    finally:
        await engine.close()


async def test_a_restart_is_logged_naming_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    engine = BoundEngine()
    try:
        async with connected(engine, replay=False) as (sub, router):
            for first in range(0, 6, 2):
                await engine.publish([store(first, 2)])
            await wait_for(lambda: held(router) == 6)
            engine.seq = 0  # a new engine process on the same sockets
            await engine.publish([store(0, 4, OTHER)])
            await wait_for(lambda: stats(sub).restarts == 1)
            assert held(router) == 0 and held(router, OTHERS) == 4
            records = said(caplog, "restarted at seq 0")
            assert len(records) == 1 and records[0].levelno == logging.WARNING
            assert "w0" in records[0].getMessage() and "expected 3" in records[0].getMessage()
    finally:
        await engine.close()


async def test_two_engines_on_one_topic_are_said_once(caplog: pytest.LogCaptureFixture) -> None:
    # Engine B was given engine A's topic by mistake: their numbers interleave.
    a, b = BoundEngine(), BoundEngine()
    try:
        async with connected(a, replay=False) as (sub, _):
            assert sub._sock is not None
            sub._sock.connect(b.publisher)
            await b.heard_by(sub)
            a.seq = 100
            heard = 0
            for _ in range(5):
                # One at a time: two connections' messages have no order between them.
                for engine in (a, b):
                    await engine.publish([])
                    heard += 1
                    await wait_for(lambda n=heard: stats(sub).messages == n)  # type: ignore[misc]
            assert len(said(caplog, "two engines publish on this topic")) == 1
    finally:
        await a.close()
        await b.close()


def test_one_publisher_under_two_spellings_is_refused() -> None:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BS))
    sub = KvEventSubscriber(None, Dispatcher(router), lambda: 0.0)
    sub.add_worker(W, "a", lambda lora, salt: SEED, publisher="ipc:///tmp/kvx/engE.ipc")
    sub.add_worker(WorkerId("w1"), "b", lambda lora, salt: SEED, publisher="tcp://127.0.0.1:5557")
    for i, same in enumerate(
        ("ipc:///tmp/kvx/./engE.ipc", "ipc:///tmp//kvx/engE.ipc", "tcp://localhost:5557")
    ):
        with pytest.raises(KeyError, match="already used"):
            sub.add_worker(WorkerId(f"x{i}"), f"t{i}", lambda lora, salt: SEED, publisher=same)
    sub.add_worker(WorkerId("w2"), "c", lambda lora, salt: SEED, publisher="tcp://127.0.0.1:5558")


def test_endpoint_spellings_normalise() -> None:
    from prefixrouter.real_engines.kv_events import endpoint_key

    assert endpoint_key("ipc:///tmp/a/./b.ipc") == endpoint_key("ipc:///tmp/a/b.ipc")
    assert endpoint_key("ipc://./b.ipc") == endpoint_key("ipc://b.ipc")
    assert endpoint_key("TCP://LocalHost:05557") == "tcp://127.0.0.1:5557"
    assert endpoint_key("tcp://[::1]:5557") == "tcp://[::1]:5557"
    assert endpoint_key("ipc://@abstract") == "ipc://@abstract"
    assert endpoint_key("tcp://a:1") != endpoint_key("tcp://b:1")


# ------------------------------------------------------------------ malformed events


async def test_a_bad_event_is_a_decode_error_and_the_batch_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = BoundEngine()
    try:
        async with connected(engine, replay=False) as (sub, router):
            negative = ["BlockStored", [90], None, [-1] * BS, BS]
            huge = ["BlockStored", [91], None, [1 << 40] * BS, BS]
            medium = {"type": "BlockStored", "block_hashes": [92], "parent_block_hash": None,
                      "token_ids": [1] * BS, "block_size": BS, "medium": [1]}  # fmt: skip
            await engine.publish([store(0, 2), negative, huge, store(2, 2), medium, store(4, 2)])
            await engine.publish([huge])
            await wait_for(lambda: stats(sub).messages == 2)
            assert held(router) == 6  # the good events of the batch were applied
            assert stats(sub).decode_errors == 4
            errors = [r for r in caplog.records if r.name == "prefixrouter.kv_events"]
            assert all(r.exc_info is None and r.levelno < logging.ERROR for r in errors)
            assert len(said(caplog, "malformed event")) == 1  # rate-limited: one line
    finally:
        await engine.close()


# ------------------------------------------------------------------ gaps and replay


async def test_a_repaired_gap_keeps_the_entries_exact() -> None:
    clock = Clock()
    engine = BoundEngine()
    try:
        async with connected(engine, clock) as (sub, router):
            await engine.publish([store(0, 4, OTHER)])  # an earlier document, P
            await engine.publish([store(0, 2)])
            await engine.publish([store(2, 2)], lose=True)
            await engine.publish([store(4, 2)])  # reveals the gap
            await wait_for(lambda: stats(sub).replayed == 1)
            await settle(sub)
            assert engine.requests == [2]
            assert sources(router, OTHERS) == [EntrySource.EVENT] * 4
            assert sources(router, OURS) == [EntrySource.EVENT] * 6
            clock.now += 600  # far past the speculative TTL: nothing expires
            assert router.index.match(OTHERS, clock.now)[W].blocks == 4
    finally:
        await engine.close()


async def test_the_message_that_revealed_a_gap_is_applied_after_the_replay() -> None:
    # One BlockStored per prefill chunk, each naming the previous chunk's last
    # block: chunk 2 cannot be translated before the lost chunk 1 is.
    engine = BoundEngine()
    try:
        async with connected(engine) as (sub, router):
            await engine.publish([store(0, 2)])
            await engine.publish([store(2, 2)], lose=True)
            await engine.publish([store(4, 2)])
            await wait_for(lambda: stats(sub).replayed == 1)
            await settle(sub)
            assert held(router) == 6
            feed = sub.feed(W)
            assert feed is not None and feed.translator.skipped_blocks == 0
    finally:
        await engine.close()


async def test_a_failed_replay_demotes_and_applies_what_was_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_subscriber, "REPLAY_TIMEOUT_S", 0.2)
    engine = BoundEngine(hold_replies=True)  # never answers
    try:
        async with connected(engine) as (sub, router):
            await engine.publish([store(0, 4, OTHER)])
            await engine.publish([store(0, 2)], lose=True)
            await engine.publish([store(0, 2)])
            await wait_for(lambda: engine.requests == [1])
            await settle(sub)
            assert stats(sub).replayed == 0
            # The gap was not repaired: what came before it is no longer exact;
            # the message after it is.
            assert sources(router, OTHERS) == [EntrySource.SPECULATIVE] * 4
            assert sources(router, OURS[:2]) == [EntrySource.EVENT] * 2
    finally:
        engine.release.set()
        await engine.close()


async def test_a_second_gap_during_a_replay_is_replayed_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = BoundEngine(hold_replies=True)
    try:
        async with connected(engine) as (sub, router):
            await engine.publish([store(0, 2)])
            await engine.publish([store(2, 1)], lose=True)
            await engine.publish([store(3, 1)])  # gap 1: replay from 1
            await wait_for(lambda: engine.requests == [1])
            await engine.publish([store(4, 1)], lose=True)
            await engine.publish([store(5, 1)])  # gap 2, while the replay is out
            await wait_for(lambda: stats(sub).gaps == 2)
            engine.release.set()
            await wait_for(lambda: engine.requests == [1, 3])
            await settle(sub)
            assert held(router) == 6
            assert sources(router, OURS) == [EntrySource.EVENT] * 6
            assert len(said(caplog, "during a replay")) == 1
    finally:
        await engine.close()


# ------------------------------------------------------------------ restarts with lost batches


async def test_after_a_known_restart_lost_first_batches_are_replayed_from_0() -> None:
    engine = BoundEngine()
    try:
        async with connected(engine) as (sub, router):
            for first in range(0, 4, 2):
                await engine.publish([store(first, 2, OTHER)])
            await wait_for(lambda: stats(sub).last_seq == 1)
            # The health checker sees a new engine process (and clears the worker).
            sub.forget_engine(W)
            router.index.clear_worker(W, 10.0)
            engine.seq, engine.buffer = 0, []
            await engine.publish([store(0, 2)], lose=True)  # lost while reconnecting
            await engine.publish([store(2, 2)], lose=True)
            await engine.publish([store(4, 2)])  # the first heard: seq 2
            await wait_for(lambda: stats(sub).replayed == 2)
            await settle(sub)
            assert engine.requests == [0]
            assert held(router) == 6
    finally:
        await engine.close()


async def test_a_restart_heard_late_is_replayed_from_0() -> None:
    engine = BoundEngine()
    try:
        async with connected(engine) as (sub, router):
            for first in range(0, 16, 4):
                await engine.publish([store(0, 4, OTHER)] if first == 0 else [])
            await wait_for(lambda: stats(sub).last_seq == 3)
            engine.seq, engine.buffer = 0, []  # a new process; its seq 0 is lost
            await engine.publish([store(0, 2)], lose=True)
            await engine.publish([store(2, 2)])
            await wait_for(lambda: stats(sub).restarts == 1)
            await settle(sub)
            assert engine.requests == [0]
            assert held(router, OTHERS) == 0 and held(router) == 4
    finally:
        await engine.close()


def test_the_tracker_tells_a_repeat_from_a_restart_by_content() -> None:
    from prefixrouter.real_engines.kv_events import SeqStatus, SequenceTracker

    seq = SequenceTracker()
    for n in range(5):
        seq.check("t", n, f"batch {n}")
    assert seq.check("t", 3, "batch 3") is SeqStatus.DUPLICATE  # the same message again
    assert seq.check("t", 4, "batch 4") is SeqStatus.DUPLICATE
    assert seq.expected("t") == 5  # a repeat moves nothing
    assert seq.check("t", 1, "another process") is SeqStatus.RESTART
    assert seq.check("t", 0, "batch 0") is SeqStatus.RESTART  # the old process is forgotten
    seq.expect("t", 0)  # the health checker saw a restart
    assert seq.check("t", 3, "x") is SeqStatus.GAP
