"""The NATS link of one replica: live facts over core NATS, a bounded JetStream stream behind them.

Subjects, for a cluster named ``C``:

* ``prefixrouter.C.facts``: batches of facts. A JetStream stream
  (``PREFIXROUTER_C``, file storage, bounded by ``max_age_s`` and
  ``max_bytes``, oldest dropped first) captures the subject. Replicas publish
  with core NATS publish (no per-message acknowledgement to wait for: the
  server stores what reaches it, in order) and read it two ways:

  - **live**, over a plain core-NATS subscription on a connection made with
    ``no_echo`` (the server never sends a replica its own messages back). Per
    message this is the cheapest path nats-py has: no JetStream metadata to
    parse, no flow control, no consumer heartbeats;
  - **catch-up**, over an ephemeral JetStream pull consumer (no acks), only
    when the live subscription cannot have heard everything: at the first
    connection (from the stream's first message: the *replay* a starting
    replica does before it is ready) and after every reconnection (from
    :data:`CATCH_UP_MARGIN_S` before the connection was lost). It reads up to
    the stream's last sequence as it stood once the live subscription was in
    place (or until nothing is pending), then the consumer is deleted.

* ``prefixrouter.C.heartbeat``: heartbeats, core NATS only (not stored: a
  replayed heartbeat would say nothing about who is alive now).

**The stream is the cluster's, not a replica's.** The first replica to find
no stream creates it with its bounds; a replica that finds it leaves it as
it is. One whose bounds differ says so once (the stream's bounds hold: a
replica configured with ``max_age_s: 5`` must not cut every peer's replay to
five seconds), and one that finds the stream capturing another subject (a
stream name two clusters share: ``cluster.stream``, or names that differ in
case only) cannot use it: the link fails (:attr:`NatsLink.error`) and the
gateway exits naming both.

**The switch-over.** During a catch-up the live subscription is already
subscribed and its messages are held back; when the catch-up has read its
last message, the held ones are passed on, then live messages go straight
through. Around the switch a message may be heard twice (stored before the
catch-up's end and heard live) and after a reconnection the catch-up re-reads
the margin: the receiver applies each sender life's messages in increasing
envelope ``seq`` only (:mod:`~prefixrouter.cluster.envelope`), so nothing is
applied twice, and what the catch-up read before the held messages keeps each
sender's order.

**Replayed.** :attr:`NatsLink.replayed` turns true when the first catch-up
ends. Readiness waits for it.

**Faults.** The client reconnects forever (every ``reconnect_s``); while it
is away publishes are buffered by nats-py up to its pending limit, past which
they are dropped and counted by the caller. A first connection that fails is
retried the same way in the background. ``on_connected(bool)`` reports every
change. A catch-up that fails (JetStream not answering) is retried every
``reconnect_s`` while live messages are held; each kind of failure is logged
once, not at every retry (a server without JetStream says so: start it with
``-js``). A server that comes back without its store has lost the stream
and, with it, what was published while it was away and not heard live: the
link makes the stream again and peers that missed those facts count them
(``missed``) and learn those placements from their own traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from prefixrouter.errors import exception_text

log = logging.getLogger("prefixrouter.cluster")

OnMessage = Callable[[bytes, bool], None]
"""A facts message and whether it came straight from the live subscription."""

CATCH_UP_MARGIN_S = 2.0
"""How far before a lost connection a catch-up starts reading: the messages
stored just before the loss that were still on their way, and the clock
offset between this host and the NATS server (what it re-reads is skipped by
``seq``)."""

FETCH_BATCH = 512
"""Messages per catch-up fetch."""

DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""nats-server's default ``max_payload``: the bound before the server's INFO tells it."""


class LinkUnusable(Exception):
    """What retrying cannot mend: the stream is another cluster's (module doc), or the
    server does not offer the TLS this replica requires."""


def stream_name(cluster: str) -> str:
    """The JetStream stream of ``cluster``'s facts (letters, digits, ``_`` and ``-``)."""
    return "PREFIXROUTER_" + re.sub(r"[^A-Za-z0-9_-]", "_", cluster).upper()


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """Where and how the link connects (see :class:`~prefixrouter.cluster.node.NodeOptions`)."""

    url: str
    cluster: str = "default"
    stream: str = ""
    max_age_s: float = 600.0
    max_bytes: int = 256 * 1024 * 1024
    reconnect_s: float = 0.5
    fetch_timeout_s: float = 2.0
    tls: ssl.SSLContext | None = None
    """Set: the connection must be TLS, verified with this context (the gateway's
    ``cluster.tls_*``); None: TLS where the server requires it, system CAs."""

    @property
    def facts_subject(self) -> str:
        return f"prefixrouter.{self.cluster}.facts"

    @property
    def heartbeat_subject(self) -> str:
        return f"prefixrouter.{self.cluster}.heartbeat"


