"""Helpers of the gateway's unit tests: fake engines and a gateway, all in one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.gateway.app import create_app
from prefixrouter.gateway.config import GatewayConfig, config_from_dict
from prefixrouter.gateway.state import STATE, GatewayState
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS
from tests.gateway.fakes import FakeEngine, make_app

T = TypeVar("T")


@dataclass
class Env:
    """A running gateway and its fake engines."""

    client: TestClient[web.Request, web.Application]
    engines: list[FakeEngine]
    servers: list[TestServer]
    config: GatewayConfig

    @property
    def state(self) -> GatewayState:
        return self.client.app[STATE]

    def worker_ids(self) -> list[str]:
        return [w.id for w in self.config.workers]

    async def chat(
        self, content: str, system: str = "You are helpful.", **kw: Any
    ) -> ClientResponse:
        body = {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": content},
            ],
            "max_tokens": 4,
        }
        headers = kw.pop("headers", None)
        body.update(kw)
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)

    async def admin(self, method: str, path: str, **kw: Any) -> ClientResponse:
        """An admin API call with the admin key."""
        return await self.client.request(method, path, headers=ADMIN_HEADERS, **kw)

    async def decisions(self, limit: int = 100) -> list[dict[str, Any]]:
        """The gateway's last ``limit`` decision records, newest first (asserts a 200)."""
        r = await self.admin("GET", "/admin/decisions", params={"limit": limit})
        assert r.status == 200, await r.text()
        return list((await r.json())["decisions"])


@asynccontextmanager
async def gateway_env(
    n: int = 3,
    overrides: dict[str, Any] | None = None,
    engines: list[FakeEngine] | None = None,
    worker_options: list[dict[str, Any]] | None = None,
    apps: list[web.Application] | None = None,
) -> AsyncIterator[Env]:
    """``n`` fake engines and a gateway in front of them (admin key: ``ADMIN_CONFIG``).

    ``worker_options``: more settings of each worker's entry, in order.
    ``apps``: engines' applications built by the caller instead (``Env.engines``
    is then empty).
    """
    if apps is None:
        engines = engines or [FakeEngine() for _ in range(n)]
        apps = [make_app(e) for e in engines]
    else:
        engines = []
    servers = [TestServer(app) for app in apps]
    for s in servers:
        await s.start_server()
    options = worker_options or [{}] * len(servers)
    data: dict[str, Any] = {
        "server": dict(ADMIN_CONFIG),
        "workers": [
            {"url": str(s.make_url("")), "id": f"w{i}", **options[i]} for i, s in enumerate(servers)
        ],
        "metrics_poll": {"interval_s": 0.2},
        "health": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "timeout_s": 1.0},
        "decision_log": {"flush_interval_s": 0.1},
    }
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    config = config_from_dict(data)
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    try:
        yield Env(client, engines, servers, config)
    finally:
        await client.close()
        for s in servers:
            await s.close()


def run(fn: Callable[[], Awaitable[T]], timeout: float = 20.0) -> T:
    """Run an async test body in a fresh event loop, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(fn(), timeout)

    return asyncio.run(bounded())
