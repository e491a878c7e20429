"""vLLM's KV-event publisher, for the simulated engine server.

With ``--kv-events-endpoint`` the engine server publishes its prefix cache's
changes the way vLLM does (see :mod:`prefixrouter.real_engines.kv_events` for the
format), so a gateway can be tested against a KV-event feed without vLLM:

* a ZMQ PUB socket that *connects* to a plain ``tcp://host:port`` endpoint
  (the router binds) and *binds* an endpoint with ``*`` (every gateway
  replica connects to it) or an ``ipc://`` path, as vLLM decides (:func:`binds`);
* three frames per message: topic, sequence (uint64 big-endian, from 0),
  msgpack ``[ts, [event, ...], data_parallel_rank]``; events in vLLM's map
  encoding (``{"type": "BlockStored", ...}``);
* ``BlockStored`` per run of newly cached blocks with the blocks' token ids
  and, on a chain's first block, the request's ``cache_salt`` in
  ``extra_keys``, as vLLM folds it into the first block's hash;
  ``BlockRemoved`` on eviction; ``AllBlocksCleared`` on a cache reset.

Block ids are the engine's own chained hashes (seeded per model and salt),
which a router cannot extend: like vLLM's, they must be translated through
the token ids. The token ids of a block are remembered from the request that
brought it (bounded: the oldest unremembered blocks go first) until the
engine evicts it.

A message that cannot be queued (no subscriber connected and the queue full)
is dropped, silently, by the PUB socket (a PUB send never blocks nor fails);
the sequence number still advances, so the router sees a gap, as it would
with vLLM. :meth:`KvEventPublisher.drop_next` drops batches on purpose (fault
injection) the same way.

Replay (``replay_endpoint``, vLLM's): a ROUTER socket, bound, answers
``[b"", start_seq]`` with one ``[b"", topic, seq, payload]`` per buffered
batch from ``start_seq`` on (the last ``REPLAY_BATCHES``, sent or dropped),
then the end marker ``[b"", topic, END_SEQ, b""]``, as vLLM 0.32 does.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixrouter.core.types import BlockHash
from prefixrouter.real_engines.kv_events import END_SEQ

REPLAY_BATCHES = 4096
"""Batches the replay socket keeps (vLLM keeps a bounded buffer too)."""


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ``::``, IPC or in-process address, connect to a plain one.

    As ``ZmqEventPublisher._is_bind_endpoint`` in ``vllm/distributed/kv_events.py`` (vLLM 0.32).
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Publishes one engine's KV events on a ZMQ PUB socket.

    Args:
        endpoint: ZMQ address (see :func:`binds`).
        topic: The engine's topic (the router tells engines apart by it).
        block_size: Tokens per block.
        max_blocks: Blocks whose token ids are remembered (at least the KV size).
        clock: Wall clock for the batch timestamp.
        replay_endpoint: Bind a replay socket here (None: no replay); it is
            served by :meth:`serve_replay`, which the app runs as a task.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        max_blocks: int,
        clock: Callable[[], float] = time.time,
        replay_endpoint: str | None = None,
    ) -> None:
        self.topic = topic.encode("utf-8")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.clock = clock
        self.seq = 0
        self.replay_endpoint = replay_endpoint
        self._dropping = 0
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._blocks: OrderedDict[BlockHash, tuple[tuple[int, ...], str | None]] = OrderedDict()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        if binds(endpoint):
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)

    def remember(self, hashes: Sequence[BlockHash], ids: Sequence[int], salt: str | None) -> None:
        """A request's blocks and their token ids (before the engine may store them)."""
        bs = self.block_size
        blocks = self._blocks
        for i, h in enumerate(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = (tuple(ids[i * bs : (i + 1) * bs]), salt if i == 0 else None)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Send one batch (a no-op for an empty list)."""
        encoded = [e for e in map(self._encode, events) if e is not None]
        if not encoded:
            return
        payload = msgpack.packb([self.clock(), encoded, 0])
        seq = self.seq
        self.seq += 1
        if self.replay_endpoint is not None:
            self._sent.append((seq, payload))
        if self._dropping:
            self._dropping -= 1  # lost on the way: the sequence number is used all the same
            return
        self._sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    def drop_next(self, n: int) -> None:
        """Do not send the next ``n`` batches (they stay replayable): a gap for the router."""
        self._dropping = n

    async def serve_replay(self) -> None:
        """Answer replay requests on :attr:`replay_endpoint` until cancelled (module doc)."""
        if self.replay_endpoint is None:
            return
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.replay_endpoint)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    continue  # not a replay request
                ident, start_frame = frames[0], frames[-1]
                start = int.from_bytes(start_frame[:8], "big")
                for seq, payload in list(self._sent):
                    if seq >= start:
                        await sock.send_multipart(
                            [ident, b"", self.topic, seq.to_bytes(8, "big"), payload]
                        )
                await sock.send_multipart([ident, b"", self.topic, END_SEQ, b""])
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close()
            ctx.term()

    def _encode(self, event: KvEvent) -> dict[str, Any] | None:
        if isinstance(event, BlockStored):
            tokens: list[int] = []
            salt: str | None = None
            for i, h in enumerate(event.block_hashes):
                known = self._blocks.get(h)
                if known is None:
                    return None  # forgotten (bounded memory): say nothing rather than lie
                tokens.extend(known[0])
                if i == 0 and event.parent_hash is None:
                    salt = known[1]
            return {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_hash,
                "token_ids": tokens,
                "block_size": self.block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [[salt]] if salt is not None else None,
            }
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._blocks.pop(h, None)
            return {
                "type": "BlockRemoved",
                "block_hashes": list(event.block_hashes),
                "medium": "GPU",
            }
        if isinstance(event, AllBlocksCleared):
            self._blocks.clear()
            return {"type": "AllBlocksCleared"}
        return None

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()
        self._ctx.term()
