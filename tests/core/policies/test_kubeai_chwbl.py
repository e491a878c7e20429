from __future__ import annotations

from dataclasses import replace

from prefixrouter.core import Router, RoutingRequest
from prefixrouter.core.policies.kubeai_chwbl import key_bytes
from tests.core.conftest import request, tokens, workers

SYSTEM = tokens(1, 300)


def conversation(rid: str, first_user: int, turn: int, adapter: str = "") -> RoutingRequest:
    """A system prompt, the conversation's first user message, then later turns."""
    toks = SYSTEM + tokens(first_user, 40) + tokens(1_000 + turn, 200)
    return request(rid, toks, first_user_offset=len(SYSTEM), adapter=adapter)


def test_same_key_same_endpoint_until_the_bound_then_next_on_the_ring() -> None:
    r = Router("kubeai_chwbl")
    ws = workers(4)
    first = r.route(conversation("a", 7, 0), ws, 0.0)
    home = first.worker_id
    assert first.tier == "home"
    for turn in range(1, 5):  # later turns, other ids: the key is the first user message
        assert r.route(conversation(f"t{turn}", 7, turn), ws, 0.0).worker_id == home
    nxt = sorted(first.candidates, key=lambda c: c.score)[1].worker_id
    i = next(k for k, w in enumerate(ws) if w.worker_id == home)
    # bound = (total + 1) / n * 1.25: home with 1 of 1 in flight, 1 > 2 / 4 * 1.25
    ws[i] = replace(ws[i], in_flight=1)
    d = r.route(conversation("x", 7, 9), ws, 0.0)
    assert (d.worker_id, d.tier) == (nxt, "spill")
    # everyone busy: home is within the bound again, 1 <= 5 / 4 * 1.25
    ws = [replace(w, in_flight=1) for w in ws]
    assert r.route(conversation("y", 7, 9), ws, 0.0).worker_id == home


def test_key_is_adapter_plus_first_user_message() -> None:
    r = Router("kubeai_chwbl")
    ws = workers(8)
    hello = "hello " * 30
    homes = {
        r.route(request(f"r{k}", tokens(k, 100), first_user_text=hello), ws, 0.0).worker_id
        for k in range(5)
    }
    assert len(homes) == 1  # only the first 100 characters of the first user message count
    spread = {r.route(conversation(f"c{k}", 100 + k, 0), ws, 0.0).worker_id for k in range(40)}
    assert len(spread) >= 4  # different conversations spread over the ring
    plain, lora = conversation("p", 7, 0), conversation("l", 7, 0, adapter="lora-x")
    assert key_bytes(lora, 100) == b"lora-x" + key_bytes(plain, 100)
    assert len(key_bytes(plain, 100)) == 25 * 4  # 25 token ids ~ 100 characters
