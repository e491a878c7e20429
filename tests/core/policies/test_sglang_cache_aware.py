from __future__ import annotations

import pytest

from prefixrouter.core import Decision, Router, WorkerId, create_policy
from prefixrouter.core.policies.sglang_cache_aware import SglangCacheAware
from tests.core.conftest import request, send, tokens, with_loads, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")
DOC = tokens(1, 1_000)


@pytest.mark.parametrize(
    ("loads", "worker", "tier"),
    [
        ((40, 5), W1, "balance"),  # 35 > 32 and 40 > 1.1 * 5: least loaded, prefix ignored
        ((400, 367), W0, "cache_hit"),  # 33 > 32 but 400 <= 1.1 * 367: not imbalanced
        ((30, 0), W0, "cache_hit"),  # 30 <= 32: not imbalanced
    ],
)
def test_balance_needs_both_thresholds(loads: tuple[int, int], worker: WorkerId, tier: str) -> None:
    r = Router("sglang_cache_aware")
    send(r, request("a", DOC), with_loads(*loads), W0, 0.0)
    d = r.route(request("q", DOC + tokens(2, 100)), with_loads(*loads), 1.0)
    assert (d.worker_id, d.tier) == (worker, tier)


def test_cache_hit_goes_to_the_deepest_node() -> None:
    r = Router("sglang_cache_aware")
    ws = with_loads(10, 0, 0)
    send(r, request("a", DOC), ws, W0, 0.0)
    send(r, request("b", DOC[:500]), ws, W1, 0.5)
    d = r.route(request("q", DOC + tokens(2, 100)), ws, 1.0)
    assert d.worker_id == W0 and d.tier == "cache_hit"  # 992 of 1,100 tokens: rate 0.90
    assert d.predicted_cached_tokens == 992
    assert {c.worker_id: c.matched_tokens for c in d.candidates} == {W0: 992, W1: 496, "w2": 0}


def test_miss_goes_to_least_loaded_or_smallest_tree() -> None:
    ws = with_loads(3, 1, 2)
    q = request("q", DOC[:200] + tokens(5, 800))  # w0 holds 192 of 1,000 tokens: rate 0.19

    def decide(fallback: str) -> Decision:
        r = Router(create_policy("sglang_cache_aware", {"miss_fallback": fallback}))
        send(r, request("a", DOC), ws, W0, 0.0)
        send(r, request("b", tokens(7, 2_000)), ws, W1, 0.0)
        return r.route(q, ws, 1.0)

    newer, older = decide("least_loaded"), decide("smallest_tree")
    assert (newer.worker_id, newer.tier) == (W1, "cache_miss")
    assert (older.worker_id, older.tier) == ("w2", "cache_miss")  # w2's tree is empty


def test_periodic_lru_eviction_keeps_each_tree_under_max_tree_size() -> None:
    r = Router("sglang_cache_aware")
    policy = r.policy
    assert isinstance(policy, SglangCacheAware)
    limit = policy.max_tree_blocks(16.0)
    assert limit == 156  # 10,000 characters / (4 characters x 16 tokens)
    ws = workers(2)
    send(r, request("a", tokens(1, 4_000)), ws, W0, 0.0)  # 250 blocks
    send(r, request("b", tokens(2, 800)), ws, W1, 10.0)
    assert policy.tree.size(W0) == 250  # not before the interval has passed
    r.route(request("c", tokens(3, 800)), ws, 40.0)  # select evicts nothing
    assert policy.tree.size(W0) == 250
    send(r, request("c", tokens(3, 800)), ws, W1, 40.0)
    assert policy.tree.size(W0) == limit
    # LRU removes leaves first: the head of the chain is still matched
    d = r.route(request("q", tokens(1, 4_000)), ws, 41.0)
    assert d.candidates[0].matched_tokens == limit * 16
