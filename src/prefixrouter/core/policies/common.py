"""Building blocks that several of the peers' policies share.

* :data:`CHARS_PER_TOKEN`: converts the peers' character-denominated
  parameters (SGLang's tree size, vLLM's 128-character chunks, llm-d's
  64-character blocks, KubeAI's 100-character key) to tokens;
* :class:`TenantTree`: an approximate radix tree over chained block hashes
  with per-tenant LRU (SGLang, vLLM production-stack, llm-d, Dynamo, Ray,
  Preble keep one);
* :func:`request_rng`: deterministic per-request randomness, so a policy's
  ``select`` stays pure (power of two, vLLM's tie-break, llm-d's ties, Ray).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Collection, Sequence

import xxhash

from prefixrouter.core.types import BlockHash, WorkerId

CHARS_PER_TOKEN = 4.0
"""Characters per token, to convert the peers' character-denominated parameters."""


class TenantTree:
    """An approximate radix tree over chained block hashes, each node with tenants.

    ``holders``: block hash -> {tenant worker -> last access time}. A chained
    hash names its whole prefix, so this dict *is* the radix tree: node ``i`` of
    a prompt is ``hashes[i]`` and its parent is ``hashes[i - 1]``.
    ``lru``: worker -> its nodes, least recently used first; one insert touches
    its chain tail first, so a chain's head is the most recent and eviction
    removes leaves before their ancestors (as SGLang evicts leaves first).

    Invariants: ``w in holders[h]`` iff ``h in lru[w]``; ``len(self)`` is the
    number of (node, tenant) entries and never exceeds ``max_total`` after an
    insert. Times must be non-decreasing across inserts, so LRU order is also
    access-time order (:meth:`expire` relies on it).
    """

    __slots__ = ("_holders", "_lru", "_total", "max_total")

    def __init__(self, max_total: int) -> None:
        if max_total <= 0:
            raise ValueError(f"max_total must be positive, got {max_total}")
        self.max_total = max_total
        self._holders: dict[BlockHash, dict[WorkerId, float]] = {}
        self._lru: dict[WorkerId, OrderedDict[BlockHash, None]] = {}
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def size(self, worker: WorkerId) -> int:
        """Nodes ``worker`` is a tenant of."""
        lru = self._lru.get(worker)
        return len(lru) if lru is not None else 0

    def node_count(self) -> int:
        """Distinct nodes (blocks) with at least one tenant."""
        return len(self._holders)

    def has_node(self, block: BlockHash) -> bool:
        """Whether any tenant holds ``block``."""
        return block in self._holders

    def oldest(self, worker: WorkerId, n: int) -> list[BlockHash]:
        """Up to ``n`` of ``worker``'s least recently used nodes, oldest first."""
        lru = self._lru.get(worker)
        return list(itertools.islice(lru, max(0, n))) if lru is not None else []

    def workers(self) -> list[WorkerId]:
        """Workers holding at least one node."""
        return [w for w, lru in self._lru.items() if lru]

    def last_access(self, block: BlockHash, worker: WorkerId) -> float | None:
        """When ``worker`` last touched ``block``, if it holds it."""
        slot = self._holders.get(block)
        return slot.get(worker) if slot is not None else None

    def depths(
        self,
        hashes: Sequence[BlockHash],
        workers: Collection[WorkerId],
        not_before: float = -math.inf,
    ) -> dict[WorkerId, int]:
        """Leading blocks of ``hashes`` each of ``workers`` holds, consecutively.

        Args:
            hashes: A prompt's chained block hashes.
            workers: The workers to measure.
            not_before: Entries last touched before this count as absent (TTLs).

        Returns:
            worker -> matched blocks (0 for those holding no leading block).
        """
        result = dict.fromkeys(workers, 0)
        alive = list(result)
        holders = self._holders
        for depth, h in enumerate(hashes, 1):
            slot = holders.get(h)
            if slot is None:
                break
            alive = [w for w in alive if (t := slot.get(w)) is not None and t >= not_before]
            if not alive:
                break
            for w in alive:
                result[w] = depth
        return result

    def insert(
        self, worker: WorkerId, hashes: Sequence[BlockHash], now: float, cap: int | None = None
    ) -> None:
        """Make ``worker`` a tenant of every node of ``hashes``, touched at ``now``.

        Args:
            worker: The tenant.
            hashes: The prompt's chained block hashes.
            now: Access time.
            cap: If set, trim the worker to this many nodes at once (LRU).
        """
        lru = self._lru.get(worker)
        if lru is None:
            lru = self._lru[worker] = OrderedDict()
        holders = self._holders
        for h in reversed(hashes):  # tail first: the head ends most recent
            slot = holders.get(h)
            if slot is None:
                holders[h] = {worker: now}
            elif worker not in slot:
                slot[worker] = now
            else:
                slot[worker] = now
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._total += 1
        if cap is not None:
            self.evict_to(worker, cap)
        while self._total > self.max_total:
            largest = max(self._lru, key=lambda w: len(self._lru[w]))
            self.evict_to(largest, len(self._lru[largest]) - 1)

    def evict_to(self, worker: WorkerId, limit: int) -> int:
        """Drop ``worker``'s least recently used nodes until it holds ``limit``; how many."""
        lru = self._lru.get(worker)
        if lru is None:
            return 0
        dropped = 0
        while len(lru) > max(0, limit):
            h, _ = lru.popitem(last=False)
            self._detach(worker, h)
            dropped += 1
        return dropped

    def expire(self, cutoff: float) -> int:
        """Drop every entry last touched before ``cutoff``; returns how many."""
        dropped = 0
        holders = self._holders
        for worker, lru in self._lru.items():
            while lru:
                h = next(iter(lru))
                if holders[h][worker] >= cutoff:
                    break
                lru.popitem(last=False)
                self._detach(worker, h)
                dropped += 1
        return dropped

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` as a tenant of every node."""
        lru = self._lru.pop(worker, None)
        if lru is None:
            return
        for h in lru:
            slot = self._holders[h]
            del slot[worker]
            if not slot:
                del self._holders[h]
        self._total -= len(lru)

    def _detach(self, worker: WorkerId, h: BlockHash) -> None:
        slot = self._holders[h]
        del slot[worker]
        if not slot:
            del self._holders[h]
        self._total -= 1


def request_rng(request_id: str, seed: int) -> random.Random:
    """A private random stream for one request: deterministic, no global state.

    Args:
        request_id: The request's id.
        seed: The policy's seed, XORed into the id's hash.

    Returns:
        A fresh ``random.Random``; the same arguments give the same stream.
    """
    return random.Random(xxhash.xxh3_64_intdigest(request_id.encode("utf-8")) ^ seed)