class NatsLink:
    """One replica's connection (module doc).

    Args:
        options: Server, cluster and stream bounds.
        on_facts: Called with each facts message, in each sender's order.
        on_heartbeat: Called with each heartbeat message.
        on_connected: Called with True on every (re)connection, False on every loss.
        on_failed: Called once with :attr:`error` when the link cannot work
            (retrying would not help: the stream is another cluster's).
    """

    def __init__(
        self,
        options: LinkOptions,
        on_facts: OnMessage,
        on_heartbeat: Callable[[bytes], None],
        on_connected: Callable[[bool], Awaitable[None]],
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        self.options = options
        self._on_facts = on_facts
        self._on_heartbeat = on_heartbeat
        self._on_connected = on_connected
        self._on_failed = on_failed
        self.error: str | None = None
        self._retry_said = ""  # the last retry warning logged (each said once)
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._catch_up_task: asyncio.Task[None] | None = None
        self.replayed = False
        self.connected = False
        self._closing = False
        self._warned = False  # "cannot reach NATS" logged since the last connection
        self._holding = True  # live messages held back until a catch-up ends
        self._held: list[bytes] = []
        self._since: float | None = None  # wall time a catch-up reads from (None: the start)
        self.catch_ups = 0  # catch-ups completed (the first is the replay)
        self.caught_up_messages = 0  # messages the catch-ups read
        self.stream = options.stream or stream_name(options.cluster)
        self._bounds_said = False  # the stream's other bounds logged

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (its ``max_payload``; NATS's default
        before the first connection)."""
        nc = self._nc
        return nc.max_payload if nc is not None and nc.max_payload > 0 else DEFAULT_MAX_PAYLOAD

    @property
    def reached(self) -> bool:
        """Connected to a NATS server now (the stream may not be read yet: :attr:`connected`)."""
        nc = self._nc
        return nc is not None and nc.is_connected

    @property
    def live(self) -> bool:
        """Live messages go straight through (no catch-up under way)."""
        return not self._holding

    async def start(self) -> None:
        """Connect in the background (returns at once; see :attr:`connected`)."""
        self._task = asyncio.get_running_loop().create_task(self._connect(), name="nats-link")
        self._task.add_done_callback(self._connect_ended)

    def _connect_ended(self, task: asyncio.Task[None]) -> None:
        # The connecting task retries what a retry can mend; anything else ends it,
        # and a link that stopped connecting must not leave a replica unready in silence.
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        # The gateway exits with the one line the node makes of it.
        if isinstance(exc, LinkUnusable):
            self._fail(str(exc))
        else:
            self._fail(f"the NATS link stopped: {exception_text(exc)}")

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            if self._on_failed is not None:
                self._on_failed(why)

    def _retrying(self, what: str, exc: BaseException) -> None:
        """Log a retry's cause once (until another cause, or a success, comes)."""
        if isinstance(exc, ServiceUnavailableError | NoRespondersError):
            why = (
                f"JetStream is not enabled on the NATS server at {self.options.url} "
                "(start nats-server with -js)"
            )
        else:
            why = f"{what}: {str(exc) or type(exc).__name__}"
        if why != self._retry_said:
            self._retry_said = why
            log.warning("cluster: %s; retrying every %.1f s", why, self.options.reconnect_s)
        else:
            log.debug("cluster: %s; retrying", why)

    async def close(self) -> None:
        """Stop connecting, drop the subscriptions and close the connection."""
        self._closing = True
        for task in (self._task, self._catch_up_task):
            if task is not None:
                task.cancel()
                # A task that failed was reported when it ended (_connect_ended).
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._task = self._catch_up_task = None
        nc, self._nc = self._nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        self.connected = False

    async def publish_facts(self, data: bytes) -> bool:
        """Publish one facts message; False when no connection takes it (not yet, or full)."""
        return await self._publish(self.options.facts_subject, data)

    async def publish_heartbeat(self, data: bytes) -> bool:
        """Publish one heartbeat; False when no connection takes it."""
        return await self._publish(self.options.heartbeat_subject, data)

    async def _publish(self, subject: str, data: bytes) -> bool:
        nc = self._nc
        if nc is None or nc.is_closed:
            return False
        try:
            await nc.publish(subject, data)
        except NatsError:  # outbound buffer full while reconnecting, or closing
            return False
        return True

    # ------------------------------------------------------------- connection

    async def _connect(self) -> None:
        opts = self.options
        while True:
            try:
                # nats-py retries a first connection too (every reconnect_s,
                # forever); its error callback logs the first failure.
                nc = await nats.connect(
                    opts.url,
                    connect_timeout=2,
                    reconnect_time_wait=opts.reconnect_s,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    ping_interval=5,
                    max_outstanding_pings=2,
                    no_echo=True,  # never hear one's own messages live
                    **({"tls": opts.tls} if opts.tls is not None else {}),
                    disconnected_cb=self._disconnected,
                    reconnected_cb=self._reconnected,
                    error_cb=self._error,
                    name="prefixrouter",
                )
                break
            except (TimeoutError, OSError, NatsError) as exc:
                await self._error(exc)
                await asyncio.sleep(opts.reconnect_s)
        self._nc = nc
        # nats-py upgrades to TLS only when the server asks for it, whatever
        # context it was given: a replica that requires TLS checks it got it.
        if opts.tls is not None and not getattr(nc, "_server_info", {}).get("tls_required"):
            await nc.close()
            self._nc = None
            raise LinkUnusable(
                f"cluster.tls_* are set but the NATS server at {opts.url} does not offer TLS"
            )
        # Subscribed before the catch-up reads the stream's last sequence, so
        # every message stored after that point is heard live.
        await nc.subscribe(opts.heartbeat_subject, cb=self._heartbeat)
        await nc.subscribe(opts.facts_subject, cb=self._live)
        while True:
            try:
                await self._ensure_stream(nc)
                await self._catch_up(nc)
                break
            except (TimeoutError, NatsError) as exc:  # JetStream not up yet
                self._retrying(f"cannot read stream {self.stream}", exc)
                await asyncio.sleep(opts.reconnect_s)
        self.connected = True
        self._warned = False
        self._retry_said = ""
        log.info("cluster: connected to NATS at %s (stream %s)", opts.url, self.stream)
        await self._on_connected(True)

    async def _ensure_stream(self, nc: Client) -> None:
        """Create the stream, or take it as it is (module doc: the stream is the cluster's).

        Raises:
            LinkUnusable: It exists capturing another subject.
        """
        opts = self.options
        js = nc.jetstream()
        config = StreamConfig(
            name=self.stream,
            subjects=[opts.facts_subject],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=opts.max_age_s,
            max_bytes=opts.max_bytes,
            storage=StorageType.FILE,
        )
        refused: BadRequestError | None = None
        for _ in range(2):  # a peer may create it between the look and the add
            try:
                existing = (await js.stream_info(self.stream)).config
            except NotFoundError:
                try:
                    await js.add_stream(config)
                    return
                except BadRequestError as exc:  # made meanwhile (look again), or refused
                    refused = exc
                    continue
            self._take_existing(existing)
            return
        # Twice refused and still absent: another stream captures the subject.
        why = refused.description if refused is not None else "refused"
        raise LinkUnusable(
            f"cannot create the JetStream stream {self.stream} for {opts.facts_subject}: {why} "
            "(another stream captures this cluster's subject: set cluster.stream to its name)"
        )

    def _take_existing(self, existing: StreamConfig) -> None:
        opts = self.options
        subjects = list(existing.subjects or [])
        if subjects != [opts.facts_subject]:
            raise LinkUnusable(
                f"the JetStream stream {self.stream} captures {', '.join(subjects) or 'nothing'}, "
                f"not this cluster's {opts.facts_subject}: it is another cluster's (set "
                "cluster.stream to a name of this cluster's own)"
            )
        age, size = existing.max_age or 0.0, existing.max_bytes or 0
        if (abs(age - opts.max_age_s) > 1e-3 or size != opts.max_bytes) and not self._bounds_said:
            self._bounds_said = True
            log.warning(
                "cluster: stream %s keeps max_age %gs and max_bytes %d, not this replica's "
                "cluster.max_age_s %g and cluster.max_bytes %d (the stream is the cluster's: "
                "change its bounds on the stream itself, e.g. `nats stream edit`)",
                self.stream, age, size, opts.max_age_s, opts.max_bytes,
            )  # fmt: skip

    # ------------------------------------------------------------- catch-up

    async def _catch_up(self, nc: Client) -> None:
        """Read the stream from :attr:`_since` to its last sequence, then let live through.

        Live messages are held from before this starts (the subscription is
        in place, or the connection was lost) until it ends.
        """
        js = nc.jetstream()
        self._holding = True
        state = (await js.stream_info(self.stream)).state
        target = state.last_seq
        read = 0
        if state.messages > 0:
            since = self._since
            config = ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
                opt_start_time=None
                if since is None
                else datetime.datetime.fromtimestamp(since, datetime.UTC),
                inactive_threshold=30.0,  # the server drops it if this replica dies meanwhile
                mem_storage=True,
            )
            sub = await js.pull_subscribe(
                self.options.facts_subject, stream=self.stream, config=config
            )
            consumer = ""
            try:
                info = await sub.consumer_info()
                consumer, pending = info.name, info.num_pending or 0
                while pending > 0:
                    batch = await sub.fetch(
                        min(FETCH_BATCH, pending), timeout=self.options.fetch_timeout_s
                    )
                    for msg in batch:
                        self._on_facts(msg.data, False)
                        read += 1
                        meta = msg.metadata
                        pending = meta.num_pending or 0
                        if meta.sequence.stream >= target:
                            pending = 0
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                if consumer:  # else inactive_threshold removes it
                    with contextlib.suppress(Exception):
                        await js.delete_consumer(self.stream, consumer)
        # The switch: what was heard live meanwhile, in order, then live itself.
        # No await from here on, so no live message slips in between.
        held, self._held = self._held, []
        self._holding = False
        for data in held:
            self._on_facts(data, False)
        self.catch_ups += 1
        self.caught_up_messages += read
        if not self.replayed:
            self.replayed = True
            log.info("cluster: replayed the stream up to sequence %d (%d messages)", target, read)
        elif read or held:
            log.info("cluster: caught up on %d stored messages after the outage", read)

    async def _catch_up_after_reconnect(self) -> None:
        while not self._closing:
            nc = self._nc
            if nc is None or not nc.is_connected:
                return  # lost again: the next reconnection starts another
            try:
                await self._catch_up(nc)
                self._retry_said = ""
                return
            except (TimeoutError, NatsError) as exc:
                self._retrying(f"cannot catch up on stream {self.stream}", exc)
                await asyncio.sleep(self.options.reconnect_s)

    async def _live(self, msg: Msg) -> None:
        if self._holding:
            self._held.append(msg.data)
        else:
            self._on_facts(msg.data, True)

    async def _heartbeat(self, msg: Msg) -> None:
        self._on_heartbeat(msg.data)

    def _mark_lost(self) -> None:
        # From here until a catch-up ends, live messages are held; the
        # catch-up starts reading a margin before now.
        if not self._holding:
            self._holding = True
            self._since = time.time() - CATCH_UP_MARGIN_S

    async def _disconnected(self) -> None:
        if self._closing:
            return
        if self.replayed:
            self._mark_lost()
        if self.connected:
            self.connected = False
            self._warned = True  # this line says it; reconnect failures stay quiet
            log.warning(
                "cluster: lost the connection to NATS at %s; routing on this replica's own "
                "view until it returns",
                self.options.url,
            )
            await self._on_connected(False)

    async def _reconnected(self) -> None:
        nc = self._nc
        if nc is not None:
            # A server that lost its store lost the stream: make it again.
            try:
                await self._ensure_stream(nc)
            except LinkUnusable as exc:  # another cluster made it meanwhile
                self._fail(str(exc))
                return
            except (TimeoutError, NatsError):
                pass  # the catch-up below retries until JetStream answers
            if self.replayed:
                self._mark_lost()  # in case no disconnection was reported
                if self._catch_up_task is not None:
                    self._catch_up_task.cancel()
                # Not awaited here: nats-py awaits this callback in its reconnect path.
                self._catch_up_task = asyncio.get_running_loop().create_task(
                    self._catch_up_after_reconnect(), name="nats-catch-up"
                )
        self.connected = True
        self._warned = False
        # A warning, as the loss was: the end of an outage is worth a line too.
        log.warning("cluster: reconnected to NATS at %s; catching up", self.options.url)
        await self._on_connected(True)

    async def _error(self, exc: Any) -> None:
        if not self.connected and not self._warned and not self._closing:
            self._warned = True
            log.warning(
                "cluster: cannot reach NATS at %s (%s); routing on this replica's own view, "
                "retrying every %.1f s",
                self.options.url,
                str(exc) or type(exc).__name__,
                self.options.reconnect_s,
            )
        else:
            log.debug("cluster: NATS client error: %s", exc)
