from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixrouter.core import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EntrySource,
    IndexParams,
    Placement,
    PrefixIndex,
    WorkerId,
    hash_token_blocks,
)
from tests.core.conftest import NS, tokens

A, B = WorkerId("a"), WorkerId("b")


def chain(start: int, blocks: int, ns_seed: int = NS.seed) -> tuple[BlockHash, ...]:
    return hash_token_blocks(ns_seed, tokens(start, blocks * 16), 16)


def test_match_longest_consecutive_prefix_per_worker() -> None:
    idx = PrefixIndex()
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    idx.on_routed(B, doc[:4], 0.0)
    m = idx.match(doc, 1.0)
    assert m[A].blocks == 10 and m[B].blocks == 4
    assert m[A].source is EntrySource.SPECULATIVE
    other = chain(2, 10)
    assert idx.match(other, 1.0) == {}


def test_gap_in_chain_stops_the_match() -> None:
    idx = PrefixIndex()
    doc = chain(1, 6)
    idx.on_routed(A, doc, 0.0)
    idx.apply(BlockRemoved(A, [doc[2]]), 0.0)
    assert idx.match(doc, 0.0)[A].blocks == 2


def test_capacity_evicts_lru_tail_first() -> None:
    idx = PrefixIndex()
    idx.set_capacity(A, 8)
    d1, d2 = chain(1, 6), chain(2, 4)
    idx.on_routed(A, d1, 0.0)
    idx.on_routed(A, d2, 1.0)  # 10 blocks > 8: d1's two tail blocks go first
    assert idx.blocks_of(A) == 8
    assert idx.match(d1, 1.0)[A].blocks == 4
    assert idx.match(d2, 1.0)[A].blocks == 4
    idx.set_capacity(A, 5)  # shrinking evicts at once, least recently used chain first
    assert idx.blocks_of(A) == 5
    assert idx.match(d1, 1.0)[A].blocks == 1
    assert idx.match(d2, 1.0)[A].blocks == 4


def test_eviction_passes_over_the_blocks_running_requests_pin() -> None:
    # An engine cannot evict a running request's blocks: it evicts other
    # cached blocks. The index's LRU, by touch time alone, would forget the
    # running prompt first (touched when it was routed, the longest ago).
    idx = PrefixIndex()
    idx.set_capacity(A, 6)
    running, x, y, z = chain(0, 2), chain(1, 2), chain(2, 2), chain(3, 2)
    idx.pin(A, running)
    idx.on_routed(A, running, 0.0)
    idx.on_routed(A, x, 1.0)
    idx.on_routed(A, y, 2.0)
    idx.on_routed(A, z, 3.0)  # 8 > 6: x goes, not the older running prompt
    assert idx.match(running, 3.0)[A].blocks == 2
    assert idx.match(x, 3.0) == {} and idx.match(y, 3.0)[A].blocks == 2
    assert idx.blocks_of(A) == 6 and len(idx) == 6 and idx.pinned_blocks(A) == 2
    # The request ends: its blocks are the most recently freed, tail first.
    idx.unpin(A, running)
    assert idx.pinned_blocks(A) == 0
    assert [b for b, _ in idx.entries(A)] == [*reversed(y), *reversed(z), *reversed(running)]
    idx.on_routed(A, x, 4.0)  # now y, the least recently used, goes
    assert idx.match(y, 4.0) == {} and idx.match(running, 4.0)[A].blocks == 2


def test_two_pins_on_one_block_hold_it_until_both_are_released() -> None:
    idx = PrefixIndex()
    idx.set_capacity(A, 4)
    doc = chain(0, 2)
    idx.pin(A, doc)
    idx.pin(A, doc)
    idx.on_routed(A, doc, 0.0)
    idx.unpin(A, doc)
    idx.on_routed(A, chain(1, 2), 1.0)
    idx.on_routed(A, chain(2, 2), 2.0)
    assert idx.match(doc, 2.0)[A].blocks == 2  # one request still runs
    idx.unpin(A, doc)
    idx.on_routed(A, chain(3, 2), 3.0)
    idx.on_routed(A, chain(4, 2), 4.0)
    assert idx.match(doc, 4.0) == {}  # free again: evicted by recency
    idx.unpin(A, doc)  # a release too many changes nothing
    assert idx.pinned_blocks(A) == 0


