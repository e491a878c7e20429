"""The endpoint picker's servers: ext_proc and gRPC health on one port, observability on another.

* **gRPC** (grpcio's asyncio server): ``envoy.service.ext_proc.v3.ExternalProcessor/Process``,
  one :class:`~prefixrouter.epp.exchange.Exchange` per stream, and the gRPC
  health service (``grpc.health.v1``) for the names in
  :data:`~prefixrouter.epp.protocol.HEALTH_SERVICES`: ``liveness`` and the
  ext_proc service are serving while the process runs (Envoy's health check
  of the picker asks for the ext_proc name; a picker with no ready worker
  still answers, with a 503); the overall service and ``readiness`` follow
  whether the picker can place a request (a ready worker, and a cluster
  replica's replay done), refreshed every :data:`READINESS_INTERVAL_S`.
* **HTTP** (aiohttp): the gateway's ``/health``, ``/ready``, ``/metrics`` and
  ``/admin/*`` (:func:`~prefixrouter.gateway.admin.add_observability_routes`),
  ``/dashboard`` (:func:`~prefixrouter.gateway.dashboard.add_dashboard_routes`),
  with the gateway's background work (:func:`~prefixrouter.gateway.app.background`:
  health and metrics pollers, KV events, the decision-log flusher, the
  cluster node) on the same :class:`~prefixrouter.gateway.state.GatewayState`.

Both run in one event loop, so the picker's routing state is the gateway's,
touched from one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from prefixrouter.epp import protocol
from prefixrouter.epp.exchange import Exchange
from prefixrouter.gateway.admin import Admin, add_observability_routes
from prefixrouter.gateway.app import background
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.dashboard import add_dashboard_routes
from prefixrouter.gateway.errors import NotFound, error_response
from prefixrouter.gateway.flow import RequestFlow
from prefixrouter.gateway.server import start_server
from prefixrouter.gateway.state import STATE, GatewayState, build_state

log = logging.getLogger("prefixrouter.epp")

READINESS_INTERVAL_S = 0.5
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Picker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ext_proc service: one exchange per stream."""

    def __init__(self, state: GatewayState, fallbacks: int = 0) -> None:
        self.st = state
        self.flow = RequestFlow(state)
        self.fallbacks = fallbacks

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self.st, self.flow, self.fallbacks)
        try:
            async for req in request_iterator:
                for resp in await ex.on(req):
                    yield resp
                if ex.done and ex.settled:
                    break
        finally:
            ex.close()

    def close(self) -> None:
        self.flow.close()


def ready(state: GatewayState) -> bool:
    """Whether the picker can place a request now."""
    node = state.cluster
    if node is not None and not node.ready:
        return False
    # Kubernetes' readiness too: a pod that is not ready takes no request.
    workers = state.registry.workers.values()
    return any(w.healthy and w.ready and not w.draining for w in workers)


@dataclass
class Running:
    """A started picker: its ports, its state, and how to stop it."""

    grpc_port: int
    http_port: int
    state: GatewayState
    grpc_server: grpc.aio.Server
    runner: web.AppRunner
    picker: Picker
    readiness: asyncio.Task[None]

    async def stop(self, grace_s: float = 1.0) -> None:
        self.readiness.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.readiness
        await self.grpc_server.stop(grace_s)
        await self.runner.cleanup()
        self.picker.close()


def observability_app(state: GatewayState) -> web.Application:
    """The HTTP side: the gateway's observability routes and background work."""
    app = web.Application()
    app[STATE] = state
    admin = Admin(state)
    add_observability_routes(app, admin)
    add_dashboard_routes(app)  # the gateway's live dashboard, from the picker's own state

    async def not_found(request: web.Request) -> web.Response:
        return error_response(NotFound(f"no route {request.method} {request.path}"))

    app.router.add_route("*", "/{tail:.*}", not_found)
    app.cleanup_ctx.append(background)
    return app


async def start_picker(
    config: GatewayConfig,
    grpc_host: str,
    grpc_port: int,
    fallbacks: int = 0,
    tls: tuple[bytes, bytes] | None = None,
) -> Running:
    """Start both servers (``grpc_port`` 0: any free port; the HTTP one is ``config.server``).

    ``tls``: the PEM certificate chain and private key the gRPC port serves
    TLS with (the Inference Extension's reference picker serves TLS, and some
    gateways connect with TLS unless told not to); None serves plaintext
    HTTP/2 (``appProtocol: kubernetes.io/h2c``).

    Raises:
        ListenError: The HTTP address cannot be bound.
        RuntimeError: The gRPC address cannot be bound.
    """
    state = build_state(config)
    app = observability_app(state)
    srv = config.server
    listening = await start_server(app, srv.host, srv.port, config.limits)
    picker = Picker(state, fallbacks)
    server = grpc.aio.server(
        options=[
            # A port another process holds is an error, not a shared port.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", config.server.max_body_bytes + 65536),
            ("grpc.max_send_message_length", config.server.max_body_bytes + 65536),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in protocol.HEALTH_SERVICES:
        await health.set(
            name, SERVING if name in ("liveness", protocol.EXT_PROC_SERVICE) else NOT_SERVING
        )
    try:
        address = f"{grpc_host}:{grpc_port}"
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            cert, key = tls
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError as exc:
        await listening.runner.cleanup()
        raise RuntimeError(f"cannot listen on {grpc_host}:{grpc_port} (gRPC): {exc}") from None
    await server.start()

    async def follow_readiness() -> None:
        last: bool | None = None
        while True:
            now = ready(state)
            if now != last:
                status = SERVING if now else NOT_SERVING
                await health.set("", status)
                await health.set("readiness", status)
                last = now
            await asyncio.sleep(READINESS_INTERVAL_S)

    task = asyncio.get_running_loop().create_task(follow_readiness(), name="epp-readiness")
    return Running(port, listening.port, state, server, listening.runner, picker, task)
