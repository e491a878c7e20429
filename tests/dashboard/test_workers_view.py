"""The dashboard's workers agree with ``/metrics``: state, health and what is known of their KV.

Fake engines and a gateway in one event loop (``tests/gateway/helpers.py``),
read over HTTP on loopback: ``/dashboard/snapshot``, ``/metrics`` and
``prefixrouter top``'s view of the same stream (:func:`run_top`).
"""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console

from prefixrouter.core.types import WorkerId
from prefixrouter.gateway.dashboard.top import run_top
from prefixrouter.harness.faults import until
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.prometheus import samples
from tests.admin_client import ADMIN_HEADERS, ADMIN_KEY
from tests.gateway.helpers import Env, gateway_env, run

# Ejected after 3 failures in a row, for far longer than the test runs.
EJECT = {"outlier": {"consecutive_failures": 3, "base_ejection_s": 60.0, "max_ejection_s": 120.0}}


async def _snapshot(env: Env) -> dict[str, Any]:
    r = await env.client.get("/dashboard/snapshot", headers=ADMIN_HEADERS)
    assert r.status == 200, await r.text()
    data: dict[str, Any] = await r.json()
    return data


async def _healthy_gauge(env: Env) -> dict[str, bool]:
    text = await (await env.client.get("/metrics")).text()
    return {
        s.labels["worker"]: s.value == 1.0
        for s in samples(text)
        if s.name == "prefixrouter_worker_healthy"
    }


async def _top_once(env: Env) -> str:
    """One snapshot of ``prefixrouter top``'s live view (not a terminal: printed once)."""
    out = io.StringIO()
    url = str(env.client.make_url("")).rstrip("/")
    assert await run_top(url, ADMIN_KEY, 1, Console(file=out, width=300)) == 1
    return out.getvalue()


def test_an_ejected_or_unready_worker_is_out_of_routing_as_metrics_say() -> None:
    async def body() -> None:
        async with gateway_env(3, EJECT) as env:
            env.engines[0].status = 500  # passes /health, fails every answer

            async def ejected() -> bool:
                await env.chat(f"question {free_port()} " * 20)  # distinct: spread out
                r = await env.admin("GET", "/admin/workers")
                workers = (await r.json())["workers"]
                return next(w["ejected"] is True for w in workers if w["id"] == "w0")

            await until(ejected, "w0 to be ejected", 15.0, 0.0)
            env.state.registry.set_ready(WorkerId("w1"), False)  # as Kubernetes readiness does

            snap = await _snapshot(env)
            states = {w["id"]: (w["state"], w["healthy"]) for w in snap["workers"]}
            assert states == {
                "w0": ("ejected", False),
                "w1": ("not ready", False),
                "w2": ("healthy", True),
            }
            # The same answer as prefixrouter_worker_healthy, worker by worker.
            assert {wid: healthy for wid, (_, healthy) in states.items()} == await _healthy_gauge(
                env
            )
            view = await _top_once(env)
            assert re.search(r"\bw0\b[\s│]+ejected", view), view
            assert re.search(r"\bw1\b[\s│]+not ready", view), view
            assert re.search(r"\bw2\b[\s│]+healthy", view), view

    run(body, timeout=40)


def test_a_worker_whose_engine_was_never_reached_has_an_unknown_kv_size() -> None:
    nobody = [f"http://{HOST}:{free_port()}" for _ in range(2)]  # nothing listens there
    options: list[dict[str, Any]] = [
        {},
        {"url": nobody[0]},
        {"url": nobody[1], "kv_capacity_blocks": 500},
    ]

    async def body() -> None:
        async with gateway_env(3, worker_options=options) as env:

            async def polled() -> dict[str, Any] | None:
                snap = await _snapshot(env)
                rows = {w["id"]: w for w in snap["workers"]}
                return rows if rows["w0"]["index_capacity"] is not None else None

            rows = await until(polled, "w0's first metrics poll", 10.0)
            # Polled: the engine's KV size (cache_config_info) mirrored in the index.
            assert rows["w0"]["index_capacity"] > 0
            # Never reached: the index's default capacity is no fact about the engine.
            assert rows["w1"]["index_capacity"] is None
            assert rows["w1"]["index_blocks"] == 0
            # Never reached either, but its KV size is configured: known.
            assert rows["w2"]["index_capacity"] is not None
            view = await _top_once(env)
            assert re.search(r"\bw1\b.*\b0 / \?", view), view

    run(body, timeout=30)
