from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import Router, WorkerId, create_policy
from tests.core.conftest import request, send, tokens, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")
DOC = tokens(1, 1_280)  # 80 blocks
PROMPT = DOC + tokens(2, 320)  # 100 blocks


@pytest.mark.parametrize(
    ("w0_context", "worker", "w0_cost"),
    [
        (1_600, W1, (40 + 100 - 80) + 100),  # 160 > w1's 100: the decode blocks outweigh overlap
        (0, W0, (40 + 100 - 80) + 0),  # 60 < 100: the overlap wins
    ],
)
def test_cost_counts_prefill_minus_overlap_plus_decode(
    w0_context: int, worker: WorkerId, w0_cost: float
) -> None:
    r = Router("dynamo_cost")
    ws = workers(2)
    send(r, request("a", DOC), ws, W0, 0.0)
    ws[0] = replace(ws[0], pending_prefill_tokens=640, context_tokens=w0_context)  # 40 blocks
    d = r.route(request("q", PROMPT), ws, 1.0)
    assert {c.worker_id: c.score for c in d.candidates} == pytest.approx({W0: w0_cost, W1: 100})
    assert (d.worker_id, d.tier) == (worker, "min_cost")
    assert d.candidates[0].matched_tokens == 1_280


def test_own_index_expires_after_ttl_and_events_mode_reads_the_shared_index() -> None:
    r = Router("dynamo_cost")
    ws = workers(2)
    send(r, request("a", DOC), ws, W1, 0.0)
    assert r.route(request("q", PROMPT), ws, 119.0).worker_id == W1
    late = r.route(request("q", PROMPT), ws, 121.0)
    assert late.predicted_cached_tokens == 0 and late.candidates[1].score == 100
    events = Router(create_policy("dynamo_cost", {"use_kv_events": True}))
    events.index.on_routed(W1, events.blocks_for(request("a", DOC)).hashes, 0.0)
    d = events.route(request("q", PROMPT), ws, 1.0)
    assert d.worker_id == W1 and d.predicted_cached_tokens == 1_280


def test_softmax_sampling_is_deterministic_per_request_id() -> None:
    ws = workers(2)
    ws[0] = replace(ws[0], context_tokens=160)  # costs 110 and 100 blocks
    r = Router(create_policy("dynamo_cost", {"temperature": 1.0}))
    picks = [r.route(request(f"q{k}", PROMPT), ws, 0.0) for k in range(40)]
    again = [r.route(request(f"q{k}", PROMPT), ws, 0.0) for k in range(40)]
    assert [d.worker_id for d in picks] == [d.worker_id for d in again]
    assert {d.tier for d in picks} == {"softmax"} and {d.worker_id for d in picks} == {W0, W1}
