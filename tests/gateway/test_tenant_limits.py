"""Per-tenant limits and priority: the pure rules, the live controls, a gateway's answers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixrouter.core.bucket import TokenBucket
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.controls import TENANT_LABELS_MAX, TenantControls, request_priority
from prefixrouter.gateway.errors import BadRequest, Overloaded
from prefixrouter.gateway.limits import (
    TenantLimit,
    TenantLimiter,
    WaitQueue,
    retry_after,
)
from prefixrouter.prometheus import samples
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run

# ---------------------------------------------------------------- pure rules


def test_bucket_allows_its_burst_then_says_when_the_next_token_comes() -> None:
    b = TokenBucket(rate=2.0, capacity=3)
    assert [b.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(10.0) == pytest.approx(0.5)  # one token per 0.5 s
    assert b.take(10.25) == pytest.approx(0.25)  # half a token came; a refusal takes nothing
    assert b.take(10.5) == 0.0
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(2.0)  # capped at the burst


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert [retry_after(w) for w in (0.01, 0.5, 1.0, 1.2, 3.0)] == [1, 1, 1, 2, 3]


def test_in_flight_cap_refuses_without_taking_a_token() -> None:
    lim = TenantLimiter(
        {"a": TenantLimit(max_in_flight=2, requests_per_s=1.0, burst=3)},
        TenantLimit(),
        busy_retry_after_s=1,
    )
    assert lim.acquire("a", 0.0) is None and lim.acquire("a", 0.0) is None
    refused = lim.acquire("a", 0.0)
    assert refused is not None and refused.reason == "max_in_flight"
    lim.release("a")
    assert lim.acquire("a", 0.0) is None  # the third token was still there
    lim.release("a")
    rate = lim.acquire("a", 0.0)
    assert rate is not None and rate.reason == "rate" and rate.retry_after_s == 1
    assert lim.in_flight() == {"a": 1}
    assert lim.acquire("other", 0.0) is None  # no rule, no default limit


def test_default_rule_limits_each_tenant_apart() -> None:
    lim = TenantLimiter({}, TenantLimit(max_in_flight=1), busy_retry_after_s=2)
    assert lim.acquire("x", 0.0) is None and lim.acquire("y", 0.0) is None
    refused = lim.acquire("x", 0.0)
    assert refused is not None and refused.retry_after_s == 2 and "'x'" in refused.message


def test_queue_orders_by_virtual_arrival_first_come_on_ties() -> None:
    q: WaitQueue[str] = WaitQueue(aging_s=1.0, max_len=10)
    q.push("low-0", 0, 0.0)
    q.push("high-0.5", 1, 0.5)  # key -0.5: before low-0
    q.push("low-0.2", 0, 0.2)
    q.push("high-1.5", 1, 1.5)  # key 0.5: after both lows
    q.push("low-0.5", 0, 0.5)  # key 0.5, after high-1.5 in arrival order of pushes
    assert q.items() == ["high-0.5", "low-0", "low-0.2", "high-1.5", "low-0.5"]


def test_starvation_bound_low_priority_beats_later_high_priority_arrivals() -> None:
    """A priority-0 request at t=0 goes before every priority-3 request after t=3 s."""
    q: WaitQueue[str] = WaitQueue(aging_s=1.0, max_len=10_000)
    q.push("low", 0, 0.0)
    for i in range(1000):  # a flood of high priority, one every 10 ms
        q.push(f"high-{i}", 3, i * 0.01)
    order = q.items()
    before_low = order[: order.index("low")]
    assert before_low and all(int(h.split("-")[1]) * 0.01 <= 3.0 for h in before_low)
    assert len(before_low) == 300  # arrivals at 0.00 .. 2.99 s (3.00 ties: first come)


def test_full_queue_sheds_the_newest_of_the_lowest_priority() -> None:
    q: WaitQueue[str] = WaitQueue(aging_s=1.0, max_len=2)
    assert q.push("a", 0, 0.0) is None
    assert q.push("b", 0, 0.1) is None
    assert q.push("c", 0, 0.2) == "c"  # it would be last: refused itself
    assert q.push("vip", 5, 0.3) == "b"  # makes room by shedding the last in order
    assert q.items() == ["vip", "a"]
    assert q.remove("a") and not q.remove("a")
    assert q.pop() == "vip" and q.pop() is None


def test_priority_header_lowers_never_raises() -> None:
    assert request_priority(5, None) == 5
    assert request_priority(5, "-3") == -3
    assert request_priority(5, " 99 ") == 5  # capped at the tenant's
    for bad in ("high", "1.5", "101", "", "١"):
        with pytest.raises(BadRequest) as err:
            request_priority(0, bad)
        assert err.value.param == "X-Priority"


# ---------------------------------------------------------------- live controls (fake clock)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _controls(overload: dict[str, Any], **tenants: Any) -> tuple[TenantControls, Clock]:
    cfg = config_from_dict({"overload": overload, "tenants": tenants})
    clock = Clock()
    return TenantControls(cfg, lambda: 0, clock), clock


def test_overload_admits_by_priority_as_slots_free() -> None:
    async def main() -> None:
        ctl, clock = _controls({"max_in_flight": 1}, gold={"priority": 2})
        first = await ctl.admit("bronze", None)
        admitted: list[str] = []

        async def wait(tenant: str, header: str | None = None) -> None:
            ticket = await ctl.admit(tenant, header)
            admitted.append(tenant)
            await asyncio.sleep(0)
            ctl.release(ticket)

        low = asyncio.create_task(wait("bronze"))
        await asyncio.sleep(0)
        clock.now = 0.5
        high = asyncio.create_task(wait("gold"))
        demoted = asyncio.create_task(wait("gold-demoted"))  # no rule: priority 0, later
        await asyncio.sleep(0)
        assert len(ctl.queue) == 3 and admitted == []
        ctl.release(first)
        await asyncio.gather(low, high, demoted)
        assert admitted == ["gold", "bronze", "gold-demoted"]
        assert ctl.in_flight == 0 and ctl.limiter.in_flight() == {
            "bronze": 0,
            "gold": 0,
            "gold-demoted": 0,
        }

    run(main)


def test_overload_sheds_when_the_queue_is_full_and_after_max_wait() -> None:
    async def main() -> None:
        ctl, _ = _controls({"max_in_flight": 1, "max_queue": 1, "max_wait_s": 0.05})
        held = await ctl.admit("a", None)
        waiting = asyncio.create_task(ctl.admit("a", "0"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            await ctl.admit("b", "-1")  # lower than the waiter: shed itself
        assert full.value.code == "overloaded" and full.value.headers["Retry-After"] == "1"
        with pytest.raises(Overloaded, match="waited"):
            await waiting  # nobody released within max_wait_s
        rejected = ctl.metrics.rejected.values
        assert rejected == {("b", "queue_full"): 1.0, ("a", "queue_timeout"): 1.0}
        assert ctl.limiter.in_flight() == {"a": 1, "b": 0}
        ctl.release(held)
        assert ctl.in_flight == 0

    run(main)


def test_a_client_that_leaves_the_queue_frees_its_place() -> None:
    async def main() -> None:
        ctl, _ = _controls({"max_in_flight": 1})
        held = await ctl.admit("a", None)
        gone = asyncio.create_task(ctl.admit("a", None))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(ctl.queue) == 0 and ctl.limiter.in_flight() == {"a": 1}
        ctl.release(held)
        nxt = await ctl.admit("a", None)  # the slot was not leaked
        assert nxt.slot and ctl.in_flight == 1

    run(main)


def test_no_capacity_setting_or_no_routable_worker_means_no_queue() -> None:
    async def main() -> None:
        for overload in ({}, {"max_in_flight": "slots"}):  # slots: 0 routable here
            ctl, _ = _controls(overload)
            tickets = [await ctl.admit("a", None) for _ in range(50)]
            assert not any(t.slot for t in tickets) and ctl.capacity() is None

    run(main)


def test_tenant_labels_are_bounded() -> None:
    ctl, _ = _controls({})
    labels = {ctl.metrics.label(f"t{i}") for i in range(TENANT_LABELS_MAX + 10)}
    assert len(labels) == TENANT_LABELS_MAX + 1 and "_other" in labels


# ---------------------------------------------------------------- a gateway's answers


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """Samples of ``name`` summed per value of ``label``."""
    out: dict[str, float] = {}
    for s in samples(text):
        if s.name == name:
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def test_gateway_answers_429_with_retry_after_and_counts_per_tenant() -> None:
    overrides = {
        "api_keys": {"key-a": "a", "key-b": "b"},
        "tenants": {"a": {"requests_per_s": 0.5, "burst": 2}},
    }

    async def main() -> None:
        async with gateway_env(1, overrides) as env:
            a = {"Authorization": "Bearer key-a"}
            b = {"Authorization": "Bearer key-b"}
            statuses = []
            for _ in range(3):
                resp = await env.chat("hello", headers=a)
                statuses.append(resp.status)
            assert statuses == [200, 200, 429]
            body = await resp.json()
            assert resp.headers["Retry-After"] == "2"  # a token every 2 s
            assert resp.headers["X-Request-Id"]
            assert body["error"]["type"] == "rate_limit_error"
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert "key-a" not in await resp.text()
            # Refused from the headers alone: the body is never parsed.
            unread = await env.client.post("/v1/chat/completions", data=b"{", headers=a)
            assert unread.status == 429
            assert (await env.chat("hello", headers=b)).status == 200  # b has no limit
            bad = await env.chat("hello", headers={**b, "X-Priority": "urgent"})
            assert bad.status == 400 and (await bad.json())["error"]["param"] == "X-Priority"
            text = await (await env.client.get("/metrics")).text()
            reqs = by_label(text, "prefixrouter_tenant_requests_total", "tenant")
            rejected = by_label(text, "prefixrouter_tenant_rejected_total", "reason")
            assert reqs == {"a": 4.0, "b": 2.0}  # b's 400 (its header) is b's too
            assert rejected == {"rate": 2.0}
            assert "key-a" not in text and "key-b" not in text

    run(main)


def test_gateway_under_overload_serves_the_higher_priority_first() -> None:
    """One slot, held by a slow request: of two waiting, the higher priority goes first."""
    overrides = {
        "api_keys": {"key-low": "low", "key-high": "high"},
        "tenants": {"high": {"priority": 5}},
        "overload": {"max_in_flight": 1},
    }

    async def main() -> None:
        engine = FakeEngine(delay_s=0.3)
        async with gateway_env(1, overrides, engines=[engine]) as env:
            low = {"Authorization": "Bearer key-low"}
            high = {"Authorization": "Bearer key-high"}
            done: list[str] = []

            async def ask(name: str, headers: dict[str, str]) -> None:
                r = await env.chat(name, headers=headers)
                assert r.status == 200, await r.text()
                done.append(name)

            first = asyncio.create_task(ask("first", low))
            await _until(lambda: env.state.controls.in_flight == 1)
            waiting_low = asyncio.create_task(ask("low", low))
            await _until(lambda: len(env.state.controls.queue) == 1)
            waiting_high = asyncio.create_task(ask("high", high))
            await _until(lambda: len(env.state.controls.queue) == 2)
            await asyncio.gather(first, waiting_low, waiting_high)
            assert done == ["first", "high", "low"]
            text = await (await env.client.get("/metrics")).text()
            waits = by_label(text, "prefixrouter_tenant_queue_wait_seconds_count", "tenant")
            assert waits == {"low": 1.0, "high": 1.0}

    run(main)


def test_a_request_shed_after_waiting_is_logged_with_its_wait(tmp_path: Path) -> None:
    """A 503 after ``max_wait_s``: the access log gives its wait, as /metrics does."""
    log = tmp_path / "access.jsonl"
    overrides = {
        "overload": {"max_in_flight": 1, "max_wait_s": 0.3},
        "access_log": {"path": str(log), "flush_interval_s": 0.05},
    }

    async def main() -> list[dict[str, Any]]:
        engine = FakeEngine(delay_s=1.0)
        async with gateway_env(1, overrides, engines=[engine]) as env:
            slow = asyncio.create_task(env.chat("slow"))
            await _until(lambda: env.state.controls.in_flight == 1)
            shed = await env.chat("shed")
            assert shed.status == 503, await shed.text()
            shed_id = shed.headers["X-Request-Id"]
            assert (await slow).status == 200
        lines = map(orjson.loads, log.read_bytes().splitlines())
        return [x for x in lines if x["request_id"] == shed_id]

    (line,) = run(main)
    assert line["status"] == 503 and line["error"] == "overloaded"
    assert 250 <= line["queue_wait_ms"] <= 2000, line


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    """Poll ``cond`` until true (bounded)."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)
