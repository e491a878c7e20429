"""Live clusters for the tests: a real nats-server, simulated engines, gateway replica processes.

Everything is a real process on loopback (``python -m prefixrouter.simulated_engine``
as ``prefixrouter engine`` runs it, ``python -m prefixrouter.gateway`` with
``--cluster``), started through the harness (:mod:`prefixrouter.harness.nats`,
:mod:`prefixrouter.harness.replicas`) and stopped by PID. Every wait is a
bounded poll of a condition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
from multidict import CIMultiDict

from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.prometheus import samples
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS

T = TypeVar("T")

BOUND_S = 20.0
"""Far above what any awaited condition takes on a loaded machine."""


def doc(seed: int, sections: int = 60) -> str:
    """A document of its own per seed (so tests sharing engines never share a prefix)."""
    return " ".join(
        f"Doc {seed} section {i}: the board reviewed motion {i * 7 + seed} and carried it."
        for i in range(sections)
    )


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You answer questions about the minutes."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 4,
        **extra,
    }


def start_engines(fleet: Fleet, n: int) -> list[Server]:
    engines = [
        fleet.start(
            f"e{i}",
            "prefixrouter.simulated_engine",
            [
                "--profile",
                "tiny-cpu",
                "--time-scale",
                "4",
                "--model",
                "tiny",
                "--kv-blocks",
                "4096",
            ],
        )
        for i in range(n)
    ]
    return engines


def write_config(path: Path, engines: list[Server], **over: Any) -> Path:
    """The replicas' shared YAML (JSON is YAML): fast heartbeats and health checks."""
    cfg: dict[str, Any] = {
        "workers": [{"url": e.url, "id": e.name} for e in engines],
        "server": dict(ADMIN_CONFIG),
        "tenants": {"acme": {"share_cache": False}, "globex": {"share_cache": False}},
        "api_keys": {"k-acme": "acme", "k-globex": "globex"},
        "metrics_poll": {"interval_s": 0.5},
        "health": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
        "cluster": {"heartbeat_s": 0.2, "peer_ttl_s": 1.0},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path.write_bytes(orjson.dumps(cfg))
    return path


async def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status, r.headers.copy(), await r.json()


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def get_status(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


async def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of ``name``'s samples on ``url``'s ``/metrics`` (matching ``labels``)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    want = labels or {}
    return sum(
        x.value
        for x in samples(text)
        if x.name == name and all(x.labels.get(k) == v for k, v in want.items())
    )


async def decision(url: str, request_id: str) -> dict[str, Any]:
    """The decision record of ``request_id`` (polled until its outcome is in)."""

    async def find() -> dict[str, Any] | None:
        async with (
            aiohttp.ClientSession(headers=ADMIN_HEADERS) as s,
            s.get(url + "/admin/decisions?limit=1000") as r,
        ):
            data = await r.json()
        for d in data["decisions"]:
            if d["request_id"] == request_id and d.get("actual_cached_tokens") is not None:
                return dict(d)
        return None

    return await until(find, f"decision {request_id} on {url}")


async def until(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    """Poll ``probe`` until it returns something truthy (bounded by :data:`BOUND_S`)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def synced(src: str, dst: str) -> None:
    """Until ``dst`` has taken in every fact ``src`` published (applied, or unmatched:
    the settlement of a routing whose peer life ``dst`` had already ended)."""

    async def probe() -> bool:
        pub = await metric(src, "prefixrouter_cluster_facts_published_total")
        app = await metric(dst, "prefixrouter_cluster_facts_applied_total")
        unmatched = await metric(
            dst, "prefixrouter_cluster_facts_dropped_total", {"reason": "unmatched"}
        )
        return pub > 0 and app + unmatched >= pub

    await until(probe, f"{dst} to apply what {src} published")
