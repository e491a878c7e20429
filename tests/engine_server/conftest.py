"""Shared helpers for the engine server tests.

``async def`` tests run on a fresh event loop each (a tiny runner below: the
project has no pytest-asyncio). Servers are real aiohttp servers on a free
loopback port (:func:`served`), stopped when the block ends. The tokenizer
cache is a session temp dir (``tests/conftest.py``), never ``~``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.engine_server import SERVER_KEY, EngineServer, EngineServerConfig, create_app


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**args), timeout=30))
    return True


@asynccontextmanager
async def served(**overrides: Any) -> AsyncIterator[tuple[TestClient[Any, Any], EngineServer]]:
    """A real server on a free 127.0.0.1 port; yields a client and the server state."""
    config = EngineServerConfig(**overrides)
    app = create_app(config)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client, app[SERVER_KEY]


def long_text(n_words: int, seed: int = 0) -> str:
    """Deterministic English-ish text of ``n_words`` words."""
    words = ("alpha", "river", "stone", "market", "window", "garden", "signal", "paper")
    return " ".join(f"{words[(i * 7 + seed) % 8]}{(i * 31 + seed) % 97}" for i in range(n_words))
