"""The gateway's KV-event feed: one ZMQ SUB socket, bound, connected to engines, or both.

Two ways to wire engines to gateways, per worker, on the same socket:

* **bind** (``kv_events.endpoint``, single subscriber): the gateway binds its
  SUB socket and each engine's publisher *connects* to it. Only one process
  can bind an address, so only one gateway hears the events.
* **connect** (``workers[].kv_events_connect``, several subscribers): each
  engine *binds* its publisher and the SUB socket of every gateway replica
  connects to each engine, so every replica sees every engine's events (the
  wiring of llm-d's scheduler replicas). A PUB socket copies each message to
  every connected subscriber; ZMQ reconnects by itself (every
  ``RECONNECT_IVL``, 100 ms) when an engine restarts, and ZMTP heartbeats
  (``HEARTBEAT_S``) detect an engine whose host vanished without closing the
  connection, so the socket reconnects instead of waiting on a dead peer.

Which one an engine does is vLLM's choice, from its endpoint string
(``ZmqEventPublisher._is_bind_endpoint`` in ``vllm/distributed/kv_events.py``,
vLLM 0.32): it **binds** when the endpoint contains ``*`` (``tcp://*:5557``)
or ``::``, or is ``ipc://`` or ``inproc://``, and **connects** otherwise
(``tcp://host:5557``). Its replay socket (ROUTER) is always bound. With data
parallelism each rank adds its rank to the endpoint's port. A PUB socket that
binds drops what it publishes while no subscriber is connected (no backlog in
connect mode); one that connects queues it (up to its ``hwm``) until the
gateway's bound socket is there.

The SUB socket subscribes to every topic and tells the engines apart by topic
(``kv_events_topic`` of each worker; vLLM's ``--kv-events-config '{"topic":
...}'``), in both modes: one socket serves them all, and the sequence rules
below do not depend on how a message arrived. Each message is handled at once
on the event loop (:meth:`KvEventSubscriber.handle`, synchronous and cheap):

1. decode the frames (:mod:`prefixrouter.real_engines.kv_events`); a message that
   is not the format is counted and dropped, never fatal;
2. check the sequence number: after a **gap** the worker's event-fed index
   entries are demoted to speculative (a ``BlockRemoved`` may be lost) and, if
   the worker has a replay endpoint, the missed range is fetched from it in
   the background and applied; after a **restart** (the sequence goes back:
   a new engine process starts again at 0, and its first messages may be lost
   while its publisher connects, or while the gateway's socket reconnects to
   it) the worker's entries and hash map are
   cleared: a new engine process has an empty cache;
3. translate each event to the router's hashes and apply it to the index.
   A batch stamped (by the engine's clock) more than ``BACKLOG_S`` before the
   subscriber started is **backlog**: vLLM's PUB socket queues messages while
   no subscriber is connected and delivers them when one binds, so a gateway
   that (re)starts first hears what the engines cached while it was away
   (bind mode only: a bound PUB socket drops messages nobody hears). A
   cache reset since then is announced only with the engine's next step
   (``AllBlocksCleared`` is delayed), so backlog blocks are applied as
   speculative entries: used, but confirmed or expired like routed ones.

Replay (vLLM's ``replay_endpoint``, a ROUTER socket the engine binds): send
``[b"", start_seq]`` from a DEALER socket; the engine answers one
``[b"", topic, seq, payload]`` message per buffered batch from ``start_seq`` on
(vLLM 0.32; earlier releases send ``[b"", seq, payload]``), then an end marker
whose sequence frame is ``END_SEQ`` (-1). Replayed batches are older than the
live events heard since the gap but arrive after them: their stored blocks
enter as speculative entries, their clears and removals are skipped.

:class:`KvEventCollector` exports as Prometheus counters, per worker, the
messages heard live, the events applied by type, gaps, restarts, decode
errors, untranslatable blocks and replayed batches, and the messages on no
worker's topic (``prefixrouter_kv_event_unknown_topics_total``).
``/admin/workers`` lists each worker's counters (:meth:`FeedStats.to_dict`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixrouter.core.types import WorkerId
from prefixrouter.real_engines.kv_events import (
    END_SEQ,
    EngineBlockStored,
    EventTranslator,
    KvEventDecodeError,
    NamespaceSeed,
    SeqStatus,
    SequenceTracker,
    decode_batch,
    decode_seq,
)

log = logging.getLogger("prefixrouter.kv_events")

REPLAY_TIMEOUT_S = 2.0
HEARTBEAT_S = 2.0
"""ZMTP ping interval on the SUB socket's connections; a peer silent for 3x this is dropped."""
BACKLOG_S = 2.0
"""Batches stamped this long before the subscriber started are backlog (clock skew margin)."""


