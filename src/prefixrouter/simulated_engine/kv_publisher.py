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
with vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixrouter.core.types import BlockHash


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
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        block_size: int,
        max_blocks: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = topic.encode("utf-8")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.clock = clock
        self.seq = 0
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
        seq = self.seq.to_bytes(8, "big")
        self.seq += 1
        self._sock.send_multipart([self.topic, seq, payload], flags=zmq.NOBLOCK)

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
