"""Gateway replicas of one cluster: N ``python -m prefixrouter.gateway`` processes on one NATS.

The tests, ``benchmarks/cluster_sync.py`` and ``prefixrouter bench
--replicas`` start a cluster the same way: a
:class:`~prefixrouter.harness.nats.NatsServer`, then each replica with one
shared YAML configuration (every replica must hash alike) and its own port
and replica id::

    python -m prefixrouter.gateway --config CFG --port P \\
        --cluster nats://127.0.0.1:NP --replica-id rI

in a :class:`~prefixrouter.harness.processes.Fleet` (stopped by PID), then
waits until each answers ``GET /ready`` with 200 (it has replayed the
stream). Known by command line only: the harness does not import the gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.processes import Fleet, Server

GATEWAY_MODULE = "prefixrouter.gateway"


def start_replica(
    fleet: Fleet,
    config: Path,
    nats_url: str,
    replica_id: str,
    *,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    port: int | None = None,
) -> Server:
    """Start one replica (not yet ready); its server is named ``replica_id``.

    ``port``: listen there (a restart on the port clients know); None: a free one.
    """
    args = ["--config", str(config), "--cluster", nats_url, "--replica-id", replica_id, *extra]
    server = fleet.start(replica_id, GATEWAY_MODULE, args, port=port, env=env)
    if log_path is not None:  # keep the output where the caller wants it
        server.log_path = log_path
    return server


def start_replicas(
    fleet: Fleet,
    config: Path,
    nats_url: str,
    n: int,
    *,
    prefix: str = "r",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[Server]:
    """Start ``n`` replicas ``r0 .. r{n-1}`` (not yet ready)."""
    return [
        start_replica(fleet, config, nats_url, f"{prefix}{i}", extra=extra, env=env)
        for i in range(n)
    ]


def wait_ready(servers: Sequence[Server], timeout_s: float = 60.0) -> None:
    """Until every replica answers ``GET /ready`` with 200 (it replayed the stream)."""
    wait_healthy(servers, timeout_s, path="/ready")


async def wait_ready_async(servers: Sequence[Server], timeout_s: float = 60.0) -> None:
    """:func:`wait_ready` without blocking the event loop."""
    await asyncio.to_thread(wait_ready, servers, timeout_s)