def test_when_pins_outgrow_the_capacity_the_oldest_pinned_blocks_go() -> None:
    # The index stays bounded: with nothing else to evict, the oldest pinned go.
    idx = PrefixIndex()
    idx.set_capacity(A, 4)
    a, b, c = chain(0, 2), chain(1, 2), chain(2, 2)
    for t, doc in enumerate((a, b, c)):
        idx.pin(A, doc)
        idx.on_routed(A, doc, float(t))
    assert idx.blocks_of(A) == 4 and len(idx) == 4
    assert idx.match(a, 3.0) == {}
    assert idx.match(b, 3.0)[A].blocks == 2 and idx.match(c, 3.0)[A].blocks == 2
    idx.set_capacity(A, 3)  # shrinking takes the oldest pinned too, tail first
    assert idx.match(b, 3.0)[A].blocks == 1 and idx.blocks_of(A) == 3
    idx.remove_worker(A)
    assert idx.pinned_blocks(A) == 0 and len(idx) == 0


def test_a_set_aside_pinned_entry_is_matched_touched_and_withdrawn_like_any() -> None:
    idx = PrefixIndex()
    idx.set_capacity(A, 4)
    doc, other = chain(0, 2), chain(1, 2)
    idx.pin(A, doc)
    placed = idx.on_routed(A, doc, 0.0)
    idx.on_routed(A, other, 1.0)
    idx.on_routed(A, chain(2, 1), 2.0)  # sets doc's pinned blocks aside, evicts other's tail
    assert idx.match(doc, 2.0)[A].blocks == 2 and idx.match(other, 2.0)[A].blocks == 1
    assert idx.entry(A, doc[0]) is not None and idx.blocks_of(A) == 4
    assert idx.withdraw(A, placed) == 2  # the engine refused it after all
    assert idx.match(doc, 2.0) == {} and idx.blocks_of(A) == 2
    idx.pin(A, doc)  # routed again: a set-aside entry is touched back into the LRU
    idx.on_routed(A, doc, 3.0)
    idx.on_routed(A, chain(3, 3), 4.0)
    assert idx.match(doc, 4.0)[A].blocks == 2 and idx.blocks_of(A) == 4
    idx.on_routed(A, doc, 5.0)  # touched while set aside
    assert [b for b, _ in idx.entries(A)][-2:] == [doc[1], doc[0]]


def test_speculative_entries_expire_but_confirmed_do_not() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=10.0))
    doc = chain(1, 4)
    idx.on_routed(A, doc, 0.0)
    idx.on_routed(B, doc, 0.0)
    idx.on_completed(B, doc, 16.0, 0, 64, 1.0)  # B confirmed all 4 blocks
    assert set(idx.match(doc, 9.0)) == {A, B}
    assert idx.expire(10.5) == 4  # A's entries are reclaimed...
    assert idx.blocks_of(A) == 0 and idx.blocks_of(B) == 4
    assert set(idx.match(doc, 10.5)) == {B}  # ...and no longer match


def test_match_never_counts_an_expired_entry() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=10.0))
    doc = chain(1, 4)
    idx.on_routed(A, doc, 0.0)
    assert set(idx.match(doc, 10.0)) == set()  # expiry is due at 10.0 exactly
    assert len(idx) == 0


def test_refresh_extends_speculative_ttl() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=10.0))
    doc = chain(1, 3)
    idx.on_routed(A, doc, 0.0)
    idx.on_routed(A, doc, 8.0)
    assert idx.expire(12.0) == 0
    assert idx.match(doc, 12.0)[A].blocks == 3
    assert idx.expire(18.5) == 3


def test_miss_lowers_trust_and_drops_entries_past_actual_match() -> None:
    p = IndexParams(miss_decay=0.5)
    idx = PrefixIndex(p)
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    assert idx.on_completed(A, doc, 16.0, 160, 48, 1.0) is True
    assert idx.trust(A, 1.0) == pytest.approx(0.5)
    m = idx.match(doc, 1.0)[A]
    assert m.blocks == 3 and m.source is EntrySource.CONFIRMED
    assert m.confidence == pytest.approx(0.5)


