"""KV events end to end: engine processes publish vLLM-style events, the gateway's index follows.

Real processes on loopback: two ``prefixrouter engine`` servers publishing KV
events (ZMQ, vLLM's framing and map encoding) to the gateway's bound SUB
socket, and the gateway in token mode; then two engines that bind their
publishers and two gateway replicas whose SUB sockets connect to both. The
same checks run against real vLLM engines in ``tests/real_vllm``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from tests.admin_client import ADMIN_CONFIG, decisions, workers

KV_BLOCKS = 200  # 16-token blocks: room for about two of the documents below
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def document(seed: int, words: int = 350) -> str:
    return " ".join(
        WORDS[(i * 7 + seed * 13 + i // 5) % len(WORDS)] + str(seed) for i in range(words)
    )


@dataclass
class Cluster:
    fleet: Fleet
    gateway: Server
    engines: list[Server]
    log: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("events")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = tmp / "decisions.jsonl"
    with Fleet() as fleet:
        engines = [
            fleet.start(
                f"engine{i}",
                "prefixrouter.simulated_engine",
                [
                    "--profile", "tiny-cpu", "--time-scale", "50", "--kv-blocks", str(KV_BLOCKS),
                    "--block-size", "16", "--engine-id", str(i), "--kv-events-endpoint", endpoint,
                ],
            )
            for i in range(2)
        ]  # fmt: skip
        config = {
            "workers": [
                {"url": e.url, "id": f"e{i}", "kv_events_topic": f"kv@{i}"}
                for i, e in enumerate(engines)
            ],
            "routing": {"mode": "token"},
            "kv_events": {"endpoint": endpoint},
            "decision_log": {"path": str(log), "flush_interval_s": 0.05},
            "metrics_poll": {"interval_s": 0.2},
            # Tenants never share cache: vLLM-style workers get a cache_salt per tenant.
            "default_tenant": {"share_cache": False},
            "api_keys": {"k-acme": "acme", "k-globex": "globex"},
            "server": dict(ADMIN_CONFIG),
        }
        path = tmp / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        asyncio.run(fleet.wait_healthy(engines))
        gateway = fleet.start("gateway", "prefixrouter.gateway", ["--config", str(path)])
        asyncio.run(fleet.wait_healthy([gateway]))
        # The engines' PUB sockets connected before the gateway bound its SUB
        # socket; ZMQ reconnects every 100 ms, and what is published before
        # that is lost (as with vLLM). Let them reconnect.
        time.sleep(0.5)
        yield Cluster(fleet, gateway, engines, log)


def chat(doc: str, question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Answer from the document.\n" + doc},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        **extra,
    }


async def ask(c: Cluster, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    url = c.gateway.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["X-Request-Id"]


async def wait_feeds(c: Cluster, cond: Any) -> dict[str, dict[str, Any]]:
    """Poll the feeds' stats until ``cond(stats)`` holds (events travel asynchronously)."""
    for _ in range(100):
        stats = await feeds(c)
        if cond(stats):
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"feed stats never satisfied the condition: {stats}")


async def feeds(c: Cluster) -> dict[str, dict[str, Any]]:
    return {wid: w["kv_events"] for wid, w in (await workers(c.gateway.url)).items()}


def test_events_make_predictions_exact_and_follow_evictions(cluster: Cluster) -> None:
    async def body() -> None:
        doc = document(1)
        first = await ask(cluster, chat(doc, "What is alpha?"))
        stats = await wait_feeds(cluster, lambda st: sum(f["stored_events"] for f in st.values()))
        assert all(f["gaps"] == 0 and f["decode_errors"] == 0 for f in stats.values())
        again = [await ask(cluster, chat(doc, f"Question {i}?")) for i in range(3)]
        recs = await decisions(cluster.gateway.url, [first, *again])
        assert recs[0]["actual_cached_tokens"] == 0
        for r in recs[1:]:
            assert r["selected_worker"] == recs[0]["selected_worker"]
            assert r["actual_cached_tokens"] > 500
            assert r["predicted_cached_tokens"] == r["actual_cached_tokens"]

        # Push the document out of its engine's small cache with other documents
        # sent straight to that engine (so only the events can tell the gateway).
        worker = recs[0]["selected_worker"]
        engine = cluster.engines[int(worker[1:])]
        async with aiohttp.ClientSession() as s:
            for seed in range(2, 6):
                async with s.post(
                    engine.url + "/v1/chat/completions", json=chat(document(seed), "x")
                ) as resp:
                    assert resp.status == 200
        await wait_feeds(cluster, lambda st: st[worker]["removed_events"] >= 1)
        after = await ask(cluster, chat(doc, "And now?"))
        (rec,) = await decisions(cluster.gateway.url, [after])
        assert rec["predicted_cached_tokens"] == rec["actual_cached_tokens"]

    asyncio.run(asyncio.wait_for(body(), 60))


