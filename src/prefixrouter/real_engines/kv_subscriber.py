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
2. check the sequence number (:class:`~prefixrouter.real_engines.kv_events.SequenceTracker`):
   a **duplicate** (a number heard already, with the same bytes: the
   publisher is reached over two connections) is ignored and said once; a
   **gap** is repaired from the worker's replay endpoint if it has one (see
   *Gaps* below), else the worker's event-fed index entries are demoted to
   speculative at once (a ``BlockRemoved`` may be lost); after a **restart**
   (the sequence goes back: a new engine process starts again at 0, and its
   first messages may be lost while its publisher connects, or while the
   gateway's socket reconnects to it) the worker's entries and hash map are
   cleared, a new engine process having an empty cache, and said (WARNING,
   naming the worker and both numbers). A restart whose first number is not 0
   lost the new process's first batches: they are replayed from 0 like a gap.
   So is the first message after the health checker saw a restart
   (:meth:`KvEventSubscriber.forget_engine` expects 0). A feed whose numbers
   jump back to a sequence it had left (a restart, then the old sequence
   again) has two engines publishing on one topic: said once;
3. translate each event to the router's hashes and apply it to the index. A
   malformed event is counted as a decode error and left out; the batch's
   other events are applied. Bad messages and events are said in one line,
   at most once a minute per worker (:data:`SAY_EVERY_S`), never with a traceback.
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
whose sequence frame is ``END_SEQ`` (-1).

**Gaps, when the worker has a replay endpoint.** Events only make sense in
order: a chunk's ``BlockStored`` names its parent, the previous chunk's last
block, so the message that revealed the gap cannot be translated before the
lost one is, and a replayed ``BlockRemoved`` or ``AllBlocksCleared`` applied
after newer live events would undo them. So from the gap on, the live
messages (the one that revealed it included) are **held**, not applied, while
the missed range is fetched in the background; the messages replayed and
held are then applied together, in sequence order. The rule for what the
index trusts afterwards:

* every number from the gap to the newest held message replayed or held
  (the gap is **repaired**): the entries stay exact. Nothing was demoted, the
  events are applied as if none had been lost (each batch's own backlog rule
  still applies);
* some numbers still missing after :data:`REPLAY_ROUNDS` requests (the
  engine's replay buffer no longer had them, the socket timed out or failed):
  the worker's event entries are demoted to speculative, as without a
  replay, and the batches before the last missing number apply their stored
  blocks as speculative entries (a removal of them may be in the hole);
  batches after it are exact.

A second gap while a replay is under way (among the held messages) is said
and asked for in the next round of the same replay. The hold is bounded
(:data:`MAX_HELD` messages); past it the replay is given up and settled with
what it has. Holding delays the index by the replay's round trip (a few
milliseconds; at most ``REPLAY_TIMEOUT_S`` a round when the engine does not
answer), in exchange for an index that stays exact.

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
from collections.abc import Callable, Iterator, Mapping
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
    EngineEvent,
    EventBatch,
    EventTranslator,
    KvEventDecodeError,
    NamespaceSeed,
    SeqStatus,
    SequenceTracker,
    decode_batch,
    decode_seq,
    endpoint_key,
)

log = logging.getLogger("prefixrouter.kv_events")