def test_a_miss_against_an_unconfirmed_entry_keeps_trust_and_confirms_the_chain() -> None:
    """A request routed on our own routing's entry, while that request's prefill
    still ran, reuses only the chunks computed so far: no evidence against the
    worker's cache. The engine holds the whole prompt now."""
    idx = PrefixIndex(IndexParams(miss_decay=0.5))
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    assert idx.on_completed(A, doc, 16.0, 160, 48, 1.0, speculative=True) is True
    assert idx.trust(A, 1.0) == 1.0
    assert idx.unconfirmed_misses == 1 and idx.unexplained_misses == 0
    m = idx.match(doc, 1.0)[A]
    assert m.blocks == 10 and m.source is EntrySource.CONFIRMED
    # Against the confirmed chain, the same shortfall is a miss as before.
    assert idx.on_completed(A, doc, 16.0, 160, 48, 2.0) is True
    assert idx.trust(A, 2.0) == pytest.approx(0.5) and idx.unexplained_misses == 1


def test_hit_within_tolerance_is_not_a_miss_and_restores_trust() -> None:
    idx = PrefixIndex(IndexParams(miss_decay=0.5, hit_recovery=0.25))
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 160, 0, 1.0)
    idx.on_routed(A, doc, 1.0)
    # engines recompute the last block of a fully cached prompt: one block short is a hit
    assert idx.on_completed(A, doc, 16.0, 160, 144, 1.0) is False
    assert idx.trust(A, 1.0) == pytest.approx(0.75)


def test_a_miss_after_a_cache_clear_is_explained_by_the_clear() -> None:
    """An engine publishes a clear on its next step, after the requests that
    arrived meanwhile were routed: their misses are the clear's, not a sign
    that the router hashes other tokens than the engine sees."""
    idx = PrefixIndex(IndexParams(miss_decay=0.5))
    doc = chain(1, 10)
    idx.apply(BlockStored(A, doc), 0.0)
    # Routed at t=1 against the stored blocks; the clear arrives at t=1.5,
    # then the engine stores the chain again while it prefills it.
    idx.on_routed(A, doc, 1.0)
    idx.apply(AllBlocksCleared(A), 1.5)
    idx.apply(BlockStored(A, doc), 1.6)
    assert idx.on_completed(A, doc, 16.0, 160, 0, 2.0, routed_at=1.0) is False
    assert idx.trust(A, 2.0) == 1.0 and idx.unexplained_misses == 0
    assert idx.match(doc, 2.0)[A].blocks == 10  # what the engine just prefilled is kept
    # A request routed after the clear that misses is a miss as before.
    idx.on_routed(A, doc, 3.0)
    assert idx.on_completed(A, doc, 16.0, 160, 48, 4.0, routed_at=3.0) is True
    assert idx.trust(A, 4.0) == pytest.approx(0.5)


def test_events_are_exact_and_clear() -> None:
    idx = PrefixIndex()
    doc = chain(1, 5)
    idx.apply(BlockStored(A, doc), 0.0)
    m = idx.match(doc, 1e9)[A]  # event entries never expire
    assert m.blocks == 5 and m.source is EntrySource.EVENT and m.confidence == 1.0
    idx.apply(BlockRemoved(A, doc[3:]), 1.0)
    assert idx.match(doc, 1.0)[A].blocks == 3
    idx.apply(AllBlocksCleared(A), 2.0)
    assert idx.match(doc, 2.0) == {} and len(idx) == 0


def test_routing_never_downgrades_an_event_entry() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=1.0))
    doc = chain(1, 3)
    idx.apply(BlockStored(A, doc), 0.0)
    idx.on_routed(A, doc, 0.5)
    idx.expire(100.0)
    assert idx.match(doc, 100.0)[A].source is EntrySource.EVENT


def test_remove_worker_forgets_everything() -> None:
    idx = PrefixIndex()
    doc = chain(1, 5)
    idx.on_routed(A, doc, 0.0)
    idx.on_routed(B, doc, 0.0)
    idx.set_capacity(A, 50)
    idx.remove_worker(A)
    assert set(idx.match(doc, 0.0)) == {B}
    assert len(idx) == 5 and idx.capacity(A) == idx.params.default_capacity_blocks


