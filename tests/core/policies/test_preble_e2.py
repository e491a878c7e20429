from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import (
    Router,
    SpeedProfile,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.policies.preble_e2 import PrebleE2
from tests.core.conftest import request, send, tokens, workers

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
DOC = tokens(1, 1_600)
PROFILE = SpeedProfile()
DOC_PREFILL = PROFILE.prefill_time(1_600)  # the window load of routing DOC cold


def decoding(w: WorkerView, remaining: int) -> WorkerView:
    """One running request with ``remaining`` tokens to go: load = that many decode steps."""
    return replace(w, decoding=1, decode_tokens_remaining=remaining)


def preble(r: Router) -> PrebleE2:
    assert isinstance(r.policy, PrebleE2)
    return r.policy


@pytest.mark.parametrize(
    ("w1_remaining", "worker", "tier"),
    [
        (10, W0, "exploit"),  # w0's load 0.084 s <= 1.5 x w1's 0.081 s
        (5, W1, "rebalance"),  # 0.084 s > 1.5 x 0.040 s: the lightest instead
    ],
)
def test_exploit_when_cached_exceeds_uncached(
    w1_remaining: int, worker: WorkerId, tier: str
) -> None:
    r = Router("preble_e2")
    ws = workers(2)
    send(r, request("a", DOC), ws, W0, 0.0)
    ws[1] = decoding(ws[1], w1_remaining)
    assert preble(r).load(ws[0], 1.0) == pytest.approx(DOC_PREFILL)
    d = r.route(request("q", DOC + tokens(2, 400)), ws, 1.0)  # cached 1,600 > uncached 400
    assert (d.worker_id, d.tier) == (worker, tier)


def test_exploit_takes_the_cheapest_holder() -> None:
    r = Router("preble_e2")
    ws = workers(3)
    send(r, request("a", DOC), ws, W0, 0.0)
    send(r, request("b", DOC), ws, W1, 0.0)
    ws[0] = decoding(ws[0], 5)
    ws[2] = decoding(ws[2], 10)
    d = r.route(request("q", DOC + tokens(2, 400)), ws, 1.0)
    assert (d.worker_id, d.tier) == (W1, "exploit") and d.predicted_cached_tokens == 1_600


def test_explore_is_the_argmin_of_load_eviction_and_prefill() -> None:
    r = Router("preble_e2")
    ws = workers(2)
    send(r, request("a", DOC[:400]), ws, W0, 0.0)
    ws[0] = decoding(ws[0], 100)
    d = r.route(request("q", DOC + tokens(2, 400)), ws, 1.0)  # cached 400 < uncached 1,600
    assert (d.worker_id, d.tier) == (W1, "explore")
    c0, c1 = d.candidates
    assert c1.score == pytest.approx(PROFILE.prefill_time(2_000))
    assert c0.score == pytest.approx(preble(r).load(ws[0], 1.0) + PROFILE.prefill_time(1_600, 400))
    assert c0.matched_tokens == 400 and c0.score > c1.score


def test_eviction_cost_weighs_what_lru_would_evict_by_its_hits() -> None:
    r = Router("preble_e2")
    ws = workers(2, kv_capacity_blocks=10)
    hot = tokens(3, 128)  # 8 blocks on w0, 2 free
    costs = []
    for k in range(3):
        send(r, request(f"h{k}", hot), ws, W0, float(k))
        costs.append(preble(r).eviction_cost(ws[0], 320, 16.0, 3.0))
    assert 0 < costs[0] < costs[1] < costs[2]  # each hit makes the victims dearer
    assert preble(r).eviction_cost(ws[0], 32, 16.0, 3.0) == 0.0  # 2 blocks fit
    assert preble(r).eviction_cost(ws[1], 320, 16.0, 3.0) == 0.0  # nothing to evict


def test_windowed_load_forgets_old_requests_and_capacity_bounds_the_tree() -> None:
    r = Router(create_policy("preble_e2", {"gpu_capacity_tokens": 320}))
    ws = workers(2)
    send(r, request("a", DOC), ws, W0, 0.0)
    assert preble(r).load(ws[0], 100.0) == pytest.approx(DOC_PREFILL)
    assert preble(r).load(ws[0], 181.0) == 0.0
    assert preble(r).tree.size(W0) == 20