REPLAY_TIMEOUT_S = 2.0
HEARTBEAT_S = 2.0
"""ZMTP ping interval on the SUB socket's connections; a peer silent for 3x this is dropped."""
BACKLOG_S = 2.0
"""Batches stamped this long before the subscriber started are backlog (clock skew margin)."""
REPLAY_ROUNDS = 3
"""Replay requests one gap may take (a second gap during a replay takes another round)."""
MAX_HELD = 4096
"""Live messages held while a replay is under way; past it the replay is given up."""
MAX_REPLAYED = 16384
"""Replayed batches kept from one request (vLLM buffers 10,000 by default)."""
SAY_EVERY_S = 60.0
"""A worker's log line of one kind is said at most this often (the rest are counted)."""
FLAP_WINDOW = 16
"""A jump to at most this many numbers past the one a restart left is that sequence resuming."""


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
    duplicates: int = 0
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
            "duplicate_messages": self.duplicates,
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
    gap_from: int | None = None
    """The first missed number of the gap being replayed; None = no replay under way."""
    held: dict[int, tuple[EventBatch, bool]] = field(default_factory=dict)
    """Live messages heard since the gap, seq -> (batch, not backlog), applied after the replay."""
    replayed: dict[int, EventBatch] = field(default_factory=dict)
    """Batches fetched from the replay socket for the gap, seq -> batch."""
    replay_task: asyncio.Task[None] | None = None
    left_seq: int | None = None
    """The number expected when the feed last restarted (to recognise that sequence resuming)."""
    clash_said: bool = False
    said: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Log line kind -> (when last said, how many since were not)."""

    @property
    def replaying(self) -> bool:
        """A replay is under way (live messages are held)."""
        return self.gap_from is not None


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
            key = endpoint_key(publisher)  # two spellings of one socket are one publisher
            for other in self._feeds.values():
                if other.publisher is not None and endpoint_key(other.publisher) == key:
                    raise KeyError(
                        f"publisher {publisher!r} is already used by {other.worker_id}"
                        + (f" (as {other.publisher!r})" if other.publisher != publisher else "")
                    )
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
            self._drop_replay(feed)
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
        """The worker's engine restarted: expect its sequence from 0, forget its hash map.

        Called by the health checker when it sees a new engine process (it
        also clears the worker's index entries): the new process's events
        start a new sequence at 0, in a cache that is empty. Expecting 0 (not
        "anything") makes a first message heard with a later number a gap:
        the new process's first batches were lost (a bound publisher drops
        what it sends before the gateway's socket has reconnected) and are
        replayed from 0. A replay under way was the old process's: dropped.
        """
        feed = self._by_worker.get(worker_id)
        if feed is None:
            return
        self._drop_replay(feed)
        self._seq.expect(feed.topic, 0)
        feed.left_seq = None
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
        now = self.clock()
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except KvEventDecodeError as exc:
            stats.decode_errors += 1
            self._say(feed, "decode", now, "KV event from %s dropped: %s", feed.worker_id, exc)
            return
        expected = self._seq.expected(topic)
        # The payload's hash tells a repeat from another process's message (a
        # batch carries the engine's timestamp), without keeping the bytes.
        status = self._seq.check(topic, seq, hash(frames[2]))
        if status is SeqStatus.DUPLICATE:
            stats.duplicates += 1
            self._say(
                feed,
                "duplicate",
                now,
                "KV event %d from %s heard twice, the copy ignored: is its publisher "
                "reached over two connections (two spellings of one address)?",
                seq,
                feed.worker_id,
            )
            return
        if batch.bad_events:
            stats.decode_errors += batch.bad_events
            self._say(
                feed,
                "decode",
                now,
                "KV event from %s: %d malformed event(s) left out, the rest applied: %s",
                feed.worker_id,
                batch.bad_events,
                batch.error,
            )
        stats.messages += 1
        stats.last_seq = seq
        trusted = batch.ts >= self.started_wall - BACKLOG_S
        if not trusted:
            stats.backlog += 1
        if status is SeqStatus.RESTART:
            self._restarted(feed, expected, seq, now)
            if seq > 0 and feed.replay_endpoint and self._ctx is not None:
                self._gap(feed, 0, seq, now)  # the new process's first batches were lost
        elif status is SeqStatus.GAP:
            stats.gaps += 1
            self._clash(feed, expected, seq)
            self._gap(feed, expected, seq, now)
        if feed.gap_from is not None:
            # A replay is under way: this message is applied after the replayed ones.
            feed.held[seq] = (batch, trusted)
            if len(feed.held) > MAX_HELD:
                log.warning(
                    "KV event replay from %s given up: %d live messages held meanwhile",
                    feed.worker_id,
                    len(feed.held),
                )
                self._settle(feed)
            return
        self._apply(feed, batch.events, now, trusted)

    def _restarted(self, feed: WorkerFeed, expected: int | None, seq: int, now: float) -> None:
        """A lower sequence number, not a repeat: a new engine process, an empty cache."""
        feed.stats.restarts += 1
        self._drop_replay(feed)  # the old process's gap: nothing left to repair
        entries = self.dispatch.index_blocks(feed.worker_id)
        feed.translator.clear()
        self.dispatch.apply_event(AllBlocksCleared(feed.worker_id), now)
        if not self._clash(feed, expected, seq):
            self._say(
                feed,
                "restart",
                now,
                "KV events from %s restarted at seq %d (expected %s): a new engine process, "
                "its %d index entries cleared",
                feed.worker_id,
                seq,
                expected,
                entries,
            )
        feed.left_seq = expected

    def _clash(self, feed: WorkerFeed, expected: int | None, seq: int) -> bool:
        """Say once if ``seq`` resumes the sequence the feed left at its last restart.

        An engine process never comes back to its predecessor's numbers, so
        a jump back into them (a restart, then the old sequence again) means
        two publishers on one topic: each switch between them reads as a
        restart or a gap, and each restart clears the worker's entries.
        Returns whether the jump is one of those.
        """
        left = feed.left_seq
        # Landing at (or, past a few lost messages, just after) the very number
        # the old sequence would have sent next: a coincidence for a restarted
        # engine, whose numbers climb from 0 and reach it only through a gap
        # that ends exactly there.
        if left is None or not left <= seq < left + FLAP_WINDOW:
            return False
        if not feed.clash_said:
            feed.clash_said = True
            log.warning(
                "KV events on topic %r jump between two sequences (seq %d, expected %s; "
                "it had reached %d): two engines publish on this topic, and %s's entries "
                "are cleared at each switch. Give each engine its own topic "
                "(vLLM's kv-events-config topic, the worker's kv_events_topic)",
                feed.topic,
                seq,
                expected,
                left,
                feed.worker_id,
            )
        return True

    def _gap(self, feed: WorkerFeed, start: int | None, seq: int, now: float) -> None:
        """Numbers ``start .. seq-1`` were lost: replay them, or demote the worker's entries."""
        if feed.gap_from is not None:
            # The replay under way asks for this range in its next round (see _replay_task).
            self._say(
                feed,
                "gap during replay",
                now,
                "KV event gap on %s during a replay (expected %s, got %d): "
                "asked for after the current round",
                feed.worker_id,
                start,
                seq,
            )
            return
        if feed.replay_endpoint and start is not None and self._ctx is not None:
            self._say(
                feed,
                "gap",
                now,
                "KV event gap on %s (expected %d, got %d): replaying the missed batches",
                feed.worker_id,
                start,
                seq,
            )
            feed.gap_from = start
            task = asyncio.get_running_loop().create_task(
                self._replay_task(feed), name=f"kv-replay-{feed.worker_id}"
            )
            feed.replay_task = task
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)
            return
        demoted = self.dispatch.events_gap(feed.worker_id, now)
        self._say(
            feed,
            "gap",
            now,
            "KV event gap on %s (expected %s, got %d): %d entries now speculative",
            feed.worker_id,
            start,
            seq,
            demoted,
        )

    def _say(self, feed: WorkerFeed, kind: str, now: float, msg: str, *args: object) -> None:
        """Log one WARNING line of ``kind`` for the worker, at most once per :data:`SAY_EVERY_S`.

        Lines not said are counted and their number is added to the next one,
        so a flood of bad messages costs one line a minute, not one each.
        """
        last, quiet = feed.said.get(kind, (None, 0))
        if last is not None and now - last < SAY_EVERY_S:
            feed.said[kind] = (last, quiet + 1)
            return
        feed.said[kind] = (now, 0)
        if quiet:
            msg += " (%d more like this not logged)"
            args = (*args, quiet)
        log.warning(msg, *args)

    def _apply(
        self, feed: WorkerFeed, events: tuple[EngineEvent, ...], now: float, trusted: bool = True
    ) -> None:
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

    def _drop_replay(self, feed: WorkerFeed) -> None:
        """Abandon the feed's replay and what it held (a restart: the old process's events)."""
        task, feed.replay_task = feed.replay_task, None
        if task is not None:
            task.cancel()
        feed.gap_from = None
        feed.held = {}
        feed.replayed = {}

    def _first_missing(self, feed: WorkerFeed) -> int | None:
        """The lowest number from the gap to the newest held message neither replayed nor held."""
        assert feed.gap_from is not None
        start, held = feed.gap_from, feed.held
        top = max(held, default=start - 1)
        return next(_unfilled(start, top, held, feed.replayed), None)

    async def _replay_task(self, feed: WorkerFeed) -> None:
        """Fetch the missed range (more rounds for gaps heard meanwhile), then settle.

        Cancelled (a restart, the worker removed, the subscriber stopped), it
        leaves the feed alone: whoever cancelled it reset the feed.
        """
        try:
            for _ in range(REPLAY_ROUNDS):
                start = self._first_missing(feed)
                if start is None:
                    break
                if not await self._fetch(feed, start, feed.replayed):
                    break
        except Exception:  # a bug in one reply must not leave the feed held forever
            log.exception("replay from %s failed", feed.worker_id)
        if feed.replay_task is asyncio.current_task():
            self._settle(feed)

    def _settle(self, feed: WorkerFeed) -> None:
        """Apply the replayed and held messages in sequence order and end the replay.

        See the module docstring (*Gaps*): repaired, the entries stay exact;
        not, the worker's event entries are demoted and the batches before the
        last missing number store speculative entries only.
        """
        start = feed.gap_from
        held, replayed = feed.held, feed.replayed
        task, feed.replay_task = feed.replay_task, None
        feed.gap_from, feed.held, feed.replayed = None, {}, {}
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # given up (too much held): its replies are not wanted
        if start is None:
            return
        top = max(held, default=start - 1)
        missing = list(_unfilled(start, top, held, replayed))
        now = self.clock()
        last_hole = missing[-1] if missing else start - 1
        if missing:
            demoted = self.dispatch.events_gap(feed.worker_id, now)
            log.warning(
                "KV event replay from %s missed %d of the %d batches from %d to %d: "
                "%d entries now speculative",
                feed.worker_id,
                len(missing),
                top - start + 1,
                start,
                top,
                demoted,
            )
        for seq in range(start, top + 1):
            live = held.get(seq)
            if live is not None:
                batch, trusted = live
            else:
                got = replayed.get(seq)
                if got is None:
                    continue
                batch, trusted = got, got.ts >= self.started_wall - BACKLOG_S
                feed.stats.replayed += 1
            self._apply(feed, batch.events, now, trusted and seq > last_hole)

    async def _fetch(self, feed: WorkerFeed, start: int, into: dict[int, EventBatch]) -> bool:
        """Ask the replay socket for the batches from ``start`` on; store them in ``into``.

        Returns whether the reply was read to its end marker (False: timed
        out, failed or too long; what came is kept). Errors are logged, not raised.
        """
        if self._ctx is None or feed.replay_endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(feed.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning("replay from %s timed out", feed.worker_id)
                    return False
                frames = await sock.recv_multipart()
                parsed = parse_replay_reply(frames)
                if parsed is None:
                    return True  # the end marker (or a reply we cannot read)
                seq, payload = parsed
                if seq < start or seq in into:
                    continue
                if len(into) >= MAX_REPLAYED:
                    log.warning("replay from %s cut at %d batches", feed.worker_id, len(into))
                    return False
                try:
                    batch = decode_batch(payload)
                except KvEventDecodeError as exc:
                    feed.stats.decode_errors += 1
                    self._say(
                        feed, "decode", self.clock(), "KV event replayed from %s dropped: %s",
                        feed.worker_id, exc,
                    )  # fmt: skip
                    continue
                if batch.bad_events:
                    feed.stats.decode_errors += batch.bad_events
                into[seq] = batch
        except (zmq.ZMQError, OSError) as exc:
            log.warning("replay from %s failed: %s", feed.worker_id, exc)
            return False
        finally:
            sock.close()

    async def replay(self, feed: WorkerFeed, start: int, stop: int) -> int:
        """Fetch and apply batches ``start .. stop-1`` from the worker's replay socket, at once.

        For a feed with no gap under way (a diagnosis, a test): the batches are
        applied in order as speculative entries, and their clears and removals
        are skipped, as nothing says how they relate to what the live feed
        applied. Gaps are repaired by the feed itself (see the module
        docstring). Returns how many batches were applied.
        """
        got: dict[int, EventBatch] = {}
        await self._fetch(feed, start, got)
        applied = 0
        for seq in sorted(got):
            if seq >= stop:
                break
            stored = tuple(e for e in got[seq].events if isinstance(e, EngineBlockStored))
            feed.stats.replayed += 1
            applied += 1
            self._apply(feed, stored, self.clock(), trusted=False)
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
        for feed in self._feeds.values():
            self._drop_replay(feed)
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
        "Gaps in a worker's KV-event sequence (replayed, or entries demoted to speculative)",
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


def _unfilled(
    start: int, top: int, held: Mapping[int, object], replayed: Mapping[int, object]
) -> Iterator[int]:
    """The numbers from ``start`` to ``top`` (the newest held message) that are
    neither held nor replayed."""
    return (seq for seq in range(start, top + 1) if seq not in held and seq not in replayed)