def test_one_million_unique_prompts_stay_under_the_global_cap() -> None:
    cap = 20_000
    idx = PrefixIndex(IndexParams(max_entries=cap, default_capacity_blocks=10**9))
    workers = [WorkerId(f"w{i}") for i in range(8)]
    peak = 0
    for i in range(1_000_000):
        # one unique 2-block prompt per request, spread over 8 workers
        h = BlockHash(i * 2 + 1)
        idx.on_routed(workers[i % 8], (h, BlockHash(i * 2 + 2)), float(i) * 1e-4)
        if i % 50_000 == 0:
            peak = max(peak, len(idx))
    assert len(idx) <= cap and peak <= cap
    assert idx.evicted_entries == 2_000_000 - len(idx)
    assert sum(idx.blocks_of(w) for w in workers) == len(idx)


# ------------------------------------------------------------- properties


def _pins_of(idx: PrefixIndex, worker: WorkerId) -> dict[BlockHash, int]:
    """The worker's pins per block, counted and waiting, without counting the waiting in."""
    pins = dict(idx._pins.get(worker, {}))
    for chain_, n in idx._pins_waiting.get(worker, {}).items():
        for h in chain_:
            pins[h] = pins.get(h, 0) + n
    return pins


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["route", "complete", "store", "remove", "clear", "withdraw", "demote", "unpin"]
        ),
        st.sampled_from([A, B, WorkerId("c")]),
        st.integers(0, 5),  # which document
        st.integers(0, 8),  # how many blocks
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(2, 12))
def test_index_invariants(script: list[tuple[str, WorkerId, int, int]], capacity: int) -> None:
    idx = PrefixIndex(IndexParams(max_entries=20, speculative_ttl_s=5.0))
    docs = [chain(d, 8) for d in range(6)]
    given_blocks: dict[WorkerId, set[BlockHash]] = {}
    for w in (A, B, WorkerId("c")):
        idx.set_capacity(w, capacity)
    t = 0.0
    routings: list[tuple[WorkerId, Placement]] = []
    pinned: list[tuple[WorkerId, tuple[BlockHash, ...]]] = []  # requests running
    for op, w, d, n in script:
        t += 1.0
        blocks = docs[d][:n]
        if op == "route":
            if d % 2:  # half the routings run on (pinned) until an "unpin"
                idx.pin(w, blocks)
                pinned.append((w, blocks))
            routings.append((w, idx.on_routed(w, blocks, t)))
        elif op == "unpin":
            if pinned:
                idx.unpin(*pinned.pop(d % len(pinned)))
            blocks = ()
        elif op == "withdraw":
            # the engine refused one of the routings made so far (each at most once)
            if routings:
                ww, placed = routings.pop(d % len(routings))
                idx.withdraw(ww, placed)
            blocks = ()
        elif op == "demote":
            idx.demote_events(w, t)
            blocks = ()
        elif op == "complete":
            # the engine prefilled the whole prompt: every whole block is given
            idx.on_completed(w, docs[d], 16.0, 16 * n, 16 * (n // 2), t)
            blocks = docs[d]
        elif op == "store":
            idx.apply(BlockStored(w, blocks), t)
        elif op == "remove":
            idx.apply(BlockRemoved(w, blocks), t)
            blocks = ()
        else:
            idx.apply(AllBlocksCleared(w), t)
            blocks = ()
        given_blocks.setdefault(w, set()).update(blocks)
        # capacity and the global cap hold after every call
        assert len(idx) <= 20
        # the speculative count is exact, and bounds the expiry heap
        live = [e for ww in (A, B, WorkerId("c")) for _, e in idx.entries(ww)]
        speculative = sum(1 for e in live if e.source is EntrySource.SPECULATIVE)
        assert idx.speculative_entries == speculative
        assert idx.expiry_items <= 2 * speculative + 64
        for ww in (A, B, WorkerId("c")):
            assert idx.blocks_of(ww) <= capacity
            # each entry is in the LRU or set aside, never both, and only a
            # pinned one is set aside; the holders say exactly the same
            lru: Mapping[BlockHash, object] = idx._lru.get(ww, {})
            parked: Mapping[BlockHash, object] = idx._parked.get(ww, {})
            assert not set(lru) & set(parked)
            pins = _pins_of(idx, ww)
            assert all(h in pins for h in parked)
            assert {h for h, slot in idx._holders.items() if ww in slot} == set(lru) | set(parked)
            running = {h for www, chain_ in pinned if www == ww for h in chain_}
            assert set(pins) == running and all(n > 0 for n in pins.values())
        # the index never claims more than a worker was given, and the matched
        # depth is exactly the first block the worker does not hold
        for doc in docs:
            for ww, m in idx.match(doc, t).items():
                assert set(doc[: m.blocks]) <= given_blocks[ww]
                assert 0.0 < m.confidence <= 1.0
                assert all(idx.entry(ww, h) is not None for h in doc[: m.blocks])
                assert m.blocks == len(doc) or idx.entry(ww, doc[m.blocks]) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.integers(0, 3)), max_size=30))
