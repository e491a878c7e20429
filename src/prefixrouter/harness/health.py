"""Waiting until servers answer: ``/health`` of processes, and a request through a router.

* :func:`wait_healthy`: poll each server's ``GET /health`` until it answers
  200, all of them in turn, under one deadline; a server whose process has
  exited fails at once with the end of its log (no waiting out the deadline
  on a crash), one that is still silent at the deadline fails with
  :class:`HealthTimeout`. Synchronous (urllib), so the real-vLLM fleet and
  tests without an event loop use it as is; :meth:`Fleet.wait_healthy
  <prefixrouter.harness.processes.Fleet.wait_healthy>` runs it in a thread.
* :func:`wait_routable`: until one small chat request (:data:`PROBE`) passes
  through a router with 200: a router may answer ``/health`` before it has
  found its workers.

Loopback only: the HTTP client here ignores any proxy in the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp

PROBE: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "ready?"}],
    "max_tokens": 1,
}
"""The smallest chat request: one output token, a prompt shorter than one KV block."""

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Awaited(Protocol):
    """What a wait needs of a server (:class:`~prefixrouter.harness.processes.Server` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def process(self) -> subprocess.Popen[bytes]: ...
    @property
    def log_path(self) -> Path | None: ...
    def log_tail(self, chars: int = 500) -> str: ...


class ServerExited(RuntimeError):
    """A server's process ended while it was awaited."""


class HealthTimeout(RuntimeError):
    """Servers that did not answer ``/health`` with 200 in time."""


def http_status(url: str, timeout_s: float = 2.0, method: str = "GET") -> int | None:
    """The status ``url`` answers, or None when nothing answered."""
    req = urllib.request.Request(url, method=method)
    try:
        with _NO_PROXY.open(req, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except (OSError, ValueError):
        return None


def _where(server: Awaited) -> str:
    return f" (log {server.log_path})" if server.log_path is not None else ""


def wait_healthy(
    servers: Sequence[Awaited],
    timeout_s: float = 60.0,
    *,
    path: str = "/health",
    interval_s: float = 0.1,
) -> None:
    """Until every server's ``path`` answers 200 (module doc).

    Raises:
        ServerExited: A server's process exited (its log's end in the message).
        HealthTimeout: Some did not answer 200 within ``timeout_s``.
    """
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise ServerExited(
                    f"{server.name} exited with {server.process.returncode}{_where(server)}: "
                    f"{server.log_tail(2000)}"
                )
            if http_status(server.url + path) == 200:
                pending.remove(server)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name + _where(s) for s in pending)
            raise HealthTimeout(f"{names} did not become healthy in {timeout_s:.0f} s")
        time.sleep(interval_s)


async def wait_routable(url: str, timeout_s: float = 60.0) -> None:
    """Until :data:`PROBE` passes through the router at ``url`` with 200.

    Raises:
        RuntimeError: None did within ``timeout_s`` (the last answer in the message).
    """
    deadline = time.monotonic() + timeout_s
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(url + "/v1/chat/completions", json=PROBE) as resp:
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"no request passed through {url} in {timeout_s:.0f} s ({last})")
