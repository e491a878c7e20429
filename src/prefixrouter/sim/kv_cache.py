"""A paged KV cache with prefix reuse over chained block hashes (vLLM-like).

The cache has ``num_blocks`` blocks of ``block_size`` tokens. A block is in one
of three states:

* **empty**: holds nothing; counted, not stored.
* **hashed**: holds a full prompt block identified by its chained
  :data:`~prefixrouter.core.types.BlockHash`. It has a reference count (running
  requests using it) and a last-used time. With ``ref > 0`` it is pinned; with
  ``ref == 0`` it stays cached and is *evictable*.
* **anonymous**: held by one request but not reusable: the partial tail block of
  a prompt, the decode blocks, and full blocks whose tokens are not computed yet
  or whose hash another block already holds. Released when the request frees.

Invariants (checked by :meth:`KvCache.check`)::

    empty + len(hashed) + sum(anonymous held by requests) == num_blocks
    evictable == {hashed blocks with ref == 0}

Eviction order: least recently freed first. When a request frees its chain,
the *tail* blocks are released before the head (vLLM's ``free_blocks`` walks the
chain in reverse), so a chain's head — the part other requests are most likely
to share — is evicted last. The evictable set is an ``OrderedDict`` used as an
O(1) LRU queue (``move_to_end`` / ``popitem(last=False)`` are C operations).

Registration of full blocks happens either at allocation (``register=True``, the
simple mode) or as the engine computes them (``register=False`` then
:meth:`KvCache.commit`): vLLM caches a block once its tokens are scheduled, so a
second request with the same prompt arriving mid-prefill reuses only what is
already computed. One call to :meth:`~KvCache.commit` corresponds to one
``BlockStored`` event per contiguous run of new hashes, as vLLM sends one per
prefill chunk.

vLLM detail kept here: a fully cached prompt still recomputes its last token
(the engine needs that token's logits), so a hit covers at most
``prompt_tokens - 1`` tokens, rounded down to whole blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixrouter.core.types import BlockHash


@dataclass(slots=True)
class _RequestBlocks:
    """The blocks one request holds."""

    hashes: Sequence[BlockHash]  # the prompt's full-block hashes
    chain: list[BlockHash]  # hashed blocks it pins, in prompt order
    anonymous: int  # blocks it holds that are not (yet) hashed
    next_commit: int  # index into hashes of the first block not yet registered


@dataclass(slots=True)
class StoredRun:
    """Blocks newly registered as one contiguous run of a prompt's chain.

    Attributes:
        parent: Hash of the block before the run (None at the chain's head).
        hashes: The new hashes, in chain order.
    """

    parent: BlockHash | None
    hashes: list[BlockHash]


@dataclass(slots=True)
class Allocation:
    """What :meth:`KvCache.allocate` did.

    Attributes:
        cached_blocks: Leading prompt blocks reused from cache.
        stored: Runs of newly registered hashes (for ``BlockStored``).
        evicted: ``(hash, age)`` of each block evicted to make room, age being
            ``now - last used`` (for ``BlockRemoved`` and eviction metrics).
    """

    cached_blocks: int
    stored: list[StoredRun] = field(default_factory=list)
    evicted: list[tuple[BlockHash, float]] = field(default_factory=list)

    @property
    def stored_hashes(self) -> list[BlockHash]:
        """All newly registered hashes, flattened."""
        return [h for run in self.stored for h in run.hashes]


@dataclass(slots=True)
class EvictionStats:
    """Summary of evicted blocks' ages (seconds between last use and eviction).

    ``histogram[i]`` counts ages in ``[2^(i-1), 2^i)`` seconds for ``i >= 1`` and
    ages below 1 s in bucket 0; ages of 2^30 s and more fall in the last bucket.
    """

    count: int = 0
    total_age: float = 0.0
    max_age: float = 0.0
    histogram: list[int] = field(default_factory=lambda: [0] * 32)

    def add(self, age: float) -> None:
        """Record one eviction of a block last used ``age`` seconds ago."""
        self.count += 1
        self.total_age += age
        if age > self.max_age:
            self.max_age = age
        # frexp's exponent e has 2^(e-1) <= age < 2^e: the bucket, without a log.
        bucket = 0 if age < 1.0 else min(31, math.frexp(age)[1])
        self.histogram[bucket] += 1

    @property
    def mean_age(self) -> float:
        """Mean age of evicted blocks (0 when none were evicted)."""
        return self.total_age / self.count if self.count else 0.0


class KvCache:
    """Block-granular KV cache with hash-based prefix reuse and LRU eviction.

    See the module docstring for states, invariants and eviction order.

    Args:
        num_blocks: Capacity in blocks.
        block_size: Tokens per block.
    """

    __slots__ = (
        "_empty",
        "_evictable",
        "_last_used",
        "_refs",
        "_requests",
        "block_size",
        "eviction_stats",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Hashed blocks: ref count and last-used time, in two flat dicts rather
        # than one object per block, so registering a block allocates nothing.
        self._refs: dict[BlockHash, int] = {}
        self._last_used: dict[BlockHash, float] = {}
        # Hashed blocks with ref == 0, least recently freed first.
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()
        self._empty = num_blocks
        self._requests: dict[str, _RequestBlocks] = {}
        self.eviction_stats = EvictionStats()

    # ----------------------------------------------------------------- queries

    @property
    def evictions(self) -> int:
        """Blocks evicted so far."""
        return self.eviction_stats.count

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests (pinned hashed blocks and anonymous blocks)."""
        return self.num_blocks - self._empty - len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Hashed blocks, pinned or evictable: what a new request could reuse."""
        return len(self._refs)

    @property
    def evictable_blocks(self) -> int:
        """Hashed blocks no request uses (reclaimable)."""
        return len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: empty plus evictable."""
        return self._empty + len(self._evictable)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` has an allocation."""
        return request_id in self._requests

    def blocks_needed(self, total_tokens: int) -> int:
        """Blocks that ``total_tokens`` tokens occupy."""
        return -(-total_tokens // self.block_size)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of ``hashes`` present in the cache (no mutation)."""
        refs = self._refs
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def usable_match(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """Leading blocks a new request would reuse: the match, capped by the last-token rule.

        The last prompt token is always recomputed, so at most
        ``(prompt_tokens - 1) // block_size`` blocks are reused.
        """
        return self._match_free(hashes, prompt_tokens)[0]

    def _match_free(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> tuple[int, int]:
        """``(usable match, how many of those blocks are evictable now)`` in one pass."""
        limit = max(0, (prompt_tokens - 1) // self.block_size)
        refs = self._refs
        n = unpinned = 0
        for h in hashes[:limit] if len(hashes) > limit else hashes:
            r = refs.get(h)
            if r is None:
                break
            n += 1
            if not r:
                unpinned += 1
        return n, unpinned

    def can_allocate(
        self, hashes: Sequence[BlockHash], prompt_tokens: int, total_tokens: int
    ) -> bool:
        """Whether :meth:`allocate` would succeed now (no mutation)."""
        usable, unpinned = self._match_free(hashes, prompt_tokens)
        return self._shortfall(usable, unpinned, total_tokens) <= 0

    def _shortfall(self, usable: int, unpinned: int, total_tokens: int) -> int:
        # Reused blocks that are evictable now leave the evictable pool when pinned.
        available = self._empty + len(self._evictable) - unpinned
        return self.blocks_needed(total_tokens) - usable - available

    # -------------------------------------------------------------- mutations

    def allocate(
        self,
        request_id: str,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        total_tokens: int,
        now: float,
        *,
        register: bool = True,
    ) -> Allocation | None:
        """Reserve blocks for a request, reusing its cached prefix.

        Pins the reusable leading blocks, then takes blocks for the rest of
        ``total_tokens`` from the empty pool and, when that runs out, by evicting
        least recently used evictable blocks.

        Args:
            request_id: Unique among requests holding blocks.
            hashes: The prompt's full-block hashes (``len * block_size <= prompt_tokens``).
            prompt_tokens: Prompt length (for the last-token rule).
            total_tokens: Tokens to reserve room for (prompt plus any decode room).
            now: Current time, for LRU ages.
            register: Register the prompt's uncached full blocks now. With False
                the caller registers them with :meth:`commit` as they are computed.

        Returns:
            What happened, or None if there is not enough room (nothing changed).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if len(hashes) * self.block_size > prompt_tokens or total_tokens < prompt_tokens:
            raise ValueError("hashes must cover at most prompt_tokens <= total_tokens")
        usable, unpinned = self._match_free(hashes, prompt_tokens)
        if self._shortfall(usable, unpinned, total_tokens) > 0:
            return None

        refs = self._refs
        chain = list(hashes[:usable])
        if unpinned:
            evictable = self._evictable
            for h in chain:
                r = refs[h]
                if not r:
                    del evictable[h]
                refs[h] = r + 1
        else:
            for h in chain:
                refs[h] += 1
        # last_used is only read when a block is evicted, which needs a free()
        # first, and free() stamps it; pinning need not.

        new = self.blocks_needed(total_tokens) - usable
        alloc = Allocation(usable)
        take = min(new, self._empty)
        self._empty -= take
        if new > take:
            alloc.evicted = self._evict(new - take, now)
        self._requests[request_id] = _RequestBlocks(hashes, chain, new, usable)
        if register:
            alloc.stored = self.commit(request_id, prompt_tokens, now)
        return alloc

    def _evict(self, n: int, now: float) -> list[tuple[BlockHash, float]]:
        refs = self._refs
        last_used = self._last_used
        popitem = self._evictable.popitem
        stats = self.eviction_stats
        hist = stats.histogram
        frexp = math.frexp
        total = 0.0
        oldest = stats.max_age
        out: list[tuple[BlockHash, float]] = []
        # EvictionStats.add, inlined: this loop runs once per evicted block.
        for _ in range(n):
            h, _unused = popitem(last=False)
            del refs[h]
            age = now - last_used.pop(h)
            total += age
            if age > oldest:
                oldest = age
            hist[0 if age < 1.0 else min(31, frexp(age)[1])] += 1
            out.append((h, age))
        stats.count += n
        stats.total_age += total
        stats.max_age = oldest
        return out

    def commit(self, request_id: str, computed_tokens: int, now: float) -> list[StoredRun]:
        """Register the request's full prompt blocks now covered by computed tokens.

        A block whose hash is already cached (another request computed the same
        prefix meanwhile) stays anonymous: the cache keeps one block per hash.

        Args:
            request_id: A request holding blocks.
            computed_tokens: Prompt tokens computed so far (cached ones included).
            now: Current time.

        Returns:
            The newly registered hashes as contiguous runs, for ``BlockStored``.
        """
        req = self._requests[request_id]
        hashes = req.hashes
        upto = min(computed_tokens // self.block_size, len(hashes))
        start = req.next_commit
        if upto <= start:
            return []
        refs = self._refs
        last_used = self._last_used
        chain = req.chain
        runs: list[StoredRun] = []
        run: list[BlockHash] | None = None
        for i in range(start, upto):
            h = hashes[i]
            if h in refs:
                run = None
                continue
            refs[h] = 1
            last_used[h] = now
            chain.append(h)
            if run is None:
                run = []
                runs.append(StoredRun(hashes[i - 1] if i else None, run))
            run.append(h)
        req.next_commit = upto
        registered = sum(len(r.hashes) for r in runs)
        req.anonymous -= registered
        assert req.anonymous >= 0, "registered more blocks than the request holds"
        return runs

    def grow(
        self, request_id: str, new_total_tokens: int, now: float
    ) -> list[tuple[BlockHash, float]] | None:
        """Extend a request's reservation to ``new_total_tokens`` tokens.

        Returns:
            The ``(hash, age)`` of blocks evicted to make room (often empty), or
            None if there is not enough room (nothing changed).
        """
        req = self._requests[request_id]
        # The request holds its pinned chain plus its anonymous blocks.
        need = self.blocks_needed(new_total_tokens) - len(req.chain) - req.anonymous
        if need <= 0:
            return []
        if need > self._empty + len(self._evictable):
            return None
        take = min(need, self._empty)
        self._empty -= take
        req.anonymous += need
        return self._evict(need - take, now) if need > take else []

    def free(self, request_id: str, now: float) -> None:
        """Release a request's blocks: hashed ones stay cached, anonymous ones empty.

        The chain is unpinned tail first, so its head is evicted last.
        """
        req = self._requests.pop(request_id)
        refs = self._refs
        last_used = self._last_used
        evictable = self._evictable
        # clear() empties the chains it unregisters, so every hash here is present.
        for h in reversed(req.chain):
            r = refs[h] - 1
            refs[h] = r
            if not r:
                last_used[h] = now
                evictable[h] = None
        self._empty += req.anonymous

    def clear(self) -> None:
        """Forget every hash (``AllBlocksCleared``).

        Evictable blocks become empty. Blocks pinned by running requests stay
        held but become anonymous: the requests keep their memory, nobody can
        reuse it any more.
        """
        for req in self._requests.values():
            req.anonymous += len(req.chain)
            req.chain = []
        self._empty += len(self._evictable)
        self._evictable.clear()
        self._refs.clear()
        self._last_used.clear()

    def check(self) -> None:
        """Assert the invariants (tests and debugging; O(cache size))."""
        held = sum(r.anonymous for r in self._requests.values())
        assert self._empty >= 0
        assert self._empty + len(self._refs) + held == self.num_blocks, "block count"
        assert self._refs.keys() == self._last_used.keys()
        refs: dict[BlockHash, int] = {}
        for r in self._requests.values():
            for h in r.chain:
                refs[h] = refs.get(h, 0) + 1
        for h, ref in self._refs.items():
            assert ref == refs.get(h, 0), f"ref count of {h}"
            assert (ref == 0) == (h in self._evictable), f"evictable state of {h}"
