"""Behaviour of the simulated KV cache: reuse, LRU order, pinning, failures, clear."""

from __future__ import annotations

import random

import pytest

from prefixrouter.core.types import BlockHash
from prefixrouter.sim.kv_cache import KvCache

BS = 4  # tokens per block, small so prompts stay readable


def H(*xs: int) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(x) for x in xs)


def state(c: KvCache) -> tuple[int, int, int, int, int]:
    return (c.free_blocks, c.used_blocks, c.cached_blocks, c.evictable_blocks, c.evictions)


def test_prefix_reuse_counts_leading_cached_blocks() -> None:
    c = KvCache(32, BS)
    a = c.allocate("a", H(1, 2, 3, 4), 18, 18, now=0.0)
    assert a is not None and a.cached_blocks == 0
    assert a.stored_hashes == list(H(1, 2, 3, 4))
    assert a.stored[0].parent is None
    c.free("a", 1.0)
    assert c.match(H(1, 2, 9, 4)) == 2  # stops at the first miss
    assert c.match(H(7, 2)) == 0
    b = c.allocate("b", H(1, 2, 9, 10), 18, 18, now=2.0)
    assert b is not None and b.cached_blocks == 2
    assert b.stored_hashes == list(H(9, 10))
    assert b.stored[0].parent == BlockHash(2)
    c.check()


def test_match_does_not_mutate() -> None:
    c = KvCache(8, BS)
    c.allocate("a", H(1, 2), 8, 8, 0.0)
    c.free("a", 1.0)
    before = state(c)
    assert c.match(H(1, 2)) == 2
    assert c.can_allocate(H(1, 2), 9, 9)
    assert state(c) == before


def test_last_token_is_recomputed_when_whole_prompt_is_cached() -> None:
    c = KvCache(16, BS)
    c.allocate("a", H(1, 2, 3), 12, 12, 0.0)  # exactly three full blocks
    c.free("a", 1.0)
    exact = c.allocate("b", H(1, 2, 3), 12, 12, 2.0)
    assert exact is not None and exact.cached_blocks == 2  # min(12, 12-1) // 4
    assert exact.stored == []  # block 3 is already cached: the copy stays anonymous
    c.free("b", 3.0)
    longer = c.allocate("c", H(1, 2, 3), 13, 13, 4.0)  # a partial tail block follows
    assert longer is not None and longer.cached_blocks == 3
    c.check()


def test_eviction_frees_chain_tail_first() -> None:
    c = KvCache(3, BS)
    c.allocate("a", H(1, 2, 3), 12, 12, 0.0)
    c.free("a", 5.0)
    alloc = c.allocate("b", H(), 4, 4, 6.0)
    assert alloc is not None
    assert [h for h, _ in alloc.evicted] == list(H(3))  # tail goes first
    alloc2 = c.allocate("c", H(), 8, 8, 7.0)
    assert alloc2 is not None
    assert [h for h, _ in alloc2.evicted] == list(H(2, 1))  # head last
    c.check()


def test_least_recently_used_chain_is_evicted_first() -> None:
    c = KvCache(4, BS)
    c.allocate("a", H(1, 2), 8, 8, 0.0)
    c.allocate("b", H(5, 6), 8, 8, 0.0)
    c.free("b", 1.0)  # b's chain freed first: least recently used
    c.free("a", 2.0)
    alloc = c.allocate("x", H(), 12, 12, 10.0)
    assert alloc is not None
    assert alloc.evicted == [(BlockHash(6), 9.0), (BlockHash(5), 9.0), (BlockHash(2), 8.0)]
    assert c.evictions == 3
    assert c.eviction_stats.max_age == 9.0
    assert c.eviction_stats.mean_age == pytest.approx(26.0 / 3)
    assert c.eviction_stats.histogram[4] == 3  # all three ages in [8, 16) s


def test_reuse_refreshes_recency() -> None:
    c = KvCache(4, BS)
    c.allocate("a", H(1, 2), 8, 8, 0.0)
    c.free("a", 1.0)
    c.allocate("b", H(5, 6), 8, 8, 2.0)
    c.free("b", 3.0)
    a2 = c.allocate("a2", H(1, 2), 9, 9, 4.0)  # reuses 1, 2 and takes one more block
    assert a2 is not None and a2.cached_blocks == 2
    assert [h for h, _ in a2.evicted] == list(H(6))  # not 1 or 2, freed earlier
    c.free("a2", 5.0)
    # 1, 2 were used last, so the rest of the 5-6 chain goes first.
    alloc = c.allocate("x", H(), 8, 8, 6.0)
    assert alloc is not None and [h for h, _ in alloc.evicted] == list(H(5))
    assert 1 in c and 2 in c


def test_pinned_blocks_are_never_evicted() -> None:
    c = KvCache(4, BS)
    c.allocate("a", H(1, 2), 8, 8, 0.0)  # pinned
    c.allocate("b", H(5, 6), 8, 8, 0.0)
    c.free("b", 1.0)
    assert c.allocate("x", H(), 12, 12, 2.0) is None  # would need a pinned block
    alloc = c.allocate("y", H(), 8, 8, 2.0)
    assert alloc is not None
    assert {h for h, _ in alloc.evicted} == set(H(5, 6))
    assert 1 in c and 2 in c
    c.check()


