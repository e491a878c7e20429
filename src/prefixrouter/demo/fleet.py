"""Start and stop the demo's servers: engine processes and gateways on loopback.

Each server is a real subprocess (``python -m prefixrouter.simulated_engine`` or
``python -m prefixrouter.gateway``) on a free port of 127.0.0.1, polled on
``/health`` until it answers, and stopped by PID (SIGTERM, then SIGKILL after
a grace period). :class:`Fleet` is a context manager, so servers never outlive
the demo, even when it fails half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import aiohttp

HOST = "127.0.0.1"


_EPHEMERAL_FALLBACK = (32768, 60999)  # Linux's default ip_local_port_range
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_FALLBACK


def free_port() -> int:
    """A loopback port that was free a moment ago and stays out of the kernel's way.

    Chosen below the kernel's ephemeral range: a server that binds it only
    later (vLLM's replay socket, 20-40 s after the port is picked) would
    otherwise find it taken by the source port of some outgoing connection,
    as one run in a few did. Random within that range, never the same port
    twice in one process, and checked by binding it.
    """
    low = _ephemeral_range()[0]
    start = 10_000 if low > 20_000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(start, low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: any port
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One running server subprocess."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: IO[bytes]

    def log_tail(self, chars: int = 500) -> str:
        """The end of what the server wrote (stdout and stderr)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace").strip()[-chars:]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Fleet:
    """Servers started by the demo; stops them all on exit."""

    servers: list[Server] = field(default_factory=list)

    def start(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Server:
        """Start ``python -m module --port P args...`` and return it (not yet healthy)."""
        port = port or free_port()
        return self.start_command(
            name, [sys.executable, "-m", module, "--port", str(port), *args], port, env
        )

    def start_command(
        self, name: str, cmd: Sequence[str], port: int, env: Mapping[str, str] | None = None
    ) -> Server:
        """Start any server command that listens on ``port``; return it (not yet healthy).

        ``env`` adds environment variables (secrets go there: a command line
        is visible to every local user).
        """
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # Output goes to a file, not a pipe: a chatty server can never block on it.
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        server = Server(name, port, proc, log)
        self.servers.append(server)
        return server

    async def wait_healthy(self, servers: Sequence[Server], timeout_s: float = 60.0) -> None:
        """Poll ``/health`` of each server until 200; raise if one dies or times out."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for server in servers:
                while True:
                    if server.process.poll() is not None:
                        raise RuntimeError(f"{server.name} exited: {server.log_tail()}")
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with session.get(server.url + "/health") as resp:
                            if resp.status == 200:
                                break
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{server.name} did not become healthy in {timeout_s:.0f} s"
                        )
                    await asyncio.sleep(0.1)

    def stop(self, server: Server, grace_s: float = 5.0) -> None:
        """Stop one server by PID: SIGTERM, then SIGKILL after ``grace_s``."""
        proc = server.process
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        server.log.close()
        if server in self.servers:
            self.servers.remove(server)

    def stop_all(self) -> None:
        for server in list(reversed(self.servers)):
            self.stop(server)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()
