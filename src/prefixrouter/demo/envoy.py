"""``prefixrouter demo --envoy``: Envoy, the endpoint picker and engines on loopback, until Ctrl-C.

What a Gateway API Inference Extension deployment runs, on one machine:
the demo's simulated engines (``workers`` of them, the demo's profile and
KV cache), ``prefixrouter epp`` in front of them (ext_proc on one port; its
``/metrics``, ``/admin/*`` and ``/health`` on another, the admin API opened
with a key made for the run and passed in the environment), and Envoy on
the shipped bootstrap (``deploy/envoy/envoy.yaml``, rendered for free
loopback ports by :func:`prefixrouter.epp.envoy.render`, written into a
folder the caller owns: the command's is temporary, removed when the demo
ends). It returns once one request has gone through Envoy with 200; every
process is stopped by PID when the fleet closes.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from prefixrouter.bench.live import start_engines
from prefixrouter.demo.run import DemoConfig, demo_workload, live_config
from prefixrouter.epp.envoy import Envoy, render, start_envoy
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.harness.health import wait_healthy, wait_routable
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet, Server


@dataclass
class EnvoyStack:
    """The running pieces: Envoy (clients talk to it), the picker, the engines."""

    envoy: Envoy
    picker: Server
    grpc_port: int
    engines: list[Server]


async def serve_envoy(
    cfg: DemoConfig, fleet: Fleet, admin_api_key: str, workdir: Path
) -> EnvoyStack:
    """Start engines, the picker and Envoy in ``fleet``; return them once a request passes.

    Envoy's bootstrap is written into ``workdir``, which must outlive the
    fleet (Envoy reads it while it runs); the caller removes it afterwards.

    Raises:
        RuntimeError: A process did not start (its log's end in the message).
    """
    engines = start_engines(live_config(cfg), demo_workload(cfg), fleet)
    await fleet.wait_healthy(engines)
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "prefixrouter.epp", "--port", str(grpc_port)]
    cmd += ["--http-port", str(http_port)]
    for e in engines:
        cmd += ["--worker", e.url]
    picker = fleet.start_command("epp", cmd, http_port, env={ADMIN_KEY_ENV: admin_api_key})
    await fleet.wait_healthy([picker])
    boot = render(free_port(), grpc_port, free_port(), [(HOST, e.port) for e in engines])
    envoy = start_envoy(fleet, boot, workdir=workdir)
    await asyncio.to_thread(wait_healthy, [envoy.server], 60.0, path="/ready")
    await wait_routable(envoy.url)
    return EnvoyStack(envoy, picker, grpc_port, engines)
