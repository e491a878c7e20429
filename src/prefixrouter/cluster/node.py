"""One replica's membership of the cluster: publish its facts, apply its peers', watch them.

A :class:`ClusterNode` sits between the replica's
:class:`~prefixrouter.core.dispatch.Dispatcher` (created with
``record_facts=True``) and the :class:`~prefixrouter.cluster.transport.NatsLink`:

* **Publish**: when a fact lands in the dispatcher's empty outbox (the
  dispatcher tells it: no polling) the publisher drains the outbox and
  publishes it as few messages as fit (:mod:`~prefixrouter.cluster.codec`),
  each in an :mod:`~prefixrouter.cluster.envelope` numbered in this life.
  After a quiet spell (no publish for :data:`QUIET_S`, 50 ms) that is at
  once: the publisher runs as soon as the callback that recorded the fact
  returns (the end of the event loop's tick), so every fact of that callback
  goes in one message, on caches still warm from recording it, and the fact
  waits no window. In a busy spell the fact waits a window for the facts
  that follow it; while they keep coming (the next one lands within a window
  of the last publish) the window doubles, from ``batch_window_s`` up to
  ``max_batch_window_s``, so a busy replica sends one message per window and
  no fact waits longer than the longest window. Most of sync's cost is per
  message (wakeups, the socket write, the receive path, a peer's apply call
  with cold caches), so at a few hundred requests per second this cuts the
  messages per request. A message's send time is when its first fact was
  recorded, so the propagation lag its peers measure includes the wait.
  A message larger than the server takes (NATS's ``max_payload``) is dropped
  and counted (``too_large``): no peer would receive it. Drained facts that no
  connection takes (nats-py buffers 2 MiB while it reconnects) are dropped
  and counted (``disconnected``): a peer that misses them learns the
  placement from its own traffic, like a replica without sync. A replica
  that lost facts after publishing some starts a new epoch, so no peer keeps
  one of its routings open for want of the lost settlement.
* **Apply**: each message heard is taken once, in its sender's order
  (envelope ``seq``; see :meth:`ClusterNode.on_facts`), passes the
  :class:`~prefixrouter.cluster.registry.PeerRegistry` (own, stale epoch,
  other fingerprint: not applied), then each fact goes to
  :meth:`Dispatcher.apply_peer <prefixrouter.core.dispatch.Dispatcher.apply_peer>`
  as ``replica@epoch`` at the local clock's now. A routing or worker fact
  naming a worker this replica does not have is dropped (``unknown_worker``);
  a settlement of a routing never heard here (it joined after it, or the
  routing's fact was dropped) is counted ``unmatched``. With
  ``apply_within_s`` > 0 (the gateway's default) a live message is only
  held when it arrives, with its arrival time: the held messages are applied
  in one pass just before the dispatcher next routes or reads its state
  (:meth:`Dispatcher.hold_peer_facts
  <prefixrouter.core.dispatch.Dispatcher.hold_peer_facts>`), before a
  heartbeat, a sweep or a catch-up message, or ``apply_within_s`` after the
  first was held, whichever comes first. No routing misses a fact heard
  before it; what is saved is a cold pass per message. Each live routing is
  applied with the time it was made (its arrival minus its propagation lag
  and a batch window), from which the dispatcher expects how many peers'
  routings each of its own does not see (:mod:`prefixrouter.core.unseen`).
* **Watch**: a heartbeat every ``heartbeat_s``; a peer silent for
  ``peer_ttl_s``, or heard under a newer epoch, is gone:
  :meth:`Dispatcher.peer_gone` settles its open routings so its in-flight
  counts vanish (its placements stay: the engines did get those requests).
* **Bound**: a peer routing still open ``max_open_s`` after it was applied
  (longer than any request may run at its origin: the gateway passes its
  ``proxy.request_timeout_s`` plus ``peer_ttl_s``) lost its settlement on
  the way; each sweep settles those.
* **Refuse**: for ``1.5 * heartbeat_s`` after its first connection (every
  live peer heartbeats in that time; a starting replica's hello makes them
  answer at once) a starting replica compares its fingerprint with each live
  older peer's; a difference fails the node (:attr:`ClusterNode.error` names
  the differing fields) and the gateway exits. So does a live older
  replica heartbeating under this replica's own id: two processes with one id
  would each end the other's life at every peer, which then drops the facts
  of whichever is older. Heartbeats are never stored, so one heard is from a
  process alive now (a restart's earlier life is silent); the older replica
  logs the duplicate and keeps running. A stream that is another cluster's
  fails the node too (:mod:`~prefixrouter.cluster.transport`).
* **Ready** once the stream is replayed and that check has passed; or,
  with ``ready_without_nats_s``, that long after the start if the stream
  could not be replayed by then (NATS unreachable, JetStream off): the
  replica routes on its own view and is ready (``standalone``), so replicas
  restarted during a NATS outage still take traffic; it replays and joins
  when NATS answers.

Not thread-safe: everything runs on the gateway's event loop, as the
dispatcher requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from prefixrouter.cluster import envelope as env_mod
from prefixrouter.cluster.codec import (
    DEFAULT_MAX_BYTES,
    DecodeError,
    count_facts,
    decode_facts,
    encode_facts,
)
from prefixrouter.cluster.envelope import (
    FACTS,
    HEARTBEAT,
    Envelope,
    EnvelopeError,
    OtherVersion,
)
from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.registry import SELF, PeerRegistry
from prefixrouter.cluster.transport import LinkOptions, NatsLink
from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.facts import RoutedFact, WorkerFact
from prefixrouter.core.types import WorkerId

log = logging.getLogger("prefixrouter.cluster")

READY, CHECKING, REPLAYING, CONNECTING, STANDALONE, REFUSED = (
    "ready", "checking", "replaying", "connecting", "standalone", "refused"
)  # fmt: skip
"""The values of :attr:`ClusterNode.status`."""

QUIET_S = 0.05
"""A fact this long after the last publish goes at once (module doc: Publish);
sooner, it waits a window for the facts that follow it."""

MAX_HELD = 256
"""Live messages held at most before they are applied anyway (a bound on memory)."""

LAG_SAMPLES = 8192
"""Recent propagation lags kept for percentiles (``/admin/process``, the benchmark)."""


@dataclass(frozen=True, slots=True)
class NodeOptions:
    """How one replica takes part (the gateway's ``cluster:`` section)."""

    link: LinkOptions
    replica_id: str
    heartbeat_s: float = 1.0
    peer_ttl_s: float = 5.0
    batch_window_s: float = 0.002
    max_batch_window_s: float = 0.004
    max_message_bytes: int = DEFAULT_MAX_BYTES
    max_open_s: float = 900.0
    apply_within_s: float = 0.0
    ready_without_nats_s: float | None = None


@dataclass
class ClusterStats:
    """Counters the gateway exports (``prefixrouter_cluster_*``)."""

    published_facts: int = 0
    published_messages: int = 0
    applied_facts: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    peers_gone: int = 0
    duplicate_messages: int = 0
    missed_messages: int = 0
    expired_routings: int = 0
    publish_cpu_s: float = 0.0
    receive_cpu_s: float = 0.0
    apply_cpu_s: float = 0.0
    apply_passes: int = 0
    lag_count: int = 0
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))

    @property
    def sync_cpu_s(self) -> float:
        """CPU spent on sync: draining, encoding and publishing (``publish``), taking a
        message heard (``receive``: its check and its hold), and unpacking, decoding and
        applying it (``apply``); nats-py's own protocol work is not counted."""
        return self.publish_cpu_s + self.receive_cpu_s + self.apply_cpu_s

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def figures(self) -> dict[str, float | int]:
        """The counters as flat figures (``/admin/process``: the sync benchmark reads them)."""
        return {
            "cluster_sync_cpu_s": self.sync_cpu_s,
            "cluster_publish_cpu_s": self.publish_cpu_s,
            "cluster_receive_cpu_s": self.receive_cpu_s,
            "cluster_apply_cpu_s": self.apply_cpu_s,
            "cluster_apply_passes": self.apply_passes,
            "cluster_facts_published": self.published_facts,
            "cluster_messages_published": self.published_messages,
            "cluster_facts_applied": self.applied_facts,
            "cluster_lag_count": self.lag_count,
        }