def test_salted_tenants_events_land_in_their_own_namespace(cluster: Cluster) -> None:
    async def body() -> None:
        doc = document(42)
        a = {"Authorization": "Bearer k-acme"}
        ids = [await ask(cluster, chat(doc, f"A{i}?"), a) for i in range(2)]
        other = await ask(cluster, chat(doc, "B?"), {"Authorization": "Bearer k-globex"})
        _first, second, b = await decisions(cluster.gateway.url, [*ids, other])
        # The salt in the events maps back to acme's namespace: exact prediction.
        assert second["actual_cached_tokens"] > 0
        assert second["predicted_cached_tokens"] == second["actual_cached_tokens"]
        # globex shares nothing with acme, in the engine and in the router.
        assert b["actual_cached_tokens"] == 0 and b["predicted_cached_tokens"] == 0
        # Every salted chain was placed in a known namespace.
        stats = await feeds(cluster)
        assert sum(f["untranslated_blocks"] for f in stats.values()) == 0
        assert sum(f["stored_events"] for f in stats.values()) > 0

    asyncio.run(asyncio.wait_for(body(), 60))


# ------------------------------------------------------------------ several gateway replicas


@dataclass
class Replicas:
    """Two engines that bind their KV-event publishers and two gateways connected to both."""

    fleet: Fleet
    gateways: list[Server]
    engines: list[Server]
    engine_args: list[list[str]]


def engine_args(i: int, pub_port: int) -> list[str]:
    # "tcp://*:P": the engine binds, as vLLM does for an endpoint with "*".
    return [
        "--profile", "tiny-cpu", "--time-scale", "50", "--kv-blocks", str(KV_BLOCKS),
        "--block-size", "16", "--engine-id", str(i), "--kv-events-endpoint", f"tcp://*:{pub_port}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("replicas")
    ports = [free_port() for _ in range(2)]
    args = [engine_args(i, p) for i, p in enumerate(ports)]
    with Fleet() as fleet:
        engines = [
            fleet.start(f"engine{i}", "prefixrouter.simulated_engine", a)
            for i, a in enumerate(args)
        ]
        config = {
            "workers": [
                {
                    "url": e.url,
                    "id": f"e{i}",
                    "kv_events_topic": f"kv@{i}",
                    "kv_events_connect": f"tcp://127.0.0.1:{ports[i]}",
                }
                for i, e in enumerate(engines)
            ],
            "routing": {"mode": "token"},
            "metrics_poll": {"interval_s": 0.2},
            "health": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "timeout_s": 1.0},
            "decision_log": {"flush_interval_s": 0.05},
            "server": dict(ADMIN_CONFIG),
        }
        path = tmp / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))  # one file: every replica has the same config
        asyncio.run(fleet.wait_healthy(engines))
        gateways = [
            fleet.start(f"gateway{g}", "prefixrouter.gateway", ["--config", str(path)])
            for g in range(2)
        ]
        asyncio.run(fleet.wait_healthy(gateways))
        yield Replicas(fleet, gateways, engines, args)


async def gateway_feeds(url: str) -> dict[str, dict[str, Any]]:
    return {wid: w["kv_events"] for wid, w in (await workers(url)).items()}


