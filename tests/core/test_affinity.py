"""Session affinity's pure parts: the pin rules, the steered route call and the LRU table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import (
    Dispatcher,
    Outcome,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.affinity import Pin, SessionTable
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Steering
from tests.core.conftest import NS, request, tokens, workers

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
HISTORY = tokens(3, 16 * 40)  # a conversation's first turns: 40 blocks
TEXT = "Earlier turns of the conversation about the migration plan. " * 60


def token_turn(rid: str, extra: int = 0) -> RoutingRequest:
    return request(rid, [*HISTORY, *tokens(100 + extra, 16)])


def text_turn(rid: str, extra: int = 0) -> RoutingRequest:
    return RoutingRequest(RequestId(rid), NS, text=TEXT + f" Question {extra}?", max_tokens=16)


TURNS = {"token": token_turn, "text": text_turn}


def served(d: Dispatcher, req: RoutingRequest, to: WorkerId) -> None:
    """The request was routed to ``to`` and the engine confirmed its prompt."""
    views = [v for v in workers(3) if v.worker_id == to]
    adm = d.admit(req, views, 0.0)
    assert adm.worker == to
    d.complete(adm, Outcome(0, 0.01), 0.1)


@pytest.mark.parametrize("mode", sorted(TURNS))
def test_a_pin_holds_on_the_worker_that_holds_the_history(mode: str) -> None:
    turn = TURNS[mode]
    d = Dispatcher(Router("round_robin"), mode)  # type: ignore[arg-type]
    served(d, turn("t1"), W2)
    pin = Pin(W2, min_cached_tokens=100)
    adm = d.admit(turn("t2", 1), workers(3), 1.0, steering=Steering(pin=pin))
    dec = adm.decision
    assert (dec.worker_id, dec.tier, dec.affinity) == (W2, "affinity", "hit")
    assert dec.predicted_cached_tokens >= 100
    assert "session pinned to w2" in dec.reason
    assert dec.chosen is not None and dec.chosen.terms is not None  # calibration and timeouts


@pytest.mark.parametrize("mode", sorted(TURNS))
def test_a_pin_breaks_by_reason_and_the_policy_decides(mode: str) -> None:
    turn = TURNS[mode]
    d = Dispatcher(Router("round_robin"), mode)  # type: ignore[arg-type]
    served(d, turn("t1"), W2)
    ws = workers(3)

    def route(rid: str, pin: Pin, views: list[WorkerView] = ws) -> tuple[str, str, str]:
        dec = d.router.route(turn(rid, 2), views, 1.0, steering=Steering(pin=pin))
        return dec.affinity, dec.tier, dec.reason

    # The worker is down (health filter), or another filter removed it (pool).
    down = [replace(w, healthy=w.worker_id != W2) for w in ws]
    assert route("a", Pin(W2), down)[0] == "down"
    other_pool = [replace(w, pool="cold" if w.worker_id == W2 else "default") for w in ws]
    pooled = replace(turn("b", 2), pool="default")
    dec = d.router.route(pooled, other_pool, 1.0, steering=Steering(pin=Pin(W2)))
    assert dec.affinity == "filtered"
    assert route("c", Pin(WorkerId("gone")))[0] == "down"  # removed from the fleet
    # Not cached (any more): less than the share of the last turn, or distrusted.
    affinity, tier, reason = route("d", Pin(W2, min_cached_tokens=10**6))
    assert (affinity, tier) == ("evicted", "round_robin")
    assert reason.startswith("session pin broken (evicted): turn")
    assert route("e", Pin(W1))[0] == "evicted"  # w1 never held it
    assert route("f", Pin(W2, min_confidence=1.5))[0] == "evicted"
    # Overloaded: a predicted queue wait past the bound.
    busy = [replace(w, in_flight=3, pending_prefill_tokens=200_000) for w in ws]
    assert route("g", Pin(W2, max_wait_s=0.5), busy)[0] == "overloaded"
    assert route("h", Pin(W2, max_wait_s=60.0), busy)[0] == "hit"


def test_steering_to_an_added_policy_gets_its_feedback() -> None:
    d = Dispatcher(Router("prefix_aware"))
    rr = create_policy("round_robin")
    d.add_policy(rr)
    picks = []
    for i in range(4):
        adm = d.admit(
            request(f"r{i}", tokens(9, 64)), workers(3), float(i), steering=Steering(rr.name)
        )
        assert adm.decision.policy == "round_robin"
        picks.append(adm.worker)
        d.complete(adm, Outcome(0, 0.01), float(i) + 0.5)
    assert picks == [W0, W1, W2, W0]  # its cursor advanced: on_routed reached it
    # A retry stays in the policy's group.
    first = d.admit(request("x", tokens(9, 64)), workers(3), 9.0, steering=Steering(rr.name))
    d.reject(first, 9.1)
    again = d.retry(first, workers(3), 9.2)
    assert again.decision.policy == "round_robin" and again.worker != first.worker
    with pytest.raises(ValueError, match="was not added"):
        d.admit(request("y", tokens(9, 64)), workers(3), 10.0, steering=Steering("least_loaded"))


def test_the_session_table_is_bounded_least_recently_used_first() -> None:
    table = SessionTable(max_sessions=2, min_cached_share=0.5, max_wait_s=1.5)
    table.pin("a", W0, 1000)
    table.pin("b", W1, 10)
    assert table.pin_for("a") == Pin(W0, 500, 0.5, 1.5)  # "a" is now the most recent
    table.pin("c", W2, 1)
    assert len(table) == 2 and table.get("b") is None  # the least recent went
    assert table.pin_for("c") == Pin(W2, 1, 0.5, 1.5)  # at least one token
    table.pin("a", W2, 40)  # the pin moves
    assert table.pin_for("a") == Pin(W2, 20, 0.5, 1.5)
    assert table.pin_for("nobody") is None
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)
