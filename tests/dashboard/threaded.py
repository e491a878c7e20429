"""A gateway in front of fake engines, served from a thread of its own: for the browser tests.

Playwright's sync API owns the test thread's event loop, so the gateway of
:func:`tests.gateway.helpers.gateway_env` (fake engines and the gateway on
loopback ports, one event loop) runs in a second thread; :meth:`Served.call`
runs a coroutine on that loop (traffic, reading the state) and waits for it,
bounded in time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.gateway.helpers import Env, gateway_env

T = TypeVar("T")
START_S = 20.0


@dataclass
class Served:
    """The running gateway: its base URL, its test environment and its loop."""

    url: str
    env: Env
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[Env], Awaitable[T]], timeout: float = 20.0) -> T:
        """Run ``fn(env)`` on the gateway's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(_awaited(fn(self.env)), self.loop).result(timeout)


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


@contextmanager
def served_gateway(n: int = 1, **options: Any) -> Iterator[Served]:
    """``gateway_env(n, **options)`` in a thread, until the block ends."""
    ready: Future[Served] = Future()
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            try:
                async with gateway_env(n, **options) as env:
                    url = str(env.client.make_url("")).rstrip("/")
                    ready.set_result(Served(url, env, asyncio.get_running_loop()))
                    while not stop.is_set():
                        await asyncio.sleep(0.05)
            except BaseException as exc:  # told to the test thread, not lost in this one
                if not ready.done():
                    ready.set_exception(exc)
                raise

        asyncio.run(main())

    thread = threading.Thread(target=serve, name="served-gateway", daemon=True)
    thread.start()
    try:
        yield ready.result(START_S)
    finally:
        stop.set()
        thread.join(START_S)
