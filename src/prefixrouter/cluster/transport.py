"""The NATS JetStream link of one replica: a bounded stream of facts, heartbeats, reconnects.

Subjects, for a cluster named ``C``:

* ``prefixrouter.C.facts``: batches of facts. A JetStream stream
  (``PREFIXROUTER_C``, file storage, bounded by ``max_age_s`` and
  ``max_bytes``, oldest dropped first) captures the subject, so a replica
  that starts replays what its peers did before it. Replicas publish with
  core NATS publish (no per-message acknowledgement to wait for: the server
  stores what reaches it, in order) and every replica reads the stream with
  an *ordered push consumer* from its first message: ephemeral, no acks,
  flow-controlled, and recreated from the last sequence read when the
  client sees a gap or the server's idle heartbeats stop (a NATS restart),
  so a replica catches up by itself after an outage.
* ``prefixrouter.C.heartbeat``: heartbeats, core NATS only (not stored: a
  replayed heartbeat would say nothing about who is alive now).

**Replayed.** When it subscribes, the link reads the stream's last sequence;
it is :attr:`NatsLink.replayed` once it has read that far (or the stream was
empty, or the consumer reports nothing pending). Readiness waits for it.

**Faults.** The client reconnects forever (every ``reconnect_s``); while it
is away publishes are buffered by nats-py up to its pending limit, past which
they are dropped and counted by the caller. A first connection that fails is
retried the same way in the background. ``on_connected(bool)`` reports every
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

log = logging.getLogger("prefixrouter.cluster")

OnMessage = Callable[[bytes, bool], None]
"""A facts message and whether the link has replayed the stream by it."""


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
    idle_heartbeat_s: float = 1.0

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
        on_facts: Called with each facts message, in stream order.
        on_heartbeat: Called with each heartbeat message.
        on_connected: Called with True on every (re)connection, False on every loss.
    """

    def __init__(
        self,
        options: LinkOptions,
        on_facts: OnMessage,
        on_heartbeat: Callable[[bytes], None],
        on_connected: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.options = options
        self._on_facts = on_facts
        self._on_heartbeat = on_heartbeat
        self._on_connected = on_connected
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._target: int | None = None  # the stream's last sequence when we subscribed
        self.replayed = False
        self.connected = False
        self._closing = False
        self._warned = False  # "cannot reach NATS" logged since the last connection
        self.stream = options.stream or stream_name(options.cluster)

    async def start(self) -> None:
        """Connect in the background (returns at once; see :attr:`connected`)."""
        self._task = asyncio.get_running_loop().create_task(self._connect(), name="nats-link")

    async def close(self) -> None:
        """Stop connecting, drop the subscriptions and close the connection."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
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
        while True:
            try:
                await self._subscribe(nc)
                break
            except (TimeoutError, NatsError) as exc:  # JetStream not up yet
                log.warning("cluster: cannot set up stream %s: %s; retrying", self.stream, exc)
                await asyncio.sleep(opts.reconnect_s)
        self.connected = True
        self._warned = False
        log.info("cluster: connected to NATS at %s (stream %s)", opts.url, self.stream)
        await self._on_connected(True)

    async def _ensure_stream(self, nc: Client) -> None:
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
        try:
            await js.add_stream(config)
        except BadRequestError:  # exists with other bounds: take this replica's
            await js.update_stream(config)

    async def _subscribe(self, nc: Client) -> None:
        await self._ensure_stream(nc)
        js = nc.jetstream()
        info = await js.stream_info(self.stream)
        state = info.state
        self._target = state.last_seq
        if state.messages == 0:
            self.replayed = True
        await nc.subscribe(self.options.heartbeat_subject, cb=self._heartbeat)
        await js.subscribe(
            self.options.facts_subject,
            stream=self.stream,
            cb=self._facts,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            idle_heartbeat=self.options.idle_heartbeat_s,
        )

    async def _facts(self, msg: Msg) -> None:
        if not self.replayed:
            meta = msg.metadata
            target = self._target or 0
            if meta.sequence.stream >= target or meta.num_pending == 0:
                self.replayed = True
                log.info("cluster: replayed the stream up to sequence %d", meta.sequence.stream)
        self._on_facts(msg.data, self.replayed)

    async def _heartbeat(self, msg: Msg) -> None:
        self._on_heartbeat(msg.data)

    async def _disconnected(self) -> None:
        if self.connected and not self._closing:
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
            with contextlib.suppress(NatsError, asyncio.TimeoutError, NotFoundError):
                await self._ensure_stream(nc)
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
