"""A live gateway for tests: ``python -m prefixrouter.gateway`` in front of simulated engines.

Real processes on loopback (free ports, stopped by PID when the ``with``
ends), the gateway's configuration written as a file, its stdout and stderr
kept in a log file the test can read (tracebacks land there).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from prefixrouter.harness.health import wait_routable
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server

ENGINE_ARGS = ("--profile", "tiny-cpu", "--model", "tiny")


@dataclass
class LiveGateway:
    """A running gateway, its engines and its files."""

    gateway: Server
    engines: list[Server]
    log: Path
    config: dict[str, Any]

    @property
    def url(self) -> str:
        return self.gateway.url

    def log_text(self) -> str:
        """Everything the gateway wrote on stdout and stderr so far."""
        return self.log.read_text(errors="replace")


@contextmanager
def live_gateway(
    tmp: Path,
    config: dict[str, Any],
    engines: int = 2,
    engine_args: tuple[str, ...] = ("--time-scale", "50"),
    ids: tuple[str, ...] = (),
) -> Iterator[LiveGateway]:
    """Start ``engines`` simulated engines and a gateway with ``config`` (workers added).

    ``ids`` names the workers (default ``e0``, ``e1``...). Waits until a chat
    request passes through the gateway.
    """
    with Fleet() as fleet:
        started = [
            fleet.start(f"e{i}", "prefixrouter.simulated_engine", [*ENGINE_ARGS, *engine_args])
            for i in range(engines)
        ]
        asyncio.run(fleet.wait_healthy(started, timeout_s=60.0))
        names = ids or tuple(e.name for e in started)
        data = {
            "metrics_poll": {"interval_s": 0.5},
            **config,
            "workers": [{"url": e.url, "id": n} for e, n in zip(started, names, strict=True)],
        }
        cfg = tmp / "gateway.yaml"
        cfg.write_bytes(orjson.dumps(data))  # JSON is YAML
        log = tmp / "gateway.log"
        port = free_port()
        gw = fleet.start_command(
            "gateway",
            [
                sys.executable,
                "-m",
                "prefixrouter.gateway",
                "--config",
                str(cfg),
                "--port",
                str(port),
            ],
            port,
            log_path=log,
        )
        asyncio.run(fleet.wait_healthy([gw], timeout_s=60.0))
        asyncio.run(wait_routable(gw.url, timeout_s=30.0))
        yield LiveGateway(gw, started, log, data)
