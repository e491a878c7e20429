"""A gateway served as ``prefixrouter serve`` serves it (in the test's loop); raw-socket helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import uvloop
from aiohttp.test_utils import TestServer

from prefixrouter.gateway.app import create_app
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.server import start_server
from prefixrouter.gateway.state import STATE, GatewayState
from prefixrouter.harness.processes import Fleet, Server
from tests.gateway.fakes import FakeEngine, make_app

HOST = "127.0.0.1"
# Generous bounds on what must happen within a fraction of a second: a
# loaded machine may be slow, but never this slow.
BOUND_S = 8.0
# ``prefixrouter serve`` runs on uvloop, the other async tests on asyncio's
# loop: the server's own protocols are checked on both.
LOOPS = ("asyncio", "uvloop")


def run_on(loop: str, main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main()`` on a fresh event loop of kind ``loop`` (30 s bound, as conftest's)."""

    async def bounded() -> None:
        await asyncio.wait_for(main(), timeout=30)

    if loop == "uvloop":
        uvloop.run(bounded())
    else:
        asyncio.run(bounded())


ENGINE_ARGS: tuple[str, ...] = ("--profile", "tiny-cpu", "--time-scale", "20", "--model", "tiny")
ENGINE_ARGS += ("--kv-blocks", "8192")


def engines_behind_gateway(
    fleet: Fleet,
    config_path: Path,
    settings: dict[str, Any],
    engines: int = 2,
    env: dict[str, str] | None = None,
    engine_args: tuple[str, ...] = (),
) -> tuple[list[Server], Server]:
    """``engines`` simulated engines (``ENGINE_ARGS``) behind ``python -m prefixrouter.gateway``.

    The gateway's configuration is ``settings`` plus the engines as workers
    (ids ``e0``, ``e1``...), written to ``config_path``; ``env`` adds
    environment variables (secrets go there); ``engine_args`` go to every
    engine after ``ENGINE_ARGS``. Both are healthy on return.
    """
    args = ENGINE_ARGS + engine_args
    procs = [fleet.start(f"e{i}", "prefixrouter.simulated_engine", args) for i in range(engines)]
    asyncio.run(fleet.wait_healthy(procs, timeout_s=30.0))
    workers = [{"url": e.url, "id": e.name} for e in procs]
    config_path.write_bytes(orjson.dumps({"workers": workers, **settings}))  # JSON is YAML
    gw = fleet.start("gateway", "prefixrouter.gateway", ["--config", str(config_path)], env=env)
    asyncio.run(fleet.wait_healthy([gw], timeout_s=30.0))
    return procs, gw


@asynccontextmanager
async def gateway(
    limits: dict[str, Any], fake: FakeEngine | None = None
) -> AsyncIterator[tuple[int, GatewayState]]:
    """A gateway with ``limits`` in front of one fake engine (``fake``); yields (port, state)."""
    engine = TestServer(make_app(fake or FakeEngine()))
    await engine.start_server()
    config = config_from_dict(
        {
            "workers": [{"url": str(engine.make_url("")), "id": "w0"}],
            "limits": limits,
            "health": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "timeout_s": 1.0},
        }
    )
    app = create_app(config)
    listening = await start_server(app, HOST, 0, config.limits)
    try:
        yield listening.port, app[STATE]
    finally:
        await listening.runner.cleanup()
        await engine.close()


async def closed_after(reader: asyncio.StreamReader) -> tuple[float, bytes]:
    """Read until the server closes: (seconds it took, everything it sent)."""
    t0 = time.monotonic()
    data = b""
    async with asyncio.timeout(BOUND_S):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    return time.monotonic() - t0, data


def status_and_json(response: bytes) -> tuple[int, dict[str, Any], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body), head


async def get(port: int, path: str = "/health") -> bytes:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    try:
        async with asyncio.timeout(BOUND_S):
            return await reader.read()
    finally:
        writer.close()