class ClusterNode:
    """One replica in the cluster (module doc).

    Args:
        options: The replica id, NATS link and timings.
        dispatcher: The replica's dispatcher (recording facts).
        has_worker: Whether this replica has a worker of that id.
        fingerprint: This replica's configuration fingerprint.
        clock: The dispatcher's clock (monotonic seconds).
        observe_lag: Called with each live message's propagation lag (seconds).
    """

    def __init__(
        self,
        options: NodeOptions,
        dispatcher: Dispatcher,
        has_worker: Callable[[WorkerId], bool],
        fingerprint: Fingerprint,
        clock: Callable[[], float] = time.monotonic,
        observe_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.options = options
        self.dispatcher = dispatcher
        self.has_worker = has_worker
        self.fingerprint = fingerprint
        self.clock = clock
        self.observe_lag = observe_lag
        self.epoch = env_mod.new_epoch()
        self._start_epoch = self.epoch  # which peers are older than this process
        self._published_in_life = False
        self.registry = PeerRegistry(
            options.replica_id, self.epoch, fingerprint.value, options.peer_ttl_s
        )
        self.stats = ClusterStats()
        self.link = NatsLink(
            options.link, self.on_facts, self.on_heartbeat, self._on_connected, self._refuse
        )
        self._started: float | None = None  # when start() ran (the standalone wait's origin)
        self.error: str | None = None
        self.failed = asyncio.Event()
        self._checked = False
        self._check_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat_now = asyncio.Event()
        self._pending = asyncio.Event()
        self._first_wall = 0.0  # when the outbox's first fact was recorded (0: empty)
        self._next_open_check = clock() + options.max_open_s / 10  # see sweep
        self.window_s = options.batch_window_s  # the current batch window
        self._warned: set[str] = set()
        self._own = env_mod.sender_key(self._envelope(FACTS))
        self._seq = 0  # the last facts message numbered in this life
        # origin -> the last message seq taken from it. Kept after a life ends
        # (one int per peer life ever heard): a catch-up may re-read its messages.
        self._heard: dict[str, int] = {}
        # Live messages heard and not applied yet, with when: see apply_held.
        self._held: list[tuple[bytes, float, float]] = []
        self._hold_timer: asyncio.TimerHandle | None = None

    @property
    def origin(self) -> str:
        """This replica's own ``replica@epoch``."""
        return f"{self.options.replica_id}@{self.epoch}"

    @property
    def ready(self) -> bool:
        """May take traffic (:attr:`status` ``ready`` or ``standalone``)."""
        return self.status in (READY, STANDALONE)

    @property
    def status(self) -> str:
        """Where the replica stands: ``ready`` (replayed, compatibility checked),
        ``checking`` (replayed, the check's window open), ``replaying`` (NATS
        reached, the stream not read yet), ``connecting`` (NATS not reached),
        ``standalone`` (not replayed ``ready_without_nats_s`` after the start:
        ready on its own view) or ``refused`` (:attr:`error`)."""
        if self.error is not None:
            return REFUSED
        if self.link.replayed:
            return READY if self._checked else CHECKING
        wait = self.options.ready_without_nats_s
        if wait is not None and self._started is not None and self.clock() - self._started >= wait:
            return STANDALONE
        return REPLAYING if self.link.reached else CONNECTING

    @property
    def connected(self) -> bool:
        return self.link.connected

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect (in the background) and start publishing and heartbeating."""
        loop = asyncio.get_running_loop()
        self._started = self.clock()
        await self.link.start()
        self._tasks = [
            loop.create_task(self._publisher(), name="cluster-publish"),
            loop.create_task(self._heartbeats(), name="cluster-heartbeat"),
        ]

    async def stop(self) -> None:
        """Publish what is left, then stop the tasks and the link."""
        self.dispatcher.on_first_fact(None)
        self.apply_held()
        with contextlib.suppress(Exception):
            await self.flush()
        tasks = [*self._tasks, *([self._check_task] if self._check_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.link.close()

    def _refuse(self, why: str) -> None:
        """Fail the node: the gateway exits with :attr:`error` (one line, its own)."""
        if self.error is None:
            self.error = (
                f"replica {self.options.replica_id!r} cannot join cluster "
                f"{self.options.link.cluster!r}: {why}"
            )
            self.failed.set()

    def _envelope(self, kind: int) -> Envelope:
        return Envelope(kind, self.options.replica_id, self.epoch, self.fingerprint.value, 0.0)

    # ------------------------------------------------------------- publish

    def _fact_recorded(self) -> None:
        # The dispatcher's listener, inside the recording call: only schedule.
        self._first_wall = time.time()
        self._pending.set()

    async def _publisher(self) -> None:
        # Woken by the dispatcher when a fact lands in its empty outbox: at
        # once after a quiet spell (this task runs when the recording callback
        # returns), else a window after the last publish (module doc: Publish).
        loop = asyncio.get_running_loop()
        pending = self._pending
        self.dispatcher.on_first_fact(self._fact_recorded)
        last = -1e9
        while True:
            await pending.wait()
            since = loop.time() - last
            self.window_s = self.next_window(since)
            if since < QUIET_S:  # a busy spell: company for this fact is likely
                await asyncio.sleep(self.window_s)
            pending.clear()
            await self.flush()
            last = loop.time()

    def next_window(self, since_last_publish_s: float) -> float:
        """The next spacing: doubled (up to the maximum) while facts keep coming, else the base.

        Used in a busy spell only (a publish within :data:`QUIET_S`); after a
        quiet spell a fact goes at once.

        Args:
            since_last_publish_s: From the last publish to the fact that opens this window.
        """
        opts = self.options
        if since_last_publish_s < self.window_s:
            return min(opts.max_batch_window_s, max(opts.batch_window_s, 2 * self.window_s))
        return opts.batch_window_s

    async def flush(self) -> None:
        """Drain the dispatcher's outbox and publish it (dropped and counted if no link)."""
        t0 = time.thread_time()
        facts = self.dispatcher.drain_facts()
        # The first fact's time, read before any await (a fact recorded meanwhile opens
        # the next batch). A direct flush of facts the listener never saw: now.
        wall, self._first_wall = self._first_wall or time.time(), 0.0
        if not facts:
            return
        opts, limit = self.options, self.link.max_payload
        # Half the server's limit at most: room for the envelope and the last fact's strings.
        messages = encode_facts(facts, min(opts.max_message_bytes, limit // 2))
        replica, fp = opts.replica_id, self.fingerprint.value
        st = self.stats
        sent = failed = 0
        for body in messages:
            head = Envelope(FACTS, replica, self.epoch, fp, wall, self._seq + 1)
            data = env_mod.pack(head, body)
            if len(data) > limit:
                # No server would take it (a routing of some 100k blocks): its facts
                # never reach a peer, which learns them from its own traffic. Nothing
                # of it is open anywhere, so no new life is needed.
                st.drop("too_large", count_facts(body))
                log.warning("cluster: a facts message of %d bytes is over the server's %d; "
                            "dropped", len(data), limit)  # fmt: skip
                continue
            if await self.link.publish_facts(data):
                self._seq += 1
                sent += 1
                st.published_facts += count_facts(body)
            else:
                failed += count_facts(body)
        if failed:
            st.drop("disconnected" if not self.link.connected else "publish_failed", failed)
            if self._published_in_life or sent:
                self._new_life()
        elif sent:
            self._published_in_life = True
        st.published_messages += sent
        st.publish_cpu_s += time.thread_time() - t0

    def _new_life(self) -> None:
        """Publish under a new epoch from now on, after facts of this life were lost.

        Peers may hold routings of this life open whose settlement was just
        dropped: they would count in flight for as long as this replica
        lives. A new epoch ends the old life at every peer (its open routings
        are settled), and this life starts with nothing open anywhere.
        Settlements of requests routed in the old life then arrive unmatched.
        """
        old = self.origin
        self.epoch = env_mod.new_epoch()
        self.registry.epoch = self.epoch
        self._own = env_mod.sender_key(self._envelope(FACTS))
        self._seq = 0
        self._published_in_life = False
        log.warning("cluster: facts of %s were lost; publishing as %s", old, self.origin)

    # ------------------------------------------------------------- apply

    def on_facts(self, data: bytes, live: bool) -> None:
        """Apply one facts message (``live``: straight from the live subscription, so its
        propagation lag is recorded; not a catch-up's or one held during it).

        Each sender life's messages are taken in increasing envelope ``seq``
        only: one heard again (the catch-up and the live subscription overlap
        around a switch, and a catch-up after a reconnection re-reads a margin)
        is skipped and counted (``duplicate_messages``), and a jump counts the
        messages that never arrived (``missed_messages``: their facts are lost
        to this replica, which learns those placements from its own traffic).
        """
        if env_mod.is_from(data, self._own):
            return  # this life's own message (the catch-up reads them): skipped before any work
        t0 = time.thread_time()
        if live and self.options.apply_within_s > 0:
            held = self._held
            held.append((data, self.clock(), time.time()))
            if len(held) == 1:
                self.dispatcher.hold_peer_facts(self.apply_held)
                self._hold_timer = asyncio.get_running_loop().call_later(
                    self.options.apply_within_s, self.apply_held
                )
            elif len(held) >= MAX_HELD:
                self.apply_held()
            self.stats.receive_cpu_s += time.thread_time() - t0
            return
        if self._held:
            self.apply_held()
            t0 = time.thread_time()
        self.stats.apply_passes += 1
        self._apply(data, live, self.clock(), time.time())
        self.stats.apply_cpu_s += time.thread_time() - t0

    def apply_held(self) -> None:
        """Apply the live messages held so far, in the order heard (module doc: Apply)."""
        held, self._held = self._held, []
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if not held:
            return
        self.dispatcher.hold_peer_facts(None)
        t0 = time.thread_time()  # the pass as a whole: two clock reads, not two a message
        for data, now, wall in held:
            self._apply(data, True, now, wall)
        st = self.stats
        st.apply_passes += 1
        st.apply_cpu_s += time.thread_time() - t0

    def _apply(self, data: bytes, live: bool, now: float, wall: float) -> None:
        """Apply one message heard at ``now`` (``wall``); the caller counts its CPU."""
        st = self.stats
        try:
            head, body = env_mod.unpack(data)
            if head.kind != FACTS:
                raise EnvelopeError(f"kind {head.kind} on the facts subject")
        except OtherVersion as exc:
            self._other_version(exc)
            return
        except EnvelopeError:
            st.drop("malformed")
            return
        seq = head.seq
        origin = head.origin
        if seq:  # 0: a sender that does not number its messages
            last = self._heard.get(origin, 0)
            if seq <= last:
                st.duplicate_messages += 1
                return
            if last and seq > last + 1:
                st.missed_messages += seq - last - 1
            self._heard[origin] = seq
        verdict = self.registry.admit(head, now, wall)
        for ended in verdict.gone:
            self._peer_gone(ended, "restarted under a new epoch")
        if verdict.drop == SELF:
            return
        try:
            facts = decode_facts(body)
        except DecodeError:
            st.drop("malformed")
            return
        if verdict.drop is not None:
            st.drop(verdict.drop, len(facts))
            return
        routed_at = None  # a replayed message's routings: not concurrent with ours
        if live:
            # From the recording of the message's first fact (its batch wait included).
            lag = max(0.0, wall - head.sent_wall)
            st.lags.append(lag)
            st.lag_count += 1
            if self.observe_lag is not None:
                self.observe_lag(lag)
            # When its routings were made, on this clock (about: the first of them).
            routed_at = now - lag
        apply, has = self.dispatcher.apply_peer, self.has_worker
        applied = 0
        for fact in facts:
            if isinstance(fact, RoutedFact | WorkerFact) and not has(fact.worker):
                st.drop("unknown_worker")
            elif apply(origin, fact, now, routed_at):
                applied += 1
            else:
                st.drop("unmatched")
        st.applied_facts += applied

    def _peer_gone(self, origin: str, why: str) -> None:
        n = self.dispatcher.peer_gone(origin)
        self.stats.peers_gone += 1
        log.info("cluster: peer %s is gone (%s); %d routings of it no longer in flight",
                 origin, why, n)  # fmt: skip

    # ------------------------------------------------------------- heartbeats

    def heartbeat_message(self, hello: bool) -> bytes:
        """This replica's heartbeat (``hello``: it is starting, peers answer at once)."""
        body = orjson.dumps({"fields": dict(self.fingerprint.fields), "hello": hello})
        head = self._envelope(HEARTBEAT)
        head = Envelope(HEARTBEAT, head.replica, head.epoch, head.fingerprint, time.time())
        return env_mod.pack(head, body)

    async def _heartbeats(self) -> None:
        interval = self.options.heartbeat_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heartbeat_now.wait(), interval)
            self._heartbeat_now.clear()
            await self.link.publish_heartbeat(self.heartbeat_message(hello=False))
            self.sweep()

    def sweep(self) -> list[str]:
        """End the lives of peers silent for ``peer_ttl_s`` (return their origins), and
        settle peer routings open longer than ``max_open_s`` (their settlement was lost)."""
        now = self.clock()
        registry = self.registry
        if self._held and registry.silent(now):
            # Heard before the sweep: applied before any peer is judged gone. Not
            # otherwise: held messages wait for the next routing (one pass for more).
            self.apply_held()
        gone = registry.expire(now)
        for origin in gone:
            self._peer_gone(origin, f"silent for {self.options.peer_ttl_s:g} s")
        max_open = self.options.max_open_s
        if now >= self._next_open_check:
            # A bound of many minutes, checked every tenth of it (reading the open
            # routings applies what is held: not at every heartbeat).
            self._next_open_check = now + max_open / 10
            self.stats.expired_routings += self.dispatcher.peer_expire(now - max_open)
        return gone

    def on_heartbeat(self, data: bytes) -> None:
        """A peer's heartbeat: liveness, a hello to answer, or a configuration that differs."""
        try:
            head, body = env_mod.unpack(data)
            info = orjson.loads(bytes(body))
            fields = info["fields"]
            hello = bool(info.get("hello"))
            if head.kind != HEARTBEAT or not isinstance(fields, dict):
                raise ValueError("not a heartbeat")
        except OtherVersion as exc:
            self._other_version(exc)
            return
        except (EnvelopeError, ValueError, KeyError, TypeError):
            self.stats.drop("malformed")
            return
        if head.replica == self.options.replica_id:
            if head.epoch != self.epoch:
                if hello:
                    self._heartbeat_now.set()  # so the starting one hears this one at once
                self._same_id(head)
            return
        if self._held and self.registry.ends_life(head):
            self.apply_held()  # a new epoch ends the old life after the facts heard before
        if hello:
            self._heartbeat_now.set()  # answer a starting replica at once
        if head.fingerprint != self.fingerprint.value:
            self._incompatible(head, {str(k): str(v) for k, v in fields.items()})
            return
        verdict = self.registry.admit(head, self.clock(), time.time())
        for origin in verdict.gone:
            self._peer_gone(origin, "restarted under a new epoch")

    def _other_version(self, exc: OtherVersion) -> None:
        """A message of another release's wire format: dropped, counted, said once."""
        self.stats.drop("other_version")
        said = f"version {exc.version}"
        if said not in self._warned:
            self._warned.add(said)
            log.warning(
                "cluster: a peer speaks wire version %d, this replica %d (another release); "
                "its messages are ignored until every replica runs one release",
                exc.version,
                env_mod.VERSION,
            )

    def _same_id(self, head: Envelope) -> None:
        """Another live process heartbeats under this replica's id (module doc: Refuse)."""
        self._refuse_or_say(
            head,
            f"live replica {head.origin} already uses the id {head.replica!r} (give each "
            "replica its own: --replica-id or cluster.replica_id)",
            logging.ERROR,
            "cluster: another live replica uses this replica's id %r (%s, this one is %s); "
            "peers drop the facts of the older of the two: give each replica its own id",
            head.replica,
            head.origin,
            self.origin,
        )

    def _incompatible(self, head: Envelope, fields: dict[str, str]) -> None:
        names = ", ".join(self.fingerprint.differing(fields)) or "fingerprint"
        self._refuse_or_say(
            head,
            f"its configuration differs from live peer {head.replica!r} in {names} "
            "(every replica must hash prompts alike)",
            logging.WARNING,
            "cluster: peer %s has a different configuration (%s); its facts are dropped",
            head.origin,
            names,
        )

    def _refuse_or_say(
        self, head: Envelope, refusal: str, level: int, message: str, *args: object
    ) -> None:
        """What ``head``'s sender shows is wrong: a starting replica (its check's window
        open) is refused for it if the sender is older; else it is logged once per
        sender life. Nothing more once refused: the one line says it."""
        if self.error is not None:
            return
        if not self._checked and head.epoch < self._start_epoch:
            self._refuse(refusal)
        elif head.origin not in self._warned:
            self._warned.add(head.origin)
            log.log(level, message, *args)

    async def _on_connected(self, up: bool) -> None:
        if up:
            await self.link.publish_heartbeat(self.heartbeat_message(hello=True))
            if self._check_task is None:
                self._check_task = asyncio.get_running_loop().create_task(
                    self._compatibility_window(), name="cluster-check"
                )

    async def _compatibility_window(self) -> None:
        await asyncio.sleep(1.5 * self.options.heartbeat_s)
        self._checked = True
