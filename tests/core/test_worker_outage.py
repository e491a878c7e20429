"""A worker's index through an outage: kept as speculative when it goes down, cleared on restart."""

from __future__ import annotations

import pytest

from prefixrouter.core import (
    BlockHash,
    BlockStored,
    EntrySource,
    IndexParams,
    Router,
    WorkerId,
    hash_token_blocks,
)
from tests.core.conftest import NS, tokens

A, B = WorkerId("a"), WorkerId("b")


def chain(start: int, blocks: int) -> tuple[BlockHash, ...]:
    return hash_token_blocks(NS.seed, tokens(start, blocks * 16), 16)


def test_a_worker_down_keeps_its_entries_as_speculative_with_a_ttl() -> None:
    router = Router(index_params=IndexParams(speculative_ttl_s=10.0))
    idx = router.index
    confirmed, evented, routed = chain(1, 4), chain(2, 3), chain(3, 2)
    idx.on_routed(A, confirmed, 0.0)
    idx.on_completed(A, confirmed, 16.0, 0, 64, 0.0)
    idx.apply(BlockStored(A, list(evented)), 0.0)
    idx.on_routed(A, routed, 0.0)
    idx.on_routed(B, confirmed, 0.0)
    idx.on_completed(B, confirmed, 16.0, 0, 64, 0.0)

    assert router.worker_down(A, 5.0) == 7  # the confirmed and event entries
    assert idx.blocks_of(A) == 9  # nothing forgotten
    m = idx.match(confirmed, 6.0)
    assert m[A].blocks == 4 and m[A].source is EntrySource.SPECULATIVE
    assert m[B].source is EntrySource.CONFIRMED  # other workers untouched
    # One TTL from the outage for every entry (the routed chain's too, so no
    # demoted extension outlives a speculative prefix); then they expire.
    assert idx.expire(14.9) == 0
    assert idx.expire(15.0) == 9
    assert idx.blocks_of(A) == 0 and idx.blocks_of(B) == 4


def test_a_completion_after_the_outage_confirms_the_entries_again() -> None:
    router = Router(index_params=IndexParams(speculative_ttl_s=10.0))
    idx = router.index
    doc = chain(1, 4)
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 0, 64, 0.0)
    router.worker_down(A, 1.0)
    idx.on_completed(A, doc, 16.0, 64, 64, 2.0)  # the engine came back with its cache
    assert idx.expire(100.0) == 0
    assert idx.match(doc, 100.0)[A].source is EntrySource.CONFIRMED


def test_a_worker_back_from_an_outage_keeps_its_entries_and_takes_the_fleets_best_factor() -> None:
    router = Router()
    doc = chain(1, 4)
    router.index.on_routed(A, doc, 0.0)
    router.index.on_completed(A, doc, 16.0, 0, 64, 0.0)
    cost = router.cost
    cost._scale.update({A: 1.3, B: 1.1})  # A's factor from before the outage
    router.worker_down(A, 1.0)
    cost._scale[B] = 0.9  # B kept learning while A was down
    router.worker_up(A)
    assert router.index.blocks_of(A) == 4  # the same process: its cache is there
    assert cost.scale(A) < cost.scale(B) and cost.scale(A) == pytest.approx(0.9, rel=1e-5)
    cost._scale[B] = 0.8  # followed live until A is observed again
    assert cost.scale(A) == pytest.approx(0.8, rel=1e-5) and cost.scale(A) < 0.8


def test_a_restarted_worker_is_cleared() -> None:
    router = Router()
    doc = chain(1, 4)
    router.index.on_routed(A, doc, 0.0)
    router.index.on_routed(B, doc, 0.0)
    router.worker_restarted(A, 1.0)
    assert router.index.blocks_of(A) == 0
    assert set(router.index.match(doc, 1.0)) == {B}


def _recount(router: Router) -> int:
    """Live speculative entries, counted the slow way."""
    idx = router.index
    return sum(
        1
        for w in (A, B)
        for h in set(chain(1, 40)) | set(chain(2, 40))
        if (e := idx.entry(w, h)) is not None and e.source is EntrySource.SPECULATIVE
    )


def test_an_outage_keeps_the_speculative_count_and_the_heap_bound_exact() -> None:
    router = Router(index_params=IndexParams(speculative_ttl_s=10.0))
    idx = router.index
    doc, other = chain(1, 40), chain(2, 40)
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 0, 640, 0.0)
    idx.on_routed(A, other, 0.0)
    router.worker_down(A, 1.0)
    assert idx.speculative_entries == _recount(router) == 80
    router.worker_restarted(A, 1.5)  # cleared: the count must come back to 0, not below
    assert idx.speculative_entries == _recount(router) == 0
    for t in range(50):  # routings after the outage: the heap stays bounded
        idx.on_routed(B, chain(100 + t, 8), 2.0 + t)
    assert idx.expiry_items <= 2 * idx.speculative_entries + 64


def test_withdrawing_a_routing_after_an_outage_keeps_what_the_engine_reported() -> None:
    router = Router()
    idx = router.index
    b0 = chain(1, 2)
    placed = idx.on_routed(A, b0[:1], 0.0)
    idx.apply(BlockStored(A, list(b0[:1])), 0.1)  # the engine prefilled it
    idx.on_routed(A, b0, 0.2)
    router.worker_down(A, 1.0)  # reported block demoted to speculative
    idx.withdraw(A, placed)  # the first request timed out after all
    assert idx.match(b0, 1.5)[A].blocks >= 1  # the engine's block is kept: no orphaned tail


def test_a_miss_of_a_request_routed_before_a_restart_is_the_restarts() -> None:
    """Like an engine's clear event: the restart, not the hashing, explains it."""
    router = Router(index_params=IndexParams(miss_decay=0.5))
    idx = router.index
    doc = chain(1, 10)
    idx.on_routed(A, doc, 0.0)
    idx.on_completed(A, doc, 16.0, 0, 160, 0.5)
    idx.on_routed(A, doc, 1.0)  # predicted warm...
    router.worker_restarted(A, 1.5)  # ...then the engine came back as a new process
    assert idx.on_completed(A, doc, 16.0, 160, 0, 2.0, routed_at=1.0) is False
    assert idx.trust(A, 2.0) == 1.0 and idx.unexplained_misses == 0
