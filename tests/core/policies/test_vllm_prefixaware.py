from __future__ import annotations

from dataclasses import replace

from prefixrouter.core import Router, WorkerId, create_policy
from tests.core.conftest import request, send, tokens, workers

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
DOC = tokens(1, 2_000)


def test_longest_match_wins_with_no_load_term() -> None:
    r = Router("vllm_prefixaware")
    ws = workers(3)
    send(r, request("a", DOC), ws, W0, 0.0)
    send(r, request("b", DOC[:1_000]), ws, W1, 0.0)
    ws[0] = replace(ws[0], in_flight=500)  # no load term: still w0
    d = r.route(request("q", DOC + tokens(2, 50)), ws, 1.0)
    assert (d.worker_id, d.tier) == (W0, "longest_match")
    assert d.predicted_cached_tokens == 1_984  # 62 chunks of 128 characters (2 blocks each)


def test_chunks_are_128_characters() -> None:
    r = Router("vllm_prefixaware")
    ws = workers(2)
    send(r, request("a", DOC[:48]), ws, W1, 0.0)  # 3 blocks = 1 whole chunk
    d = r.route(request("q", DOC), ws, 1.0)
    assert d.worker_id == W1 and d.predicted_cached_tokens == 32


def test_random_tie_break_deterministic_per_request_id() -> None:
    ws = workers(3)
    r = Router("vllm_prefixaware")
    send(r, request("a", DOC), ws, W0, 0.0)
    send(r, request("b", DOC), ws, W1, 0.0)
    chosen = set()
    for k in range(20):
        q = request(f"q{k}", DOC + tokens(k, 20))
        d = r.route(q, ws, 1.0)
        again = Router("vllm_prefixaware")
        send(again, request("a", DOC), ws, W0, 0.0)
        send(again, request("b", DOC), ws, W1, 0.0)
        assert again.route(q, ws, 1.0).worker_id == d.worker_id
        chosen.add(d.worker_id)
    assert chosen == {W0, W1}  # both tied workers, never the unmatched one


def test_no_match_is_random_and_fallback_takes_lowest_recent_qps() -> None:
    ws = workers(3)
    plain = Router("vllm_prefixaware")
    assert plain.route(request("q", tokens(9, 100)), ws, 0.0).tier == "no_match"
    r = Router(create_policy("vllm_prefixaware", {"min_match_chars": 1_000}))
    for i, w in enumerate((W0, W0, W1)):
        send(r, request(f"h{i}", tokens(20 + i, 100)), ws, w, float(i))
    d = r.route(request("q", tokens(9, 100)), ws, 3.0)
    assert (d.worker_id, d.tier) == (W2, "low_qps")
