"""The prefix index: which workers (probably) hold which blocks.

Structure:

* ``_holders``: block hash -> {worker: None}, the workers holding it. One dict
  lookup per block answers "who holds block i", which is all that
  :meth:`PrefixIndex.match` needs.
* ``_lru``: worker -> ``OrderedDict`` of that worker's entries, block hash ->
  entry, least recently used first. It mirrors the engine's KV capacity:
  inserting past the worker's capacity evicts from the front, so the router
  forgets what the engine must have evicted too.
* ``_expiry``: a heap of speculative entries by expiry time. Entries we only
  *think* are cached (we routed a request there) expire after
  ``speculative_ttl_s`` unless confirmed or refreshed. A refresh only moves
  the entry's expiry time; the heap item is re-pushed when it surfaces, so
  a refresh costs no heap work. Items of entries confirmed, evicted or removed
  since are dead; they are dropped when they surface or, sooner, when the
  heap holds more than ``2 x`` the live speculative entries plus
  ``_EXPIRY_SLACK`` items: then it is rebuilt from its live items, and the
  heap stays bounded by what the index holds, not by the request rate times
  the TTL. The rebuild is incremental (see :meth:`PrefixIndex._compact_expiry`):
  rebuilt at once, a heap of 1.6 million items stopped the router for half a
  second.

**Entries are plain tuples of numbers**, not objects: ``(source, expires_at,
routings, ticket)`` for a speculative entry, and one shared constant for every
confirmed and for every event entry (their fields never differ). Python's
cyclic garbage collector tracks every instance of a class, and a full
collection walks them all: with entries as objects, an index of 1.6 million
entries paused the process for 0.72 s at each full collection, which the
allocation rate of a busy router triggers again and again. A tuple of numbers
is untracked after its first young collection and the ``{worker: None}``
holder dicts are never tracked, so a full collection is cheap and rare. The
price: an entry cannot be changed in place, so a change stores a new tuple
(the ``OrderedDict`` keeps its position); identity is the ``ticket``, unique
per speculative incarnation, which the heap items and :data:`Placement` carry.
:meth:`PrefixIndex.entry` returns an :class:`IndexEntry` view for inspection.

* ``_pins``: worker -> block hash -> how many requests in flight there hold
  it (:meth:`PrefixIndex.pin`, :meth:`PrefixIndex.unpin`). An engine cannot
  evict a block a running request uses: it evicts other cached blocks
  instead. An LRU of *touches* alone would forget first the prompts of the
  longest requests (routed, so touched, a minute ago and still decoding)
  while the engine keeps exactly those: on the whole Mooncake conversation
  trace (12,031 requests, load 0.9) the index forgot the history of 166
  requests in 2,000, nearly all with their previous turn still running
  where it was cached (with pins, 22 requests in 2,000 went where less was
  held unknowingly), and prefix_aware's mean TTFT was 10.98 s (3.90 s with
  pins). A pin waits per chain in ``_pins_waiting`` until an eviction on its
  worker needs the blocks counted (most requests end before one does).
* ``_parked``: worker -> the pinned entries eviction met at the LRU's front,
  block hash -> entry. Eviction takes the least recently used entry that no
  request pins; a pinned one it meets is moved out of the LRU order into
  ``_parked`` (still held, matched and counted in the capacity), so each
  eviction stays O(1) amortised even when most of a worker's entries are
  pinned (skipping them in place walked the same pinned entries at every
  eviction: minutes for the whole trace). When its last pin goes, a parked
  entry goes back to the LRU's recent end, tail first (an engine frees a
  finished request's blocks so). Any touch of a parked entry (a routing, an
  answer, an event) also puts it back into the LRU. Only when every entry of
  a worker is parked does eviction take the oldest parked entry: the pinned
  blocks outgrew the engine's room for prefixes, and the index stays bounded.
* ``_trust``: worker -> confidence in [min_trust, 1] and when it last changed.
  A miss (the engine reused far fewer tokens than predicted) drops the entries
  past the actual match and, unless the worker's cache is full (eviction
  explains it), multiplies trust by ``miss_decay``; a hit (or a
  reuse we did not predict) raises it by ``hit_recovery``; between reports it
  relaxes back toward 1 with time constant ``trust_recovery_s``. Without the
  relaxation a distrusted worker would never be predicted warm again, so it
  could never show that its cache works: a death spiral under cache churn.

Invariants (checked by the property tests):

* An entry exists in ``_holders[h][w]`` iff it exists in exactly one of
  ``_lru[w][h]`` and ``_parked[w][h]``; every parked entry is pinned.
* ``len(_lru[w]) + len(_parked[w]) <= capacity(w)`` and the total entry count
  ``<= max_entries``.
* ``expiry_items <= 2 * speculative_entries + _EXPIRY_SLACK`` whenever no
  rebuild is under way, and a rebuild ends within ``items / _DRAIN_STEP``
  changes.
* :meth:`match` never reports more blocks for a worker than the worker was
  given (by ``on_routed``, ``on_completed`` or an event).
* **Prefix closure**: if a worker holds block ``i`` of a chain, it holds
  blocks ``0..i-1``. Chains are touched tail first, so a prefix block is
  always more recent than every block that extends it and LRU eviction,
  expiry (a prefix is refreshed whenever an extension is) and removals
  (suffixes past a match) all take extensions first. :meth:`match` relies on
  it to binary-search the matched depth. Only an engine's ``BlockRemoved`` can
  break it (an engine may evict a block that others extend); such workers are
  verified block by block until their cache is cleared.

Eviction order inside a worker: least recently used first among the entries
no request pins and, within one chain, the tail first. A chain is touched
from its last block to its first, so its first block is the most recent:
evicting the head would orphan the whole chain, as vLLM's free-block queue
also avoids.

**Withdrawal**: :meth:`on_routed` returns the speculative entries it placed
or refreshed (a :data:`Placement`: their blocks and tickets). When the engine
did no prefill for that request (it refused it, or it was cut off before its
first byte), :meth:`withdraw` takes the routing back: each speculative entry
counts the routings that hold it (``routings``), and an entry no routing holds
any more is removed. An entry another routing still holds, one the engine
confirmed or reported since, or one evicted and created again (a new ticket)
is kept.

The index changes only through the explicit calls ``on_routed``, ``withdraw``,
``on_completed``, ``apply``, ``set_capacity``, ``pin``, ``unpin``,
``remove_worker`` and ``expire``;
:meth:`match` reads. ``now`` is always passed in; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import math
from collections import ChainMap, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import add, not_, sub
from typing import ClassVar, Final, cast

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixrouter.core.types import BlockHash, EntrySource, WorkerId

_INF = float("inf")
_EXPIRY_SLACK = 64
"""Dead expiry-heap items tolerated beyond twice the live speculative entries."""
_DRAIN_STEP = 4096
"""Items one expiry-heap rebuild step moves, beyond twice the pushes it pays for (~1 ms)."""
_exhaust: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
"""Runs an iterator for its side effects, at C speed and without a new deque per call."""


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One (block, worker) fact, as :meth:`PrefixIndex.entry` reports it (a copy).

    Attributes:
        source: How we learned it (speculative < confirmed < event).
        expires_at: Speculative entries expire; others have ``inf``.
        confidence: How sure we are the engine still holds it (source-based).
        routings: While speculative, the holds on it: each routing that placed
            or refreshed it and was not withdrawn, plus one that is never
            withdrawn for anything else that made it speculative (an untrusted
            event, a demotion). :meth:`PrefixIndex.withdraw` removes an entry
            whose holds reach 0. Zero for other sources.
    """

    source: EntrySource
    expires_at: float
    confidence: float
    routings: int