@dataclass(slots=True)
class FeedStats:
    """Counters of one worker's event feed."""

    messages: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    gaps: int = 0
    restarts: int = 0
    decode_errors: int = 0
    replayed: int = 0
    backlog: int = 0
    last_seq: int | None = None

    def to_dict(self, translator: EventTranslator) -> dict[str, Any]:
        """A JSON-ready record (``/admin/workers``)."""
        return {
            "messages": self.messages,
            "stored_events": self.stored,
            "removed_events": self.removed,
            "cleared_events": self.cleared,
            "gaps": self.gaps,
            "restarts": self.restarts,
            "decode_errors": self.decode_errors,
            "replayed_messages": self.replayed,
            "backlog_messages": self.backlog,
            "last_seq": self.last_seq,
            "mapped_blocks": len(translator),
            "untranslated_blocks": translator.skipped_blocks,
        }


@dataclass(eq=False, slots=True)
class WorkerFeed:
    """One worker's topic, hash map and replay endpoint."""

    worker_id: WorkerId
    topic: str
    translator: EventTranslator
    replay_endpoint: str | None = None
    publisher: str | None = None
    """The engine's bound PUB socket the SUB socket connects to (connect mode); None = bind."""
    stats: FeedStats = field(default_factory=FeedStats)
    replaying: bool = False


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply; None for the end marker or a malformed reply.

    Accepts ``[b"", topic, seq, payload]`` (vLLM 0.32) and ``[b"", seq, payload]``.
    """
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        seq_frame, payload = frames[1], frames[2]
    elif len(frames) == 2:
        seq_frame, payload = frames
    else:
        return None
    if seq_frame == END_SEQ:
        return None
    try:
        return decode_seq(seq_frame), payload
    except KvEventDecodeError:
        return None


class KvEventSubscriber:
    """Receives every engine's KV events and applies them to the router's index.

    Args:
        endpoint: The address to bind (``tcp://127.0.0.1:5557``) for engines
            that connect; None = bind nothing (every worker's feed connects to
            its engine's publisher, :meth:`add_worker`'s ``publisher``).
        dispatch: The routing core's dispatcher (events, gaps and resets go to it).
        clock: The gateway's clock (event application time).
    """

    def __init__(
        self,
        endpoint: str | None,
        dispatch: Dispatcher,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint = endpoint
        self.dispatch = dispatch
        self.clock = clock
        self.wall_clock = wall_clock
        self.started_wall = wall_clock()
        """When this subscriber started listening (wall clock, like the batches' ``ts``)."""
        self._feeds: dict[str, WorkerFeed] = {}
        self._by_worker: dict[WorkerId, WorkerFeed] = {}
        self._seq = SequenceTracker()
        self.unknown_topics = 0
        """Messages on no worker's topic (or not three frames)."""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._replays: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------- membership

    def add_worker(
        self,
        worker_id: WorkerId,
        topic: str,
        namespace_seed: NamespaceSeed,
        replay_endpoint: str | None = None,
        max_blocks: int = 1 << 20,
        publisher: str | None = None,
    ) -> WorkerFeed:
        """Listen for ``topic`` as ``worker_id``'s events.

        Args:
            publisher: The engine's bound PUB address (``tcp://host:5557``) to
                connect to (now if the subscriber runs, else at :meth:`start`);
                None = the engine connects to this subscriber's ``endpoint``.

        Raises:
            KeyError: The topic or the publisher is another worker's (two
                connections to one publisher would deliver each message twice).
            zmq.ZMQError: The running socket cannot connect to ``publisher``
                (a malformed address); nothing is added.
        """
        if topic in self._feeds:
            raise KeyError(f"topic {topic!r} is already used by {self._feeds[topic].worker_id}")
        if publisher is not None:
            for other in self._feeds.values():
                if other.publisher == publisher:
                    raise KeyError(f"publisher {publisher!r} is already used by {other.worker_id}")
            if self._sock is not None:
                self._sock.connect(publisher)
        feed = WorkerFeed(
            worker_id,
            topic,
            EventTranslator(worker_id, namespace_seed, max_blocks),
            replay_endpoint,
            publisher,
        )
        self._feeds[topic] = feed
        self._by_worker[worker_id] = feed
        return feed

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Stop listening for a worker (its index entries are the router's to drop)."""
        feed = self._by_worker.pop(worker_id, None)
        if feed is not None:
            self._feeds.pop(feed.topic, None)
            self._seq.forget(feed.topic)
            if feed.publisher is not None and self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):  # never connected: nothing to undo
                    self._sock.disconnect(feed.publisher)

    def feed(self, worker_id: WorkerId) -> WorkerFeed | None:
        """The worker's feed, if it has one."""
        return self._by_worker.get(worker_id)

    def feeds(self) -> Iterator[WorkerFeed]:
        """Every feed."""
        return iter(self._feeds.values())

    def forget_engine(self, worker_id: WorkerId) -> None:
        """The worker's engine restarted: forget its sequence and hash map.

        Called by the health checker when it sees a new engine process (it
        also clears the worker's index entries): the new process's events
        start a new sequence, in a cache that is empty.
        """
        feed = self._by_worker.get(worker_id)
        if feed is None:
            return
        self._seq.forget(feed.topic)
        feed.translator.clear()

    # ------------------------------------------------------------- messages

    def handle(self, frames: list[bytes]) -> None:
        """One received message (``[topic, seq, payload]``)."""
        if len(frames) != 3:
            self.unknown_topics += 1
            return
        try:
            topic = frames[0].decode("utf-8")
        except UnicodeDecodeError:
            self.unknown_topics += 1
            return
        feed = self._feeds.get(topic)
        if feed is None:
            self.unknown_topics += 1
            return
        stats = feed.stats
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except KvEventDecodeError as exc:
            stats.decode_errors += 1
            log.warning("KV event from %s dropped: %s", feed.worker_id, exc)
            return
        now = self.clock()
        expected = self._seq.expected(topic)
        status = self._seq.check(topic, seq)
        if status is SeqStatus.RESTART:
            stats.restarts += 1
            feed.translator.clear()
            self.dispatch.apply_event(AllBlocksCleared(feed.worker_id), now)
        elif status is SeqStatus.GAP:
            stats.gaps += 1
            demoted = self.dispatch.events_gap(feed.worker_id, now)
            log.warning(
                "KV event gap on %s (expected %s, got %d): %d entries now speculative",
                feed.worker_id,
                expected,
                seq,
                demoted,
            )
            if feed.replay_endpoint and expected is not None:
                self._start_replay(feed, expected, seq)
        stats.messages += 1
        stats.last_seq = seq
        trusted = batch.ts >= self.started_wall - BACKLOG_S
        if not trusted:
            stats.backlog += 1
        self._apply(feed, batch.events, now, trusted)

    def _apply(self, feed: WorkerFeed, events: Any, now: float, trusted: bool = True) -> None:
        stats = feed.stats
        translate = feed.translator.translate
        apply = self.dispatch.apply_event
        for raw in events:
            event = translate(raw)
            if event is None:
                continue
            if isinstance(event, BlockStored):
                stats.stored += 1
            elif isinstance(event, BlockRemoved):
                stats.removed += 1
            else:
                stats.cleared += 1
            apply(event, now, trusted=trusted)

    # ------------------------------------------------------------- replay

    def _start_replay(self, feed: WorkerFeed, start: int, stop: int) -> None:
        if feed.replaying or self._ctx is None:
            return
        feed.replaying = True
        task = asyncio.get_running_loop().create_task(
            self._replay_task(feed, start, stop), name=f"kv-replay-{feed.worker_id}"
        )
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def _replay_task(self, feed: WorkerFeed, start: int, stop: int) -> None:
        try:
            await self.replay(feed, start, stop)
        finally:
            feed.replaying = False

    async def replay(self, feed: WorkerFeed, start: int, stop: int) -> int:
        """Fetch and apply batches ``start .. stop-1`` from the worker's replay socket.

        Replayed blocks are applied as speculative entries (see :meth:`handle`'s
        backlog rule) and replayed clears and removals are skipped: they are
        older than the events heard live since the gap, yet applied after them.
        Returns how many batches were applied. Errors and timeouts are logged,
        not raised: a failed replay leaves the entries speculative, which is safe.
        """
        if self._ctx is None or feed.replay_endpoint is None:
            return 0
        applied = 0
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(feed.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("replay from %s timed out", feed.worker_id)
                    return applied
                frames = await sock.recv_multipart()
                parsed = parse_replay_reply(frames)
                if parsed is None:
                    return applied  # the end marker (or a reply we cannot read)
                seq, payload = parsed
                if seq >= stop:
                    continue  # already heard live
                try:
                    batch = decode_batch(payload)
                except KvEventDecodeError:
                    feed.stats.decode_errors += 1
                    continue
                feed.stats.replayed += 1
                applied += 1
                # Older than what was heard live since the gap, and applied
                # after it: a block replayed as stored may have been removed
                # meanwhile, so it is speculative; a replayed clear or removal
                # would undo newer live state (wipe the blocks and hash map
                # the live feed rebuilt since a reset, drop blocks stored
                # again since an eviction), so they are skipped. What they
                # removed was demoted at the gap and expires unless confirmed.
                stored = [e for e in batch.events if isinstance(e, EngineBlockStored)]
                self._apply(feed, stored, self.clock(), trusted=False)
        except (zmq.ZMQError, OSError) as exc:
            log.warning("replay from %s failed: %s", feed.worker_id, exc)
        finally:
            sock.close()
        return applied

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind the SUB socket (if it has an endpoint), connect it to each publisher, receive.

        Connecting never waits for the engine: ZMQ connects in the background
        and keeps retrying, so an engine that starts later is heard once it binds.

        Raises:
            zmq.ZMQError: The endpoint cannot be bound (in use, bad address),
                or a publisher's address is malformed.
        """
        self.started_wall = self.wall_clock()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            if self.endpoint is not None:
                sock.bind(self.endpoint)
            for feed in self._feeds.values():
                if feed.publisher is not None:
                    sock.connect(feed.publisher)
        except zmq.ZMQError:
            sock.close()
            self._ctx.term()
            self._ctx = None
            raise
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def _run(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            try:
                self.handle(frames)
            except Exception:  # a bug in one message must not stop the feed
                log.exception("KV event handling failed")

    async def stop(self) -> None:
        """Stop receiving and close the sockets."""
        tasks = [t for t in (self._task, *self._replays) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


_FEED_COUNTERS: tuple[tuple[str, str, Callable[[WorkerFeed], int]], ...] = (
    ("messages", "KV-event messages heard live on a worker's topic", lambda f: f.stats.messages),
    (
        "gaps",
        "Gaps in a worker's KV-event sequence (entries demoted to speculative)",
        lambda f: f.stats.gaps,
    ),
    (
        "restarts",
        "Engine restarts seen on the KV-event feed (cache cleared)",
        lambda f: f.stats.restarts,
    ),
    (
        "decode_errors",
        "KV-event messages that could not be decoded",
        lambda f: f.stats.decode_errors,
    ),
    (
        "untranslated_blocks",
        "Stored blocks left out of the index (parent or namespace unknown)",
        lambda f: f.translator.skipped_blocks,
    ),
    (
        "replayed_batches",
        "KV-event batches fetched from a worker's replay socket after a gap",
        lambda f: f.stats.replayed,
    ),
)
"""Per-worker counters: ``prefixrouter_kv_event_<name>_total{worker}``."""


class KvEventCollector(Collector):
    """Prometheus counters of the event feeds (read at scrape time)."""

    def __init__(self, subscriber: KvEventSubscriber) -> None:
        self.subscriber = subscriber

    def collect(self) -> Iterator[CounterMetricFamily]:
        """``prefixrouter_kv_events_total{worker,type}`` and the feeds' other counters."""
        events = CounterMetricFamily(
            "prefixrouter_kv_events",
            "KV events applied to the index, by worker and type",
            labels=["worker", "type"],
        )
        counters = [
            (CounterMetricFamily(f"prefixrouter_kv_event_{name}", doc, labels=["worker"]), read)
            for name, doc, read in _FEED_COUNTERS
        ]
        for feed in self.subscriber.feeds():
            w, s = feed.worker_id, feed.stats
            events.add_metric([w, "BlockStored"], s.stored)
            events.add_metric([w, "BlockRemoved"], s.removed)
            events.add_metric([w, "AllBlocksCleared"], s.cleared)
            for family, read in counters:
                family.add_metric([w], read(feed))
        yield events
        for family, _ in counters:
            yield family
        yield CounterMetricFamily(
            "prefixrouter_kv_event_unknown_topics",
            "KV-event messages on no worker's topic (or not three frames)",
            value=self.subscriber.unknown_topics,
        )
