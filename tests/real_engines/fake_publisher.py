"""A fake vLLM KV-event publisher on loopback, and the helpers its tests share.

:class:`BoundEngine` stands in for one engine's ``ZmqEventPublisher`` as vLLM
0.32 runs it with ``"endpoint": "tcp://*:P"``: it *binds* a PUB socket and a
replay ROUTER socket (on 127.0.0.1 here), and gateway replicas' subscribers
connect to both. What goes over them is vLLM's wire format, as
:mod:`prefixrouter.real_engines.kv_events` describes and decodes it:

* a message is three frames: the topic (UTF-8), the sequence number (uint64
  big-endian, from 0 per publisher) and a msgpack payload
  ``[ts, [event, ...], data_parallel_rank]`` (:func:`frames`, :func:`payload`);
  ``ts`` is the wall time now unless given (an older stamp is backlog);
* events are positional arrays, the older vLLM (and SGLang) encoding
  (:func:`store`); the simulated engine's publisher,
  :class:`prefixrouter.simulated_engine.kv_publisher.KvEventPublisher`, sends
  vLLM's map encoding instead;
* the replay socket answers ``[id, b"", start]`` with one
  ``[id, b"", topic, seq, payload]`` per kept batch from ``start`` on, then
  the end marker ``[id, b"", b"", END_SEQ, b""]`` (an empty topic frame;
  ``KvEventPublisher.serve_replay`` puts the topic there, and
  :func:`prefixrouter.real_engines.kv_subscriber.parse_replay_reply` reads both).

Unlike the real publishers, it can lose a batch on purpose (numbered and kept
for replay, never sent: a gap) and hold its replay replies back (a replay
slower than the live feed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import msgpack
import zmq
import zmq.asyncio

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.hashing import BlockHasher, hash_token_blocks
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import BlockHash, EntrySource, WorkerId
from prefixrouter.harness.ports import free_port
from prefixrouter.real_engines.kv_events import END_SEQ
from prefixrouter.real_engines.kv_subscriber import KvEventSubscriber

BS = 4
"""Tokens per block."""
SEED = 555
"""The cache namespace's seed (every block's router hash starts from it)."""
W = WorkerId("w0")
"""The one worker the engine serves."""
TOPIC = "kv@w0"
"""The engine's topic."""
TOKENS = list(range(100, 124))
"""A document's tokens (six blocks)."""
OURS = hash_token_blocks(SEED, TOKENS, BS)
"""The router's hashes of :data:`TOKENS`' blocks."""
OTHER = list(range(300, 316))
"""Another document's tokens (four blocks)."""
OTHERS = hash_token_blocks(SEED, OTHER, BS)
"""The router's hashes of :data:`OTHER`'s blocks."""


def payload(events: list[object], ts: float | None = None) -> bytes:
    """A batch's msgpack payload, stamped ``ts`` (default now: older stamps are backlog)."""
    packed: bytes = msgpack.packb([time.time() if ts is None else ts, events, 0])
    return packed


def frames(topic: str, seq: int, events: list[object], ts: float | None = None) -> list[bytes]:
    """A message as vLLM publishes it: topic, sequence number, :func:`payload`."""
    return [topic.encode(), seq.to_bytes(8, "big"), payload(events, ts)]


def store(hashes: list[int], parent: int | None, tokens: Sequence[int]) -> list[object]:
    """A ``BlockStored`` event (the array encoding, up to ``lora_id`` and ``medium``)."""
    return ["BlockStored", hashes, parent, list(tokens), BS, None, None]