def test_one_tenant_never_matches_another_tenants_entries(
    routed: list[tuple[str, int]],
) -> None:
    from prefixrouter.core import CacheNamespace

    idx = PrefixIndex()
    for tenant, d in routed:
        seed = CacheNamespace("m", tenant=tenant).seed
        idx.on_routed(A, chain(d, 4, seed), 0.0)
    seen = {(t, d) for t, d in routed}
    for tenant in ("t1", "t2", "t3"):
        seed = CacheNamespace("m", tenant=tenant).seed
        for d in range(4):
            got = idx.match(chain(d, 4, seed), 0.0)
            assert bool(got) == ((tenant, d) in seen)


def test_trust_relaxes_back_so_a_distrusted_worker_can_prove_itself() -> None:
    idx = PrefixIndex(IndexParams(miss_decay=0.2, trust_recovery_s=60.0))
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 160, 0, 0.0)  # a miss
    assert idx.trust(A, 0.0) == pytest.approx(0.2)
    assert idx.trust(A, 60.0) == pytest.approx(1 - 0.8 / math.e)
    assert idx.trust(A, 600.0) > 0.99
    # a reuse we did not predict is evidence too
    idx.on_completed(A, doc, 16.0, 0, 64, 0.0)
    assert idx.trust(A, 0.0) > 0.2


def test_a_miss_on_a_full_cache_is_put_down_to_eviction() -> None:
    idx = PrefixIndex(IndexParams(miss_decay=0.5))
    idx.set_capacity(A, 10)
    doc = chain(1, 10)  # fills A's cache
    idx.on_routed(A, doc, 0.0)
    assert idx.on_completed(A, doc, 16.0, 160, 32, 1.0) is True
    assert idx.trust(A, 1.0) == 1.0 and idx.eviction_misses == 1
    # the engine recomputed what it had evicted: the whole chain is confirmed again
    m = idx.match(doc, 1.0)[A]
    assert m.blocks == 10 and m.source is EntrySource.CONFIRMED
    idx.set_capacity(B, 1000)  # room to spare: the same miss means wrong inputs
    idx.on_routed(B, doc, 0.0)
    idx.on_completed(B, doc, 16.0, 160, 32, 1.0)
    assert idx.trust(B, 1.0) == 0.5 and idx.unexplained_misses == 1
    assert idx.match(doc, 1.0)[B].blocks == 2  # past the actual reuse: dropped


def test_free_blocks_is_capacity_minus_entries() -> None:
    idx = PrefixIndex(IndexParams(default_capacity_blocks=50))
    assert idx.free_blocks(A) == 50  # unknown worker: the default capacity, nothing held
    idx.on_routed(A, chain(1, 8), 0.0)
    idx.set_capacity(B, 20)
    idx.on_routed(B, chain(2, 5), 0.0)
    for w in (A, B):
        assert idx.free_blocks(w) == idx.capacity(w) - idx.blocks_of(w)
    assert idx.free_blocks(A) == 42 and idx.free_blocks(B) == 15


def test_rerouting_a_held_chain_refreshes_only_speculative_entries() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=10.0))
    doc = chain(1, 6)
    idx.on_routed(A, doc[:3], 0.0)
    idx.on_completed(A, doc[:3], 16.0, 0, 48, 0.0)  # the head is confirmed
    idx.on_routed(A, doc, 1.0)  # the tail is speculative
    idx.on_routed(A, doc, 5.0)  # every block held: the fast path
    for h in doc[:3]:
        e = idx.entry(A, h)
        assert e is not None and e.source is EntrySource.CONFIRMED and e.expires_at == math.inf
    for h in doc[3:]:
        e = idx.entry(A, h)
        assert e is not None and e.source is EntrySource.SPECULATIVE and e.expires_at == 15.0
    # and a confirmation of the whole chain upgrades the speculative tail only
    idx.on_completed(A, doc, 16.0, 0, 96, 5.0)
    assert all(
        (e := idx.entry(A, h)) is not None and e.source is EntrySource.CONFIRMED for h in doc
    )


