"""Shared helpers for the engine server tests.

``async def`` tests run on a fresh event loop each (the runner is in
``tests/conftest.py``). Servers are real aiohttp servers on a free
loopback port (:func:`served`), stopped when the block ends. The tokenizer
cache is a session temp dir (``tests/conftest.py``), never ``~``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.simulated_engine import SERVER_KEY, EngineServer, EngineServerConfig, create_app


@asynccontextmanager
async def served(**overrides: Any) -> AsyncIterator[tuple[TestClient[Any, Any], EngineServer]]:
    """A real server on a free 127.0.0.1 port; yields a client and the server state."""
    overrides.setdefault("profile", "tiny-cpu")  # the toy: eviction and queueing in seconds
    config = EngineServerConfig(**overrides)
    app = create_app(config)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client, app[SERVER_KEY]


def long_text(n_words: int, seed: int = 0) -> str:
    """Deterministic English-ish text of ``n_words`` words."""
    words = ("alpha", "river", "stone", "market", "window", "garden", "signal", "paper")
    return " ".join(f"{words[(i * 7 + seed) % 8]}{(i * 31 + seed) % 97}" for i in range(n_words))