class BoundEngine:
    """An engine's publisher and replay socket as vLLM 0.32 runs them, both bound.

    vLLM's ``ZmqEventPublisher`` *binds* its PUB socket (an endpoint with
    ``*``) and its replay ROUTER socket, numbers batches from 0, keeps each
    batch for replay, and answers ``[id, b"", start]`` with one
    ``[id, b"", topic, seq, payload]`` per kept batch from ``start`` on and an
    end marker (module doc). Each replay request's ``start`` is recorded in
    :attr:`requests`.

    ``pub_port``/``replay_port``: the ports to bind (default: free ones; a
    restarted engine binds its predecessor's). ``publish(lose=True)`` numbers
    and keeps a batch without sending it: the subscriber sees a gap.
    ``hold_replies``: each replay request is answered with the batches kept
    *when it arrived*, but only once :attr:`release` is set (a replay slower
    than the live feed).
    """

    def __init__(
        self,
        topic: str = TOPIC,
        pub_port: int | None = None,
        replay_port: int | None = None,
        *,
        hold_replies: bool = False,
    ) -> None:
        self.topic = topic.encode()
        self.publisher = f"tcp://127.0.0.1:{pub_port or free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port or free_port()}"
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []
        self.release = asyncio.Event()
        if not hold_replies:
            self.release.set()
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.publisher)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(self.replay_endpoint)
        self.server = asyncio.get_running_loop().create_task(self._serve())

    async def publish(self, events: list[object], lose: bool = False) -> bytes:
        """Number, keep and send one batch; returns its payload."""
        seq, self.seq = self.seq, self.seq + 1
        body = payload(events)
        self.buffer.append((seq, body))
        if not lose:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])
        return body

    async def _serve(self) -> None:
        while True:
            ident, _, start_frame = await self.replay.recv_multipart()
            start = int.from_bytes(start_frame, "big")
            self.requests.append(start)
            kept = [(s, p) for s, p in self.buffer if s >= start]
            await self.release.wait()
            for seq, body in kept:
                reply = [ident, b"", self.topic, seq.to_bytes(8, "big"), body]
                await self.replay.send_multipart(reply)
            await self.replay.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def heard_by(self, *subs: KvEventSubscriber) -> None:
        """Probe on an unknown topic until every subscriber hears this publisher.

        A bound PUB socket drops what it sends before a subscriber's connection
        and subscription have arrived (ZMQ's slow joiner).
        """
        start = [s.unknown_topics for s in subs]
        for _ in range(300):
            await self.pub.send_multipart(frames("probe", 0, []))
            await asyncio.sleep(0.01)
            if all(s.unknown_topics > n for s, n in zip(subs, start, strict=True)):
                return
        raise AssertionError("a subscriber never heard the publisher")

    async def close(self) -> None:
        """Stop the replay server and close the sockets (once; again is a no-op)."""
        if self.ctx.closed:
            return
        self.server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.server
        self.pub.close()
        self.replay.close()
        self.ctx.term()


@asynccontextmanager
async def subscribers(
    engine: BoundEngine,
    n: int = 1,
    clock: Callable[[], float] = lambda: 10.0,
    replay: bool = True,
) -> AsyncIterator[tuple[list[KvEventSubscriber], list[Router]]]:
    """``n`` started subscribers (as ``n`` gateway replicas) connected to ``engine``.

    Each feeds its own router; worker :data:`W` on the engine's topic, its
    replay socket used unless ``replay`` is false. Yields once every
    subscriber hears the engine; stops them all on the way out.
    """
    routers = [Router(create_policy("prefix_aware"), BlockHasher(block_size=BS)) for _ in range(n)]
    subs = [KvEventSubscriber(None, Dispatcher(r), clock) for r in routers]
    for sub in subs:
        sub.add_worker(
            W,
            engine.topic.decode(),
            lambda lora, salt: SEED,
            replay_endpoint=engine.replay_endpoint if replay else None,
            publisher=engine.publisher,
        )
        await sub.start()
    try:
        await engine.heard_by(*subs)
        yield subs, routers
    finally:
        for sub in subs:
            await sub.stop()


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``cond`` every 10 ms until it holds; fail after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def sources(router: Router, blocks: Sequence[BlockHash]) -> list[EntrySource | None]:
    """Where :data:`W`'s entry of each block came from (None: no entry)."""
    return [e.source if (e := router.index.entry(W, b)) is not None else None for b in blocks]


def held(router: Router, blocks: Sequence[BlockHash]) -> int:
    """How many leading blocks of ``blocks`` :data:`W` holds."""
    m = router.index.match(blocks, 10.0).get(W)
    return m.blocks if m is not None else 0