_Entry = tuple[int, float, int, int]
"""An entry as stored: ``(source, expires_at, routings, ticket)`` (see the module doc)."""
_SOURCE: Final = 0
_EXPIRES: Final = 1
_ROUTINGS: Final = 2
_TICKET: Final = 3

Placement = list[tuple[BlockHash, int]]
"""The speculative entries one :meth:`PrefixIndex.on_routed` call holds: (block, ticket)."""


@dataclass(slots=True)
class WorkerMatch:
    """The longest consecutive prefix of a request that one worker holds.

    Attributes:
        blocks: Leading blocks held.
        confidence: Worker trust times the weakest entry confidence on the chain.
        source: The weakest source on the matched chain.
    """

    blocks: int
    confidence: float
    source: EntrySource


@dataclass(frozen=True, slots=True)
class IndexParams:
    """Tuning of the index; defaults suit a cluster of GPU replicas.

    Attributes:
        speculative_ttl_s: Lifetime of an entry we only routed (Dynamo uses 120 s).
        default_capacity_blocks: Per-worker capacity until the engine reports its own.
        max_entries: Global cap on (block, worker) entries: bounded router memory.
        speculative_confidence: Confidence of an unconfirmed entry.
        miss_tolerance_blocks: A shortfall up to this many blocks is not a miss
            (engines recompute the last block of a fully cached prompt).
        miss_decay: Trust multiplier per miss.
        hit_recovery: Trust added per hit.
        min_trust: Trust never falls below this.
        trust_recovery_s: Time constant with which trust relaxes back to 1.
        eviction_explains_fill: A miss on a worker whose index is at least this
            full is put down to eviction and does not lower trust.
    """

    speculative_ttl_s: float = 120.0
    default_capacity_blocks: int = 100_000
    max_entries: int = 4_000_000
    speculative_confidence: float = 0.9
    miss_tolerance_blocks: int = 1
    miss_decay: float = 0.5
    hit_recovery: float = 0.1
    min_trust: float = 0.05
    trust_recovery_s: float = 60.0
    eviction_explains_fill: float = 0.75


# Sources as plain ints: an enum member is an object the collector tracks, and
# a tuple holding one would stay tracked (see the module docstring).
_SPECULATIVE = int(EntrySource.SPECULATIVE)
_CONFIRMED = int(EntrySource.CONFIRMED)
_EVENT = int(EntrySource.EVENT)
_SOURCES = tuple(EntrySource)  # int -> member, for reports
_CONFIRMED_ENTRY: _Entry = (_CONFIRMED, _INF, 0, 0)
_EVENT_ENTRY: _Entry = (_EVENT, _INF, 0, 0)
_STORED = {_CONFIRMED: _CONFIRMED_ENTRY, _EVENT: _EVENT_ENTRY}
"""The one entry every confirmed (event) block shares. Tickets start at 1, so
a speculative ticket never equals theirs."""


def _held_head(existing: list[_Entry | None]) -> int:
    """How many leading blocks are held, if every block after them is missing; else -1.

    The usual shape of a chain that is not wholly held (a known prefix and a
    new suffix): the boundary is found by bisection, as if the held blocks
    formed a prefix, and the shape is then checked in C.
    """
    lo, hi = 0, len(existing)
    while lo < hi:
        mid = (lo + hi) // 2
        if existing[mid] is None:
            hi = mid
        else:
            lo = mid + 1
    return lo if all(existing[:lo]) and not any(existing[lo:]) else -1


def _firm_run(held: list[_Entry], firm: int) -> bool:
    """Whether the first ``firm`` of ``held`` are all confirmed or event entries (in C)."""
    head = held[:firm]
    return head.count(_CONFIRMED_ENTRY) + head.count(_EVENT_ENTRY) == firm