def test_shared_blocks_stay_pinned_until_last_user_frees() -> None:
    c = KvCache(4, BS)
    c.allocate("a", H(1, 2), 9, 9, 0.0)  # 3 blocks: 1, 2 and a partial tail
    c.allocate("b", H(1, 2), 9, 9, 0.0)  # reuses 1, 2; needs one more block
    assert c.used_blocks == 4
    c.free("a", 1.0)
    assert c.evictable_blocks == 0  # b still pins 1 and 2
    assert c.allocate("x", H(), 8, 8, 2.0) is None
    c.free("b", 3.0)
    assert c.evictable_blocks == 2 and c.free_blocks == 4
    c.check()


def test_failed_allocation_changes_nothing() -> None:
    c = KvCache(5, BS)
    c.allocate("a", H(1, 2), 8, 8, 0.0)
    c.free("a", 1.0)
    c.allocate("b", H(3), 8, 8, 1.0)
    before = state(c)
    # Reuses 1, 2 (evictable now) and needs 3 more blocks: only 1 empty + 0 evictable left.
    assert c.allocate("x", H(1, 2, 7), 20, 20, 2.0) is None
    assert state(c) == before
    assert not c.holds("x")
    assert c.match(H(1, 2)) == 2
    c.check()


def test_lazy_registration_and_commit_runs() -> None:
    c = KvCache(16, BS)
    a = c.allocate("a", H(1, 2, 3, 4), 17, 20, 0.0, register=False)
    assert a is not None and a.stored == []
    assert c.match(H(1, 2, 3, 4)) == 0  # nothing computed yet
    runs = c.commit("a", 9, 0.5)  # two full blocks computed
    assert [(r.parent, r.hashes) for r in runs] == [(None, list(H(1, 2)))]
    assert c.match(H(1, 2, 3, 4)) == 2
    # Another request computes block 3 first: a's copy stays anonymous.
    c.allocate("b", H(1, 2, 3), 13, 13, 0.6)
    runs = c.commit("a", 17, 1.0)
    assert [(r.parent, r.hashes) for r in runs] == [(BlockHash(3), list(H(4)))]
    assert c.commit("a", 17, 1.0) == []
    c.check()
    c.free("a", 2.0)
    c.free("b", 2.0)
    assert c.used_blocks == 0 and c.cached_blocks == 4
    c.check()


def test_grow_adds_blocks_or_fails_cleanly() -> None:
    c = KvCache(4, BS)
    c.allocate("a", H(1), 5, 5, 0.0)  # 2 blocks
    assert c.grow("a", 8, 1.0) == []  # still 2 blocks
    assert c.grow("a", 12, 1.0) == []
    assert c.used_blocks == 3
    before = state(c)
    assert c.grow("a", 24, 1.0) is None
    assert state(c) == before
    c.free("a", 2.0)
    assert c.free_blocks == 4 and c.cached_blocks == 1
    c.check()


def test_clear_forgets_hashes_but_keeps_running_memory() -> None:
    c = KvCache(8, BS)
    c.allocate("a", H(1, 2), 8, 8, 0.0)
    c.allocate("b", H(5, 6), 9, 9, 0.0)
    c.free("a", 1.0)
    c.clear()
    assert c.cached_blocks == 0 and c.match(H(1, 2)) == 0 and c.match(H(5)) == 0
    assert c.used_blocks == 3  # b still runs
    c.check()
    c.free("b", 2.0)
    assert c.free_blocks == 8 and c.used_blocks == 0
    c.check()


def test_allocate_rejects_bad_input() -> None:
    c = KvCache(8, BS)
    with pytest.raises(ValueError):
        c.allocate("a", H(1, 2, 3), 8, 8, 0.0)  # more hashes than prompt blocks
    c.allocate("a", H(1), 4, 4, 0.0)
    with pytest.raises(ValueError):
        c.allocate("a", H(1), 4, 4, 0.0)  # same id twice


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(7)
    c = KvCache(40, BS)
    live: list[str] = []
    stored: set[int] = set()
    t = 0.0
    for i in range(600):
        t += 1.0
        if live and rng.random() < 0.45:
            c.free(live.pop(rng.randrange(len(live))), t)
        else:
            family = rng.randrange(4)
            n = rng.randrange(0, 6)
            hashes = H(*(family * 100 + j for j in range(n)))
            prompt = n * BS + rng.randrange(0, BS)
            prompt = max(prompt, 1)
            alloc = c.allocate(f"r{i}", hashes, prompt, prompt + rng.randrange(0, 9), t)
            if alloc is not None:
                live.append(f"r{i}")
                stored.update(alloc.stored_hashes)
                stored.difference_update(h for h, _ in alloc.evicted)
        c.check()
        # Events replayed in order describe the cache exactly.
        assert stored == {h for h in range(400) if h in c}
