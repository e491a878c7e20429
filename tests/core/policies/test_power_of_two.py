from __future__ import annotations

from dataclasses import replace

from prefixrouter.core import Router, create_policy
from prefixrouter.core.policies.common import request_rng
from tests.core.conftest import request, tokens, with_loads, workers


def test_less_loaded_of_the_two_sampled_deterministic_per_request_id() -> None:
    loads = [0, 5, 10]
    ws = with_loads(*loads)
    r = Router("power_of_two")
    seen = set()
    for k in range(30):
        rid = f"r{k}"
        d = r.route(request(rid, tokens(k, 64)), ws, 0.0)
        i, j = request_rng(rid, 0).sample(range(3), 2)
        assert d.worker_id == ws[min(i, j, key=lambda x: loads[x])].worker_id
        assert d.tier == "sampled"
        # the same request id gives the same draw in another router
        assert Router("power_of_two").route(request(rid, tokens(k, 64)), ws, 0.0).worker_id == (
            d.worker_id
        )
        seen.add(d.worker_id)
    assert seen == {"w0", "w1"}  # the most loaded worker never wins a pair


def test_token_load_and_single_candidate() -> None:
    ws = workers(2)
    ws[0] = replace(ws[0], in_flight=1, pending_prefill_tokens=100)
    ws[1] = replace(ws[1], in_flight=0, pending_prefill_tokens=5_000)
    r = Router(create_policy("power_of_two", {"use_token_load": True}))
    assert r.route(request("q", tokens(1, 64)), ws, 0.0).worker_id == "w0"
    assert Router("power_of_two").route(request("q", tokens(1, 64)), ws, 0.0).worker_id == "w1"
    d = Router("power_of_two").route(request("q", tokens(1, 64)), ws[:1], 0.0)
    assert d.worker_id == "w0" and d.tier == "single"