def test_full_trust_stays_exactly_one() -> None:
    idx = PrefixIndex(IndexParams(miss_decay=0.5, hit_recovery=0.5))
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 160, 0, 0.0)  # a miss: 0.5
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 0, 160, 0.0)  # a hit: back to 1.0
    assert idx.trust(A, 0.0) == 1.0 and idx.trust(A, 1e6) == 1.0


# ------------------------------------------------------------- withdrawal


def _snapshot(idx: PrefixIndex, docs: list[tuple[BlockHash, ...]]) -> object:
    workers = (A, B)
    return (
        len(idx),
        idx.speculative_entries,
        {w: idx.blocks_of(w) for w in workers},
        [{w: (m.blocks, m.source) for w, m in idx.match(d, 2.0).items()} for d in docs],
    )


def test_a_withdrawn_routing_leaves_the_index_as_it_was() -> None:
    idx = PrefixIndex()
    doc = chain(1, 10)
    idx.on_routed(A, doc[:4], 0.0)
    idx.on_completed(A, doc[:4], 16.0, 0, 64, 0.5)  # the engine holds the head
    idx.on_routed(B, chain(2, 3), 0.5)  # and a routing in flight elsewhere
    before = _snapshot(idx, [doc, chain(2, 3)])
    placed = idx.on_routed(A, doc, 1.0)  # the request extends the document...
    assert {h for h, _ in placed} == set(doc[4:])  # ...its new tail is all it holds
    assert idx.match(doc, 1.0)[A].blocks == 10
    assert idx.withdraw(A, placed) == 6  # the engine refused it: the tail goes
    assert _snapshot(idx, [doc, chain(2, 3)]) == before
    assert idx.expiry_items <= 2 * idx.speculative_entries + 64


def test_withdrawing_one_of_two_routings_keeps_what_the_other_holds() -> None:
    idx = PrefixIndex()
    doc = chain(1, 8)
    first = idx.on_routed(A, doc, 0.0)
    second = idx.on_routed(A, doc[:5], 0.0)  # the same new prefix, in flight at once
    assert idx.withdraw(A, first) == 3  # only the tail the second one does not cover
    assert idx.match(doc, 0.0)[A].blocks == 5
    assert idx.withdraw(A, second) == 5  # both refused: nothing left
    assert len(idx) == 0 and idx.speculative_entries == 0
    # withdrawing in the other order ends the same
    first, second = idx.on_routed(A, doc, 1.0), idx.on_routed(A, doc, 1.0)
    assert idx.withdraw(A, second) == 0 and idx.match(doc, 1.0)[A].blocks == 8
    assert idx.withdraw(A, first) == 8 and len(idx) == 0


def test_withdrawal_never_removes_what_the_engine_reported() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=10.0))
    doc = chain(1, 6)
    refused = idx.on_routed(A, doc, 0.0)
    served = idx.on_routed(A, doc, 0.5)
    idx.on_completed(A, doc[:3], 16.0, 0, 48, 1.0)  # another prefill confirmed the head
    idx.apply(BlockStored(A, doc[3:5]), 1.0)  # and an event reported two more blocks
    idx.withdraw(A, served)
    assert idx.withdraw(A, refused) == 1  # only the last block was speculative
    m = idx.match(doc, 1.0)[A]
    assert m.blocks == 5 and m.source is EntrySource.EVENT
    assert idx.entry(A, doc[0]).source is EntrySource.CONFIRMED  # type: ignore[union-attr]
    # an untrusted (backlog) event holds its speculative entries for good
    other = chain(2, 4)
    placed = idx.on_routed(B, other, 1.0)
    idx.apply(BlockStored(B, other), 1.0, trusted=False)
    assert idx.withdraw(B, placed) == 0 and idx.match(other, 1.0)[B].blocks == 4
    # an entry evicted and created again since is another routing's: kept
    idx.set_capacity(B, 4)
    placed = idx.on_routed(B, chain(3, 4), 2.0)  # evicts `other`...
    again = idx.on_routed(B, other, 3.0)  # ...which comes back, evicting chain 3
    assert idx.withdraw(B, placed) == 0 and idx.match(other, 3.0)[B].blocks == 4
    # the untrusted event's holds went with the evicted entries: these were this routing's
    assert idx.withdraw(B, again) == 4 and idx.blocks_of(B) == 0