async def until_every_gateway_hears(r: Replicas, engine: int) -> None:
    """Send small requests straight to an engine until every gateway heard its events.

    A bound PUB socket drops what it publishes before a subscriber's
    connection is up (at the gateway's start, or while it reconnects to a
    restarted engine), so what is sent before that is lost; bounded retries.
    """
    worker = f"e{engine}"
    before = [(await gateway_feeds(g.url))[worker]["messages"] for g in r.gateways]
    async with aiohttp.ClientSession() as s:
        for attempt in range(100):
            body = chat(document(1000 + attempt, words=40), "warm-up")
            async with s.post(r.engines[engine].url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.05)
            now = [(await gateway_feeds(g.url))[worker]["messages"] for g in r.gateways]
            if all(n > b for n, b in zip(now, before, strict=True)):
                return
    raise AssertionError(f"the gateways never heard engine {engine}")


async def until_every_gateway_sees_restarted(r: Replicas, worker: str) -> None:
    """Poll every gateway until it counted ``worker``'s restart and sees it healthy (bounded)."""
    for _ in range(200):
        views = [(await workers(g.url))[worker] for g in r.gateways]
        if all(w["healthy"] and w["kv_events"]["restarts"] + w["restarts"] >= 1 for w in views):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"a gateway never saw {worker} restarted and healthy: {views}")


async def ask_at(url: str, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["X-Request-Id"]


async def until_stored(url: str, worker: str, before: int) -> None:
    """Poll a gateway until its feed of ``worker`` applied more ``BlockStored`` than ``before``."""
    for _ in range(100):
        if (await gateway_feeds(url))[worker]["stored_events"] > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never heard {worker} store blocks")


async def warm_on_both(r: Replicas, doc: str) -> str:
    """Ask through gateway A; then B, which never saw that request, predicts it warm, exactly.

    There is no replica-to-replica sync here: B learns of A's request only
    from the engine's events, which both gateways' sockets hear.
    """
    a, b = (g.url for g in r.gateways)
    before = [await gateway_feeds(url) for url in (a, b)]
    first = await ask_at(a, chat(doc, "First?"))
    (rec_a,) = await decisions(a, [first])
    worker: str = rec_a["selected_worker"]
    for url, feeds in zip((a, b), before, strict=True):
        await until_stored(url, worker, feeds[worker]["stored_events"])
    second = await ask_at(b, chat(doc, "Second?"))
    (rec_b,) = await decisions(b, [second])
    assert rec_b["selected_worker"] == worker, json.dumps(rec_b)  # with why, if not
    assert rec_b["actual_cached_tokens"] > 500
    assert rec_b["predicted_cached_tokens"] == rec_b["actual_cached_tokens"]
    return worker


def test_every_replica_hears_every_engine_and_reconnects_after_a_restart(
    replicas: Replicas,
) -> None:
    async def body() -> None:
        for i in range(2):
            await until_every_gateway_hears(replicas, i)
        worker = await warm_on_both(replicas, document(7))
        for g in replicas.gateways:
            feeds = await gateway_feeds(g.url)
            assert feeds[worker]["connect"] is not None
            assert all(f["gaps"] == 0 and f["decode_errors"] == 0 for f in feeds.values())

        # The engine restarts on the same ports; both gateways' sockets reconnect.
        index = int(worker[1:])
        old = replicas.engines[index]
        replicas.fleet.stop(old)
        new = replicas.fleet.start(
            f"engine{index}-again", "prefixrouter.simulated_engine", replicas.engine_args[index],
            port=old.port,
        )  # fmt: skip
        replicas.engines[index] = new
        await replicas.fleet.wait_healthy([new])
        await until_every_gateway_hears(replicas, index)
        # The sequence reset, or (when the new engine's first events were
        # published before the socket reconnected, and the first one heard is
        # a gap) the next health check's process_start_time, tells each
        # gateway; one whose health check saw the engine down while it
        # restarted routes around it until it sees it back up.
        await until_every_gateway_sees_restarted(replicas, worker)
        # What the restarted engine caches now reaches both replicas again.
        for seed in range(8, 28):  # until a new document goes to the restarted engine
            if await warm_on_both(replicas, document(seed)) == worker:
                break
        else:
            raise AssertionError(f"no document went to {worker}")

    asyncio.run(asyncio.wait_for(body(), 90))