class PrefixIndex:
    """Block hash -> workers that hold it, with per-worker LRU capacity."""

    _shaped: ClassVar[bool] = True
    """Take the shaped paths of :meth:`_touch_chain` (False: the general walk
    alone; the tests compare the two)."""

    def __init__(self, params: IndexParams | None = None) -> None:
        self.params = params or IndexParams()
        self._holders: dict[BlockHash, dict[WorkerId, None]] = {}
        self._lru: dict[WorkerId, OrderedDict[BlockHash, _Entry]] = {}
        # worker -> block -> requests in flight holding it; and the pinned
        # entries eviction set aside (see the module docstring). A worker is
        # a key of either only while its dict is not empty.
        self._pins: dict[WorkerId, dict[BlockHash, int]] = {}
        # worker -> chain -> pins not yet counted per block (see pin()).
        self._pins_waiting: dict[WorkerId, dict[tuple[BlockHash, ...], int]] = {}
        self._parked: dict[WorkerId, dict[BlockHash, _Entry]] = {}
        self._capacity: dict[WorkerId, int] = {}
        self._trust: dict[WorkerId, tuple[float, float]] = {}  # (value, when set)
        # (time queued for, the entry's ticket, worker, block); one item per speculative entry.
        self._expiry: list[tuple[float, int, WorkerId, BlockHash]] = []
        # The heap being rebuilt into _expiry (a valid heap, drained from its end).
        self._draining: list[tuple[float, int, WorkerId, BlockHash]] = []
        self._pushed = 0  # items pushed since the last rebuild step (it pays for them)
        self._ticket = count(1)
        self._entries = 0
        self._speculative = 0  # live speculative entries (bounds the expiry heap)
        self._holey: set[WorkerId] = set()  # workers whose entries may not be prefix-closed
        # worker -> when its engine's cache was last emptied: a request routed
        # before that was predicted against blocks that are gone.
        self._cleared_at: dict[WorkerId, float] = {}
        self.evicted_entries = 0
        self.eviction_misses = 0
        """Misses on a full cache: the engine evicted what we thought it held."""
        self.unexplained_misses = 0
        """Misses on a cache with room: an input-identification problem."""
        self.unconfirmed_misses = 0
        """Misses against a prefix only our routing had put there (its prefill still ran)."""

    # ----------------------------------------------------------------- reads

    def __len__(self) -> int:
        """Number of (block, worker) entries."""
        return self._entries

    @property
    def speculative_entries(self) -> int:
        """Live speculative entries."""
        return self._speculative

    @property
    def expiry_items(self) -> int:
        """Items in the expiry heaps, dead ones included (see the invariants)."""
        return len(self._expiry) + len(self._draining)

    @property
    def compacting(self) -> bool:
        """An incremental rebuild of the expiry heap is under way."""
        return bool(self._draining)

    def holds(self, block: BlockHash) -> bool:
        """Whether any worker holds ``block``."""
        return block in self._holders

    def blocks_of(self, worker: WorkerId) -> int:
        """Entries held for ``worker`` (parked ones included)."""
        lru = self._lru.get(worker)
        held = len(lru) if lru is not None else 0
        parked = self._parked.get(worker)
        return held if parked is None else held + len(parked)

    def pinned_blocks(self, worker: WorkerId) -> int:
        """Blocks that requests in flight on ``worker`` pin (held or not)."""
        pins = self._count_pins(worker)
        return len(pins) if pins is not None else 0

    def capacity(self, worker: WorkerId) -> int:
        """The worker's capacity in blocks (engine-reported or the default)."""
        return self._capacity.get(worker, self.params.default_capacity_blocks)

    def free_blocks(self, worker: WorkerId) -> int:
        """``capacity(worker) - blocks_of(worker)``: blocks it takes before evicting."""
        return self._capacity.get(worker, self.params.default_capacity_blocks) - self.blocks_of(
            worker
        )

    def trust(self, worker: WorkerId, now: float) -> float:
        """Confidence in the worker's entries at ``now`` (1 = fully trusted)."""
        state = self._trust.get(worker)
        if state is None:
            return 1.0
        value, since = state
        if now <= since or value == 1.0:
            # Fully trusted stays fully trusted (the relaxation below would
            # give exactly 1.0 too): skip the exp.
            return value
        return 1.0 - (1.0 - value) * math.exp(-(now - since) / self.params.trust_recovery_s)

    def entry(self, worker: WorkerId, block: BlockHash) -> IndexEntry | None:
        """The entry for (block, worker), if any (a copy); for inspection and tests."""
        stored = self._stored(worker, block)
        return None if stored is None else self._view(stored)

    def entries(self, worker: WorkerId) -> list[tuple[BlockHash, IndexEntry]]:
        """Every entry of ``worker`` in eviction order (copies); for inspection.

        The LRU's entries, least recently used first, then the parked ones,
        oldest first (see the module docstring).
        """
        lru = self._lru.get(worker)
        if lru is None:
            return []
        view = self._view
        held = [(block, view(e)) for block, e in lru.items()]
        parked = self._parked.get(worker)
        if parked:
            held += [(block, view(e)) for block, e in parked.items()]
        return held

    def _view(self, stored: _Entry) -> IndexEntry:
        source = stored[_SOURCE]
        confidence = self.params.speculative_confidence if source == _SPECULATIVE else 1.0
        return IndexEntry(_SOURCES[source], stored[_EXPIRES], confidence, stored[_ROUTINGS])

    def match(self, hashes: Sequence[BlockHash], now: float) -> dict[WorkerId, WorkerMatch]:
        """Per worker, the longest run of leading blocks of ``hashes`` it holds.

        First drops the speculative entries that expired by ``now`` (the same
        housekeeping as :meth:`expire`: it never changes what a match at
        ``now`` or later returns, so decisions stay replayable), then measures.
        Workers with no leading block are omitted.

        Only the holders of the first block are candidates. Each one's run is
        found by exponential and then binary search, about ``2 log2(blocks)``
        dictionary lookups per worker: exact, because a worker's entries are
        prefix-closed (see the module docstring).

        The match's source and confidence are those of its deepest block:
        chains are stored, confirmed and evicted as wholes from the head, so
        the deepest block is the least certain one.

        Args:
            hashes: The request's chained block hashes, in order.
            now: Current time, for speculative expiry.

        Returns:
            worker -> :class:`WorkerMatch`.
        """
        if self._due(now):
            self.expire(now)
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        result: dict[WorkerId, WorkerMatch] = {}
        n = len(hashes)
        last = n - 1
        lrus, holey, trust, parkeds = self._lru, self._holey, self.trust, self._parked
        spec_conf, sources = self.params.speculative_confidence, _SOURCES
        for worker in first:
            lru: Mapping[BlockHash, _Entry] = lrus[worker]
            parked = parkeds.get(worker)
            if parked is not None:
                # Pinned entries set aside by eviction are held too.
                lru = ChainMap(cast("dict[BlockHash, _Entry]", lru), parked)
            # Exponential then binary search for the first block not held:
            # exact because a worker's entries are prefix-closed (see class doc).
            held = 1  # blocks [0, held) are held
            step = 1
            while held < n:
                probe = held + step - 1
                if probe > last:  # min(), without the builtin call
                    probe = last
                if hashes[probe] in lru:
                    held = probe + 1
                    step <<= 1
                    continue
                lo, hi = held, probe  # the first missing block is in [lo, hi]
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if hashes[mid] in lru:
                        lo = mid + 1
                    else:
                        hi = mid
                held = lo
                break
            if worker in holey and not all(map(lru.__contains__, hashes[:held])):
                # An engine event removed blocks from the middle of a chain:
                # closure may not hold for this worker, so walk the run.
                held = next(i for i, h in enumerate(hashes) if h not in lru)
            source = lru[hashes[held - 1]][_SOURCE]
            conf = (spec_conf if source == _SPECULATIVE else 1.0) * trust(worker, now)
            result[worker] = WorkerMatch(held, conf, sources[source])
        return result

    # --------------------------------------------------------------- updates

    def set_capacity(self, worker: WorkerId, blocks: int) -> None:
        """Mirror the engine's KV size; shrinking evicts LRU entries at once."""
        if blocks <= 0:
            raise ValueError(f"capacity of {worker} must be positive, got {blocks}")
        self._capacity[worker] = blocks
        lru = self._lru.get(worker)
        if lru is not None:
            self._evict_past(worker, lru, blocks)
        self._compact_expiry()

    def on_routed(self, worker: WorkerId, hashes: Sequence[BlockHash], now: float) -> Placement:
        """We sent a request with these blocks to ``worker``: it will cache them.

        Existing entries are refreshed (confirmed and event entries keep their
        source); new ones are speculative with a TTL.

        Returns:
            The speculative entries this routing holds (placed or refreshed),
            for :meth:`withdraw`; empty when the chain was confirmed already.
        """
        if self._due(now):
            self.expire(now)
        placed: Placement = []
        self._touch_chain(worker, hashes, now, _SPECULATIVE, placed)
        return placed

    def pin(self, worker: WorkerId, hashes: Sequence[BlockHash]) -> None:
        """A request in flight on ``worker`` uses these blocks: eviction passes over them.

        Call when the request is sent, before :meth:`on_routed` (whose
        eviction then passes over the request's own blocks too), and
        :meth:`unpin` once, with equal hashes, when it ends however it ends;
        :meth:`remove_worker` drops a worker's pins. A pin holds the block,
        not an entry: an entry removed meanwhile (a miss, an event, expiry)
        and added again is pinned too.

        No Python step per block: the pin waits, per chain (a dict key; a
        tuple is not copied), until an eviction on the worker needs to know
        which blocks are pinned (:meth:`_count_pins`). Most requests
        end before one does (no cache pressure), and their pin and unpin
        cancel without a step per block; counted per block at once, they
        made a 2,048-block request's bookkeeping 1.5-1.7x as long
        (``benchmarks/index_pins.py``).
        """
        if not hashes:
            return
        chain = tuple(hashes)
        waiting = self._pins_waiting.get(worker)
        if waiting is None:
            waiting = self._pins_waiting[worker] = {}
        waiting[chain] = waiting.get(chain, 0) + 1

    def unpin(self, worker: WorkerId, hashes: Sequence[BlockHash]) -> None:
        """A request that :meth:`pin` pinned ``hashes`` for has ended.

        Blocks no other request pins become evictable again; those eviction
        had parked go back to the LRU's recent end, tail first, as an engine
        frees a finished request's blocks (the tail is evicted first). A
        release too many changes nothing.
        """
        if not hashes:
            return
        chain = tuple(hashes)
        waiting = self._pins_waiting.get(worker)
        if waiting is not None:
            n = waiting.get(chain)
            if n is not None:  # never counted per block: cancel it
                if n > 1:
                    waiting[chain] = n - 1
                else:
                    del waiting[chain]
                    if not waiting:
                        del self._pins_waiting[worker]
                return
        pins = self._pins.get(worker)
        if pins is None:
            return
        # Per block in C: the counts less one; those at 0 are freed.
        left = list(map(sub, map(pins.get, chain, repeat(1)), repeat(1)))
        pins.update(zip(chain, left, strict=True))
        freed = list(compress(chain, map(not_, left)))
        if not freed:
            return
        _exhaust(map(pins.pop, freed, repeat(None)))
        if not pins:
            del self._pins[worker]
        parked = self._parked.get(worker)
        if parked is None:
            return
        lru = self._lru[worker]
        for block in reversed(freed):
            entry = parked.pop(block, None)
            if entry is not None:
                lru[block] = entry
        if not parked:
            del self._parked[worker]

    def withdraw(self, worker: WorkerId, placed: Placement) -> int:
        """Take back a routing whose request the engine did no prefill for.

        Releases this routing's hold on each entry of ``placed`` (what
        :meth:`on_routed` returned for it; call once per routing) and removes
        the entries no routing holds any more, so an answer that cached
        nothing (a refusal, a failure before the first byte) leaves no
        phantom prefix. Kept: entries the engine confirmed or reported since
        (they are not speculative any more), entries another routing placed
        or refreshed and still holds (two requests of one new prefix in
        flight: withdrawing one leaves what the other needs), and entries
        evicted and created again since (another object). What the routing
        itself evicted to make room cannot be restored, nor the recency and
        TTL it gave entries it refreshed.

        Returns:
            How many entries were removed.
        """
        lru = self._lru.get(worker)
        if lru is None:
            return 0
        parked = self._parked.get(worker)
        removed = 0
        for block, ticket in placed:
            store: dict[BlockHash, _Entry] = lru
            entry = lru.get(block)
            if entry is None and parked is not None:
                store = parked
                entry = parked.get(block)
            # Gone, confirmed or reported by the engine since (a shared entry,
            # ticket 0), or evicted and created again (another ticket): keep.
            if entry is None or entry[_TICKET] != ticket:
                continue
            routings = entry[_ROUTINGS] - 1
            if routings > 0:  # still held by another routing
                store[block] = (_SPECULATIVE, entry[_EXPIRES], routings, ticket)
                continue
            del store[block]
            self._forget(worker, block, entry)
            removed += 1
        if removed:
            self._drop_empty_parked(worker)
            self._compact_expiry()
        return removed

    def on_completed(
        self,
        worker: WorkerId,
        hashes: Sequence[BlockHash],
        block_tokens: float,
        predicted_cached_tokens: int,
        actual_cached_tokens: int,
        now: float,
        routed_at: float = _INF,
        speculative: bool = False,
    ) -> bool:
        """Fold in the engine's report of how many prompt tokens it reused.

        The engine prefilled the whole prompt, so its whole blocks are in the
        engine's cache now: they become confirmed. A *miss* (the engine reused
        clearly fewer tokens than predicted) on a full cache is explained by
        eviction, and the recomputed blocks are back, so only the count moves.
        A miss on a cache with room is not explained: the engine sees other
        tokens than we hash (template drift, a hidden timestamp, a tokenizer
        mismatch). Then the worker's trust drops and the entries of this chain
        past the actual match are removed, since they would miss again.

        A miss on a worker whose cache was cleared (:meth:`clear_worker` with
        a time: an engine event, a restart) at or after ``routed_at`` (the
        decision time) is explained by the clear: the
        prediction was made against blocks that are gone. Engines publish a
        clear on their next step, after the requests that arrive meanwhile
        were routed, so it is not counted, trust is kept, and the chain, which
        the engine has just prefilled again, is confirmed like any other.

        A miss whose prediction rested on an entry only our own routing had
        put there (``speculative``: no answer or engine event had confirmed
        it when the request was routed) says nothing against the worker's
        cache either: the request that put it there was most likely still
        prefilling it, and an engine reuses only blocks already computed
        (a 40,000-token document prefills in five 8,192-token steps; the
        requests admitted meanwhile reuse the chunks done so far and compute
        the rest again). Trust is kept and, since the engine now holds the
        whole prompt, the chain is confirmed; it is counted in
        ``unconfirmed_misses``. A worker whose cache really differs from our
        hashes misses again against the confirmed chain, and is distrusted then.

        Returns:
            True if this was a miss.
        """
        p = self.params
        # Both capped at the prompt's blocks (min() written out: this runs per request).
        n = len(hashes)
        actual_blocks = int(actual_cached_tokens // block_tokens)
        actual_blocks = n if n < actual_blocks else actual_blocks
        predicted_blocks = int(predicted_cached_tokens // block_tokens)
        predicted_blocks = n if n < predicted_blocks else predicted_blocks
        miss = predicted_blocks - actual_blocks > p.miss_tolerance_blocks
        if miss and self._cleared_at.get(worker, -_INF) >= routed_at:
            miss = False  # explained by a cache clear after the decision (see above)
            predicted_blocks = actual_blocks
        trust = self.trust(worker, now)
        if miss and speculative:
            self.unconfirmed_misses += 1  # explained by a prefill still running (see above)
        elif miss:
            full = self.blocks_of(worker) >= p.eviction_explains_fill * self.capacity(worker)
            if full:
                self.eviction_misses += 1
            else:
                self.unexplained_misses += 1
                self._trust[worker] = (max(p.min_trust, trust * p.miss_decay), now)
                if actual_blocks:
                    self._touch_chain(worker, hashes[:actual_blocks], now, _CONFIRMED)
                self._remove(worker, hashes[actual_blocks:])
                self._compact_expiry()
                return True
        elif predicted_blocks or actual_blocks:
            self._trust[worker] = (min(1.0, trust + p.hit_recovery), now)
        if hashes:
            deepest = self._stored(worker, hashes[-1])
            if deepest is not None and deepest[_SOURCE] != _SPECULATIVE:
                # Already confirmed as a whole (chains are confirmed from the
                # head, and on_routed refreshed their recency moments ago).
                return miss
        self._touch_chain(worker, hashes, now, _CONFIRMED)
        return miss

    def apply(self, event: KvEvent, now: float, *, trusted: bool = True) -> None:
        """Apply an engine KV event (already translated to this index's hashes).

        ``trusted=False`` stores blocks as speculative entries (with a TTL):
        for events that may be stale, e.g. a backlog published before this
        router was listening, which a later cache reset may have voided.
        """
        if isinstance(event, BlockStored):
            source = _EVENT if trusted else _SPECULATIVE
            self._touch_chain(event.worker_id, event.block_hashes, now, source)
        elif isinstance(event, BlockRemoved):
            # The engine may evict blocks that other blocks extend; matches on
            # this worker are then verified block by block (see match).
            self._holey.add(event.worker_id)
            self._remove(event.worker_id, event.block_hashes)
            self._compact_expiry()
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(event.worker_id, now)

    def demote_events(self, worker: WorkerId, now: float) -> int:
        """The worker's event feed lost messages: its event entries become speculative.

        After a gap in the event sequence, a ``BlockRemoved`` may have been
        missed, so what the events told us is no longer exact. The entries are
        kept (most are still right) but treated like routed-only ones: lower
        confidence and a TTL from ``now``, unless confirmed again by a
        completion or a new event. Returns how many entries were demoted.
        """
        expires_at = now + self.params.speculative_ttl_s
        demoted = 0
        expiry, ticket = self._expiry, self._ticket
        # Changed while iterating: assigning an existing key moves nothing.
        for store in self._stores(worker):
            for block, entry in store.items():
                if entry is _EVENT_ENTRY:
                    # One hold, the event's: no routing's withdrawal removes it.
                    t = next(ticket)
                    store[block] = (_SPECULATIVE, expires_at, 1, t)
                    heapq.heappush(expiry, (expires_at, t, worker, block))
                    demoted += 1
        if not demoted:
            return 0
        self._speculative += demoted
        self._pushed += demoted
        self._compact_expiry()
        return demoted

    def demote_worker(self, worker: WorkerId, now: float) -> int:
        """The worker stopped answering for a while: all its entries become speculative.

        An outage alone says nothing about the engine's cache: an engine that
        was frozen, overloaded or cut off still holds it, and one that
        restarted holds nothing. Until a restart is known (the caller then
        clears the worker), every entry is kept at speculative confidence with
        a TTL from ``now``, like :meth:`demote_events`: if the engine comes back
        with its cache, completions and events confirm them again; if not,
        they expire or are dropped by the first miss. Returns how many
        entries were demoted.
        """
        stores = self._stores(worker)
        if not any(stores):
            return 0
        expires_at = now + self.params.speculative_ttl_s
        demoted = 0
        expiry, ticket = self._expiry, self._ticket
        # Changed while iterating: assigning an existing key moves nothing.
        for store in stores:
            for block, entry in store.items():
                if entry[_SOURCE] != _SPECULATIVE:
                    # The engine's hold (as in demote_events): withdrawing a routing
                    # must never remove a block the engine had reported or confirmed.
                    t = next(ticket)
                    store[block] = (_SPECULATIVE, expires_at, 1, t)
                    heapq.heappush(expiry, (expires_at, t, worker, block))
                    demoted += 1
                elif entry[_EXPIRES] < expires_at:
                    # One expiry for the whole worker keeps its chains prefix-closed
                    # (a demoted extension must not outlive a speculative prefix).
                    # Only a later time: the queued item surfaces first and re-queues.
                    store[block] = (_SPECULATIVE, expires_at, entry[_ROUTINGS], entry[_TICKET])
        self._speculative += demoted
        self._pushed += demoted
        self._compact_expiry()
        return demoted

    def clear_worker(self, worker: WorkerId, now: float | None = None) -> None:
        """Forget every block of ``worker`` (keeps its capacity and trust).

        ``now``: when the engine's cache was emptied (an ``AllBlocksCleared``,
        a restarted process); the misses of requests routed before it are put
        down to the clear (see :meth:`on_completed`). None: no cache was
        emptied (the worker is being forgotten).
        """
        if now is not None:
            self._cleared_at[worker] = now
        self._holey.discard(worker)
        lru = self._lru.pop(worker, None)
        parked = self._parked.pop(worker, None)
        held = [] if lru is None else list(lru.items())
        if parked is not None:
            held += parked.items()
        if not held:
            return
        detach = self._detach
        for block, _ in held:
            detach(worker, block)
        self._entries -= len(held)
        # Every non-speculative entry is one of two shared tuples: count them in C.
        entries = [entry for _, entry in held]
        firm = entries.count(_CONFIRMED_ENTRY) + entries.count(_EVENT_ENTRY)
        self._speculative -= len(entries) - firm
        self._compact_expiry()

    def remove_worker(self, worker: WorkerId) -> None:
        """The worker is gone: forget its blocks, pins, capacity and trust.

        Pins go too (its requests in flight are dropped with it); a cleared
        worker keeps them (:meth:`clear_worker`: its requests run on).
        """
        self.clear_worker(worker)
        self._pins.pop(worker, None)
        self._pins_waiting.pop(worker, None)
        self._capacity.pop(worker, None)
        self._trust.pop(worker, None)
        self._cleared_at.pop(worker, None)

    def expire(self, now: float) -> int:
        """Remove speculative entries whose TTL has passed; returns how many.

        Both heaps are drained of what is due (the one being rebuilt too), so
        which entries expire when never depends on a rebuild.
        """
        removed = self._expire_from(self._draining, now) + self._expire_from(self._expiry, now)
        if removed:
            self._compact_expiry()
        return removed

    # -------------------------------------------------------------- internals

    def _due(self, now: float) -> bool:
        """Whether any queued item is due by ``now`` (cheap: the two heaps' roots)."""
        heap, old = self._expiry, self._draining
        return bool((heap and heap[0][0] <= now) or (old and old[0][0] <= now))

    def _expire_from(self, heap: list[tuple[float, int, WorkerId, BlockHash]], now: float) -> int:
        """Pop ``heap``'s due items: remove their entries, or re-queue the refreshed ones."""
        removed = 0
        while heap and heap[0][0] <= now:
            _, ticket, worker, block = heapq.heappop(heap)
            entry = self._stored(worker, block)
            # Confirmed, removed or created again since (another ticket): skip it.
            if entry is None or entry[_TICKET] != ticket:
                continue
            if entry[_EXPIRES] > now:
                # Refreshed since it was queued: queue it again at its new time
                # (always in the live heap, so a rebuild only ever shrinks).
                heapq.heappush(self._expiry, (entry[_EXPIRES], ticket, worker, block))
            else:
                self._remove(worker, (block,))
                removed += 1
        return removed

    def _touch_chain(
        self,
        worker: WorkerId,
        hashes: Sequence[BlockHash],
        now: float,
        source: int,
        placed: Placement | None = None,
    ) -> None:
        """Store or refresh a chain on ``worker``, tail first; evict past the capacity.

        A speculative touch takes a hold on each speculative entry it places or
        refreshes (the entry's ``routings``) and, given ``placed`` (a routing),
        records them there for :meth:`withdraw`; without it (an untrusted
        event) the hold is never released. A stronger source replaces a
        weaker one; a weaker one never replaces a stronger.

        Chains usually come in one of two shapes, each handled with a Python
        step only for the blocks that change: all held (a hot prefix routed
        again: recency moves in C), or a held head and a new tail (a known
        document with a new question: the new blocks are added one by one,
        the head moves in C). Any other shape (holes in the chain) takes the
        general walk, block by block; the result is the same.
        """
        lru = self._lru.get(worker)
        if lru is None:
            lru = self._lru[worker] = OrderedDict()
        parked = self._parked.get(worker)
        if parked is not None:
            # Touched: back into the LRU (the touch below sets its recency).
            for block in list(filter(parked.__contains__, hashes)):
                lru[block] = parked.pop(block)
            self._drop_empty_parked(worker)
        existing = list(map(lru.get, hashes))
        # A stored entry is a non-empty tuple, always truthy: all() and any()
        # test presence in C, without a comparison per entry.
        shaped = self._shaped
        if shaped and all(existing):
            delta = self._refresh_held(lru, hashes, cast("list[_Entry]", existing), now, source,
                                       placed)  # fmt: skip
            if delta:
                self._speculative += delta
                self._compact_expiry()
            return
        head = _held_head(existing) if shaped else -1
        if head >= 0:
            # Tail first, so the chain's head ends up most recently used.
            self._add_new(worker, lru, hashes[head:], now, source, placed)
            if head:
                self._speculative += self._refresh_held(
                    lru, hashes[:head], cast("list[_Entry]", existing[:head]), now, source, placed
                )
        else:
            self._touch_walk(worker, lru, hashes, existing, now, source, placed)
        # Evict after the chain is in: the chain is the most recent part of the
        # LRU, so other chains go first (and a chain longer than the capacity
        # loses its tail first).
        self._evict_past(worker, lru, self.capacity(worker))
        max_entries = self.params.max_entries
        while self._entries > max_entries:
            self._evict_global()
        self._compact_expiry()

    def _refresh_held(
        self,
        lru: OrderedDict[BlockHash, _Entry],
        hashes: Sequence[BlockHash],
        held: list[_Entry],
        now: float,
        source: int,
        placed: Placement | None,
    ) -> int:
        """Refresh a chain whose every block ``lru`` holds (``held``: their entries).

        Only recency and metadata change. Tail first, so the chain's head ends
        up most recently used. Returns the change in speculative entries (a
        confirmation upgrades some; the caller adds it to the count).
        """
        _exhaust(map(lru.move_to_end, reversed(hashes)))
        n = len(held)
        if source == _SPECULATIVE:
            firm = held.count(_CONFIRMED_ENTRY) + held.count(_EVENT_ENTRY)
            if firm == n:
                return 0  # all confirmed (a hot prefix): the usual case, decided in C
            # Nothing is weaker than speculative: only the speculative entries
            # change, a later expiry (re-queued lazily by expire()) and one more
            # hold. A leading run of firm entries (checked in C) is skipped.
            skip = firm if _firm_run(held, firm) else 0
            expires_at = now + self.params.speculative_ttl_s
            for block, entry in zip(hashes[skip:], held[skip:], strict=True):
                if entry[_SOURCE] == _SPECULATIVE:
                    ticket = entry[_TICKET]
                    lru[block] = (_SPECULATIVE, expires_at, entry[_ROUTINGS] + 1, ticket)
                    if placed is not None:
                        placed.append((block, ticket))
            return 0
        stored = _STORED[source]
        same = held.count(stored)
        if same == n:
            return 0  # already as strong: the usual case, decided in C
        # A leading run of entries as strong already (checked in C) is skipped.
        skip = same if held[:same].count(stored) == same else 0
        upgraded = 0
        for block, entry in zip(hashes[skip:], held[skip:], strict=True):
            held_source = entry[_SOURCE]
            if held_source < source:
                lru[block] = stored
                if held_source == _SPECULATIVE:
                    upgraded += 1
        return -upgraded

    def _add_new(
        self,
        worker: WorkerId,
        lru: OrderedDict[BlockHash, _Entry],
        hashes: Sequence[BlockHash],
        now: float,
        source: int,
        placed: Placement | None,
    ) -> None:
        """Add blocks ``lru`` does not hold, tail first (no eviction: the caller's)."""
        holders, ticket_of, expiry = self._holders, self._ticket, self._expiry
        speculative = source == _SPECULATIVE
        stored = _STORED.get(source, _CONFIRMED_ENTRY)
        expires_at = now + self.params.speculative_ttl_s if speculative else _INF
        for block in reversed(hashes):
            if speculative:
                ticket = next(ticket_of)
                lru[block] = (_SPECULATIVE, expires_at, 1, ticket)
                heapq.heappush(expiry, (expires_at, ticket, worker, block))
                if placed is not None:
                    placed.append((block, ticket))
            else:
                lru[block] = stored
            slot = holders.get(block)
            if slot is None:
                holders[block] = {worker: None}
            else:
                slot[worker] = None
        added = len(hashes)
        self._entries += added
        if speculative:
            self._speculative += added
            self._pushed += added

    def _touch_walk(
        self,
        worker: WorkerId,
        lru: OrderedDict[BlockHash, _Entry],
        hashes: Sequence[BlockHash],
        existing: list[_Entry | None],
        now: float,
        source: int,
        placed: Placement | None,
    ) -> None:
        """The general case of :meth:`_touch_chain`: block by block, tail first."""
        move_to_end, add_new = lru.move_to_end, self._add_new
        speculative = source == _SPECULATIVE
        stored = _STORED.get(source, _CONFIRMED_ENTRY)
        expires_at = now + self.params.speculative_ttl_s if speculative else _INF
        speculative_delta = 0
        for i in range(len(hashes) - 1, -1, -1):
            block, entry = hashes[i], existing[i]
            if entry is None:
                add_new(worker, lru, hashes[i : i + 1], now, source, placed)
                continue
            move_to_end(block)
            held_source = entry[_SOURCE]
            if speculative:
                if held_source == _SPECULATIVE:
                    ticket = entry[_TICKET]
                    lru[block] = (_SPECULATIVE, expires_at, entry[_ROUTINGS] + 1, ticket)
                    if placed is not None:
                        placed.append((block, ticket))
            elif held_source < source:
                lru[block] = stored
                if held_source == _SPECULATIVE:
                    speculative_delta -= 1
        self._speculative += speculative_delta

    def _compact_expiry(self) -> None:
        """Rebuild the expiry heap from its live items once dead ones dominate, a step at a time.

        Dead items (their entry was confirmed, evicted, removed or expired and
        created again) would otherwise stay until their time comes: at a high
        rate of unique prompts that is rate x blocks x TTL items, far more
        than the index holds. Past ``2 x`` the live speculative entries plus
        ``_EXPIRY_SLACK``, the heap is set aside to be *drained* and a new one
        started. Each call then moves a bounded number of items from the end of
        the old heap to the new one, live ones only: ``_DRAIN_STEP`` plus
        twice the items pushed since the last call, so the rebuild outpaces
        the pushes, ends within ``items / _DRAIN_STEP`` calls, and no call
        does more work than a constant times its own. Taking items from a
        heap's end keeps it a heap, so :meth:`expire` keeps popping what is
        due from both. A heap of up to ``_DRAIN_STEP`` items is rebuilt in
        one call. Only housekeeping: which entries expire when does not
        change. An item is live while its block's entry on its worker
        carries its ticket, and each ticket is queued once.
        """
        old = self._draining
        if not old:
            heap = self._expiry
            if len(heap) <= 2 * self._speculative + _EXPIRY_SLACK:
                self._pushed = 0
                return
            self._draining, self._expiry = heap, []
            old = heap
        budget = _DRAIN_STEP + 2 * self._pushed
        self._pushed = 0
        lrus, parkeds, new = self._lru, self._parked, self._expiry
        keep, take = heapq.heappush, old.pop
        for _ in range(min(budget, len(old))):
            item = take()
            lru = lrus.get(item[2])
            if lru is not None:
                entry = lru.get(item[3])
                if entry is None and parkeds:
                    parked = parkeds.get(item[2])
                    entry = parked.get(item[3]) if parked is not None else None
                if entry is not None and entry[_TICKET] == item[1]:
                    keep(new, item)

    def _stored(self, worker: WorkerId, block: BlockHash) -> _Entry | None:
        """The stored entry for (block, worker), in the LRU or parked; None if none."""
        lru = self._lru.get(worker)
        entry = lru.get(block) if lru is not None else None
        if entry is None:
            parked = self._parked.get(worker)
            if parked is not None:
                return parked.get(block)
        return entry

    def _stores(self, worker: WorkerId) -> tuple[dict[BlockHash, _Entry], ...]:
        """The dicts holding ``worker``'s entries: its LRU and, if any, its parked ones."""
        lru = self._lru.get(worker)
        if lru is None:
            return ()
        parked = self._parked.get(worker)
        return (lru,) if parked is None else (lru, parked)

    def _drop_empty_parked(self, worker: WorkerId) -> None:
        """Keeps ``_parked`` free of empty dicts (match reads a key as "has parked")."""
        parked = self._parked.get(worker)
        if parked is not None and not parked:
            del self._parked[worker]

    def _count_pins(self, worker: WorkerId) -> dict[BlockHash, int] | None:
        """``worker``'s pins per block, the waiting ones counted in first (see pin())."""
        waiting = self._pins_waiting.pop(worker, None)
        pins = self._pins.get(worker)
        if waiting is None:
            return pins
        if pins is None:
            pins = self._pins[worker] = {}
        for chain, n in waiting.items():
            counts = map(add, map(pins.get, chain, repeat(0)), repeat(n))
            pins.update(zip(chain, counts, strict=True))
        return pins

    def _evict_past(self, worker: WorkerId, lru: OrderedDict[BlockHash, _Entry], cap: int) -> None:
        """Evict ``worker``'s entries until it holds at most ``cap``."""
        parked = self._parked.get(worker)
        while len(lru) + (len(parked) if parked is not None else 0) > cap:
            self._evict_one(worker, lru)
            parked = self._parked.get(worker)

    def _evict_one(self, worker: WorkerId, lru: OrderedDict[BlockHash, _Entry]) -> None:
        """Evict ``worker``'s least recently used entry that no request pins.

        Pinned entries met at the LRU's front are parked on the way (each
        once until it is touched or unpinned, so the walk is O(1) amortised);
        if every entry is parked, the oldest parked one goes.
        """
        pins = self._count_pins(worker)
        while lru:
            block, entry = lru.popitem(last=False)
            if pins is None or block not in pins:
                break
            parked = self._parked.get(worker)
            if parked is None:
                parked = self._parked[worker] = {}
            parked[block] = entry
        else:
            parked = self._parked[worker]
            block = next(iter(parked))
            entry = parked.pop(block)
            self._drop_empty_parked(worker)
        self._detach(worker, block)
        self._entries -= 1
        if entry[_SOURCE] == _SPECULATIVE:
            self._speculative -= 1
        self.evicted_entries += 1

    def _evict_global(self) -> None:
        # Over the global cap: take from the worker holding the most entries,
        # so no single worker's cache picture is wiped to make room.
        # Ties go to the worker first seen (dict order), which is deterministic.
        worker = max(self._lru, key=self.blocks_of)
        self._evict_one(worker, self._lru[worker])

    def _remove(self, worker: WorkerId, hashes: Iterable[BlockHash]) -> None:
        lru = self._lru.get(worker)
        if lru is None:
            return
        parked = self._parked.get(worker)
        for block in hashes:
            entry = lru.pop(block, None)
            if entry is None and parked is not None:
                entry = parked.pop(block, None)
            if entry is not None:
                self._forget(worker, block, entry)
        if parked is not None:
            self._drop_empty_parked(worker)

    def _forget(self, worker: WorkerId, block: BlockHash, entry: _Entry) -> None:
        """An entry just taken out of ``worker``'s LRU leaves the holders and the counts."""
        self._detach(worker, block)
        self._entries -= 1
        if entry[_SOURCE] == _SPECULATIVE:
            self._speculative -= 1

    def _detach(self, worker: WorkerId, block: BlockHash) -> None:
        slot = self._holders.get(block)
        if slot is not None:
            slot.pop(worker, None)
            if not slot:
                del self._holders[block]