def test_the_expiry_heap_stays_bounded_by_the_live_speculative_entries() -> None:
    idx = PrefixIndex(IndexParams(speculative_ttl_s=120.0))
    workers = [WorkerId(f"w{i}") for i in range(4)]
    for w in workers:
        idx.set_capacity(w, 100)
    peak = 0
    for i in range(20_000):
        w = workers[i % 4]
        doc = chain(10 + i, 8)
        t = i * 1e-3  # 1,000 req/s: nothing expires within the run
        idx.on_routed(w, doc, t)
        if i % 3 == 0:  # a third is confirmed at once, the rest stay speculative
            idx.on_completed(w, doc, 16.0, 0, 0, t)
        peak = max(peak, idx.expiry_items)
    assert len(idx) == 400
    assert idx.speculative_entries == sum(
        1 for w in workers for _, e in idx.entries(w) if e.source is EntrySource.SPECULATIVE
    )
    # 160,000 entries were placed; the heap holds about what the index does
    assert peak <= 2 * 400 + 64 + 8
    assert idx.expiry_items <= 2 * idx.speculative_entries + 64


def test_a_large_expiry_heap_is_rebuilt_in_bounded_steps_without_changing_expiry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rebuilt at once, a heap of 1.6 million items stopped the router for half a second.

    The same traffic through an index that rebuilds in one go and one that
    rebuilds a step at a time: the same entries expire at the same times,
    and no step moves more than its budget.
    """
    from prefixrouter.core import index as index_mod

    def traffic(idx: PrefixIndex, log: list[tuple[float, int, int]]) -> None:
        for i in range(600):
            t = i * 0.5
            doc = chain(i, 40)  # 40 new blocks a request, all speculative
            idx.on_routed(A, doc, t)
            if i % 4:  # three in four are confirmed: dead heap items pile up
                idx.on_completed(A, doc, 16.0, 0, 0, t)
            log.append((t, idx.expire(t), len(idx)))

    step = 256
    one_go, stepwise = PrefixIndex(), PrefixIndex()
    monkeypatch.setattr(index_mod, "_DRAIN_STEP", 10**9)
    log_one: list[tuple[float, int, int]] = []
    traffic(one_go, log_one)
    monkeypatch.setattr(index_mod, "_DRAIN_STEP", step)
    moved: list[int] = []
    drain = stepwise._compact_expiry

    def counting() -> None:
        before = len(stepwise._draining)
        pushed = stepwise._pushed
        drain()
        taken = before - len(stepwise._draining) if before else 0
        assert taken <= step + 2 * pushed  # bounded by what the call pays for
        moved.append(taken)

    stepwise._compact_expiry = counting  # type: ignore[method-assign]
    log_step: list[tuple[float, int, int]] = []
    traffic(stepwise, log_step)
    assert log_step == log_one  # same expiries, same sizes
    assert sum(1 for m in moved if m) > 10  # rebuilt over many calls, not one
    assert stepwise.expiry_items <= 2 * stepwise.speculative_entries + 64 or stepwise.compacting
    assert stepwise.expiry_items <= 2 * one_go.expiry_items + step


def test_entries_are_invisible_to_the_cyclic_garbage_collector() -> None:
    """A full collection walks every tracked object: entries must not be among them.

    With entries as class instances, an index of 1.6 million entries paused
    the process 0.72 s per full collection. Speculative, confirmed and
    event entries, their holder sets and the expiry heap's items must all
    leave the collector's lists.
    """
    import gc

    idx = PrefixIndex(IndexParams(default_capacity_blocks=100_000))
    gc.collect()
    before = len(gc.get_objects())
    for r in range(40):  # 40 x 500 blocks: 20,000 entries of every source
        chain = [BlockHash(r * 1_000 + i) for i in range(500)]
        idx.on_routed(A if r % 2 else B, chain, float(r))
        if r % 4 == 0:
            idx.on_completed(B, chain, 16.0, 0, 0, float(r))
        elif r % 4 == 2:
            idx.apply(BlockStored(B, tuple(chain)), float(r))
    gc.collect()
    assert len(idx) == 20_000 and idx.speculative_entries >= 5_000
    assert len(gc.get_objects()) - before < 200


class _Walk(PrefixIndex):
    _shaped = False  # every chain block by block: the reference for the shaped paths


# Few workers and documents, so one chain sees many kinds of touches in turn.
few_ops = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "route",
                "complete",
                "store",
                "tail",
                "remove",
                "clear",
                "withdraw",
                "demote",
                "pin",
                "unpin",
            ]
        ),
        st.sampled_from([A, B]),
        st.integers(0, 1),
        st.integers(0, 8),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(few_ops, st.integers(2, 12))
# Speculative entries ahead of confirmed ones (an event head demoted): neither
# a routing nor an answer may skip them.
@example([("store", A, 0, 3), ("complete", A, 0, 0), ("demote", A, 0, 0), ("route", A, 0, 8),
          ("complete", A, 0, 0)], 12)  # fmt: skip
# Events for a chain's tail only (stronger entries after weaker ones), then the whole chain.
@example([("complete", A, 0, 0), ("tail", A, 0, 3), ("store", A, 0, 8)], 12)
# A held head and a new tail, then a hole.
@example([("route", A, 0, 4), ("route", A, 0, 8), ("remove", A, 0, 4), ("route", A, 0, 8)], 12)
def test_shaped_chain_paths_change_the_index_as_the_block_by_block_walk(
    script: list[tuple[str, WorkerId, int, int]], capacity: int
) -> None:
    # Routings and answers of chains held whole, held up to a new tail, or with
    # holes: the shaped paths leave every entry, its recency and what each
    # routing holds exactly as the general walk does.
    params = IndexParams(max_entries=20, speculative_ttl_s=5.0)
    shaped, walk = PrefixIndex(params), _Walk(params)
    docs = [chain(d, 8) for d in range(2)]
    workers = (A, B)
    for idx in (shaped, walk):
        for w in workers:
            idx.set_capacity(w, capacity)
    t = 0.0
    routings: list[tuple[WorkerId, Placement, Placement]] = []
    pinned: list[tuple[WorkerId, tuple[BlockHash, ...]]] = []
    for op, w, d, n in script:
        t += 1.0
        if op == "pin":  # a request that runs on: its blocks set aside when met by eviction
            pinned.append((w, docs[d][:n]))
            for idx in (shaped, walk):
                idx.pin(*pinned[-1])
            op = "route"
        if op == "unpin":
            if pinned:
                ww, blocks = pinned.pop(d % len(pinned))
                for idx in (shaped, walk):
                    idx.unpin(ww, blocks)
        elif op == "withdraw":
            if routings:
                ww, mine, theirs = routings.pop(d % len(routings))
                assert shaped.withdraw(ww, mine) == walk.withdraw(ww, theirs)
        elif op == "demote":  # event entries become speculative: firm and speculative mixed
            for idx in (shaped, walk):
                idx.demote_events(w, t)
        elif op == "remove":  # a hole: the chain's middle removed, its ends kept
            for idx in (shaped, walk):
                idx.apply(BlockRemoved(w, docs[d][n // 2 : n // 2 + 1]), t)
        elif op == "complete":
            for idx in (shaped, walk):
                idx.on_completed(w, docs[d], 16.0, 16 * n, 16 * (n // 2), t)
        elif op in ("store", "tail"):
            blocks = docs[d][:n] if op == "store" else docs[d][n:]
            for idx in (shaped, walk):
                idx.apply(BlockStored(w, blocks), t)
        elif op == "clear":
            for idx in (shaped, walk):
                idx.expire(t + 3.0)
        else:
            mine, theirs = (idx.on_routed(w, docs[d][:n], t) for idx in (shaped, walk))
            assert sorted(mine) == sorted(theirs)
            routings.append((w, mine, theirs))
        for ww in workers:
            assert shaped.entries(ww) == walk.entries(ww)
        assert len(shaped) == len(walk)
        assert shaped.speculative_entries == walk.speculative_entries
        assert shaped.evicted_entries == walk.evicted_entries
