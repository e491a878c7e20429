"""With replicas, each one's dashboard names the replica that decided, its peers and the lag.

Real processes on loopback (the cluster tests' helpers): a ``nats-server -js``,
two simulated engines and two gateway replicas ``a`` and ``b``. A document
goes through ``a`` and then through ``b``; each replica's snapshot lists its
own decision with its own id, names the other as its peer, and ``b``'s shows
the propagation lag of the facts ``a`` sent it.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.nats import NatsServer
from prefixrouter.harness.processes import Fleet
from prefixrouter.harness.replicas import start_replica, wait_ready_async
from tests.admin_client import ADMIN_HEADERS
from tests.cluster.live import chat, doc, post, start_engines, synced, until, write_config


async def _snapshot(url: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(headers=ADMIN_HEADERS) as s,
        s.get(url + "/dashboard/snapshot") as r,
    ):
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


async def _listed(url: str, request_id: str) -> dict[str, Any] | None:
    """The snapshot, once it lists ``request_id`` among its recent decisions."""
    snap = await _snapshot(url)
    listed = [d for d in snap["recent"] if d["request_id"] == request_id]
    return {**snap, "decision": listed[0]} if listed else None


@pytest.mark.timeout(90)
def test_each_replica_names_itself_on_its_decisions_its_peers_and_the_lag(
    tmp_path: Path,
) -> None:
    with NatsServer() as nats, Fleet() as fleet:
        engines = start_engines(fleet, 2)
        wait_healthy(engines, 30.0)
        cfg = write_config(tmp_path / "gw.yaml", engines)

        async def body() -> None:
            a, b = (start_replica(fleet, cfg, nats.url, rid) for rid in ("a", "b"))
            await wait_ready_async([a, b], 30.0)
            for r in (a, b):
                await _snapshot(r.url)  # watched from here on
            text = doc(1)
            st, ha, _ = await post(a.url, chat(text + " Q1?"))
            assert st == 200
            await synced(a.url, b.url)
            st, hb, _ = await post(b.url, chat(text + " Q2?"))
            assert st == 200
            for server, headers, peer in ((a, ha, "b"), (b, hb, "a")):
                rid = headers["X-Request-Id"]
                snap = await until(functools.partial(_listed, server.url, rid), f"{rid} listed")
                assert snap["decision"]["replica"] == server.name
                assert snap["gateway"]["replica"] == server.name
                cluster = snap["cluster"]
                assert cluster["replica"] == server.name and cluster["connected"]
                assert [p["replica"] for p in cluster["peers"]] == [peer]
            lagged = await until(lambda: _lag(b.url), "b's dashboard to show the lag of a's facts")
            assert lagged["samples"] > 0 and lagged["p99"] is not None and lagged["p99"] >= 0

        asyncio.run(asyncio.wait_for(body(), 80))


async def _lag(url: str) -> dict[str, Any] | None:
    lag: dict[str, Any] = (await _snapshot(url))["cluster"]["lag_ms"]
    return lag if lag["samples"] else None
