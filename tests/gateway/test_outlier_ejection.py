"""Outlier ejection in the gateway: a worker answering 5xx leaves routing, then returns.

Fake engines in one event loop (tests/gateway/helpers.py); the live version,
a simulated engine with fault injection under load, is in tests/faults/.
"""

from __future__ import annotations

import time

from prefixrouter.core.types import WorkerId
from prefixrouter.harness.faults import until
from prefixrouter.prometheus import samples
from tests.gateway.helpers import Env, gateway_env, run

EJECT = {"outlier": {"consecutive_failures": 3, "base_ejection_s": 0.5, "max_ejection_s": 2.0}}


async def _worker(env: Env, wid: str) -> dict[str, object]:
    r = await env.admin("GET", "/admin/workers")
    data = await r.json()
    return next(w for w in data["workers"] if w["id"] == wid)


async def _metric(env: Env, name: str, wid: str) -> float:
    text = await (await env.client.get("/metrics")).text()
    return next(s.value for s in samples(text) if s.name == name and s.labels["worker"] == wid)


def test_a_worker_answering_500_is_ejected_then_returns_on_probation() -> None:
    async def body() -> None:
        async with gateway_env(2, EJECT) as env:
            bad = env.engines[0]
            bad.status = 500
            statuses: list[int] = []
            # Distinct prompts: the router spreads them; the failing worker
            # gets its 3 failures well within 40 requests.
            for i in range(40):
                statuses.append((await env.chat(f"question {i} " * 20)).status)
            assert statuses.count(500) == 3  # exactly the run that ejected it
            state = await _worker(env, "w0")
            assert state["ejected"] is True and state["ejections"] == 1
            assert await _metric(env, "prefixrouter_worker_ejected", "w0") == 1.0
            assert await _metric(env, "prefixrouter_worker_ejections_total", "w0") == 1.0
            sent = len(bad.requests)
            for i in range(10):
                assert (await env.chat(f"ejected {i}")).status == 200
            assert len(bad.requests) == sent  # none reached it while ejected
            cost = env.state.dispatch.router.cost
            # Its factor from before the ejection, above the other's (fake
            # engines answer too fast to calibrate: set by hand).
            cost._scale.update({WorkerId("w0"): 2.0, WorkerId("w1"): 0.9})

            # Still failing when it returns: one request, and out again (longer).
            async def tried_again() -> bool:
                await env.chat(f"probe {time.monotonic()}")
                return len(bad.requests) > sent

            await until(tried_again, "the ejected worker to be tried again", 10.0, 0.02)
            # Back on probation with its calibration from the fleet's best (a 500
            # has no first token to observe): the factor it had is as old as the
            # ejection, and probation needs requests to reach it.
            assert cost.scale(WorkerId("w0")) < cost.scale(WorkerId("w1"))
            state = await _worker(env, "w0")
            assert state["ejected"] is True and state["ejections"] == 2
            assert len(bad.requests) == sent + 1

            # Healed: it returns and keeps its traffic.
            bad.status = 200
            healed = len(bad.requests)

            async def serving() -> bool:
                await env.chat(f"healed {time.monotonic()}")
                return len(bad.requests) > healed

            await until(serving, "the healed worker to serve again", 10.0, 0.02)
            assert (await _worker(env, "w0"))["ejected"] is False
            for i in range(10):
                assert (await env.chat(f"after {i}")).status == 200
            assert (await _worker(env, "w0"))["ejected"] is False

    run(body, timeout=30)


def test_the_last_routable_worker_is_never_ejected() -> None:
    async def body() -> None:
        async with gateway_env(2, EJECT) as env:
            for e in env.engines:
                e.status = 500
            for i in range(20):
                assert (await env.chat(f"fleet-wide {i}")).status == 500
            ejected = [(await _worker(env, w))["ejected"] for w in ("w0", "w1")]
            assert ejected.count(True) == 1  # half the fleet at most: one still serves
            for e in env.engines:
                e.status = 200
            assert (await env.chat("recovered")).status == 200

    run(body)


def test_client_errors_do_not_count_as_failures() -> None:
    async def body() -> None:
        async with gateway_env(2, EJECT) as env:
            env.engines[0].status = 400
            env.engines[1].status = 400
            for i in range(12):
                assert (await env.chat(f"bad request {i}")).status == 400
            assert [(await _worker(env, w))["ejected"] for w in ("w0", "w1")] == [False, False]

    run(body)
