from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import Router, WorkerId, create_policy
from prefixrouter.core.policies.llmd_weighted import LlmdWeighted
from tests.core.conftest import request, send, tokens, workers

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
DOC = tokens(1, 1_600)  # 100 blocks of 16 tokens = 64 characters


@pytest.mark.parametrize(
    ("w0_kv_used", "worker", "w0_score"),
    [
        (400, W0, 3 * 1.0 + 2 * 0.0 + 2 * 0.6),  # 4.2 beats w1's 4.0
        (600, W1, 3 * 1.0 + 2 * 0.0 + 2 * 0.4),  # 3.8 loses to w1's 4.0
    ],
)
def test_weighted_sum_of_prefix_queue_and_kv_scorers(
    w0_kv_used: int, worker: WorkerId, w0_score: float
) -> None:
    r = Router("llmd_weighted")
    base = workers(3, kv_capacity_blocks=1_000)
    send(r, request("a", DOC), base, W0, 0.0)
    ws = [
        replace(base[0], in_flight=4, kv_used_blocks=w0_kv_used),  # prefix 1, queue 4
        base[1],  # prefix 0, queue 0, kv 0: 0 + 2 * 1 + 2 * 1
        replace(base[2], in_flight=3, decoding=1, kv_used_blocks=500),  # queue 2: 0 + 1 + 1
    ]
    d = r.route(request("q", DOC), ws, 1.0)
    scores = {c.worker_id: c.score for c in d.candidates}
    assert scores == pytest.approx({W0: w0_score, W1: 4.0, W2: 2.0})
    assert d.worker_id == worker
    assert d.tier == ("prefix" if worker == W0 else "load")


def test_at_most_256_blocks_and_a_per_server_lru() -> None:
    r = Router("llmd_weighted")
    ws = workers(2)
    long = tokens(2, 8_000)  # 500 blocks
    send(r, request("a", long), ws, W0, 0.0)
    d = r.route(request("q", long), ws, 1.0)
    assert d.worker_id == W0 and d.predicted_cached_tokens == 256 * 16
    assert d.candidates[0].score == pytest.approx(3.0 + 2.0 + 2.0)  # prefix 256 / 256
    small = Router(create_policy("llmd_weighted", {"lru_capacity_per_server": 10}))
    send(small, request("a", DOC), ws, W0, 0.0)
    policy = small.policy
    assert isinstance(policy, LlmdWeighted) and policy.index.size(W0) == 10
