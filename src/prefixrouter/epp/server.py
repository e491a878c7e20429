"""The endpoint picker's servers: ext_proc and gRPC health on one port, observability on another.

* **gRPC** (grpcio's asyncio server): ``envoy.service.ext_proc.v3.ExternalProcessor/Process``,
  one :class:`~prefixrouter.epp.exchange.Exchange` per stream, and the gRPC
  health service (``grpc.health.v1``) for the names in
  :data:`~prefixrouter.epp.protocol.HEALTH_SERVICES`: ``liveness`` is
  serving while the process runs; ``readiness``, the overall service and the
  ext_proc service (Envoy's health check of the picker asks for that name;
  the protocol gives it readiness's criteria) follow
  :meth:`Admin.readiness <prefixrouter.gateway.admin.Admin.readiness>` (as
  :func:`picker_admin` makes it), refreshed every :data:`READINESS_INTERVAL_S`.
* **HTTP** (aiohttp): the gateway's ``/health`` (liveness: 200 while the
  process serves; its body says whether a worker is ready), ``/ready``
  (the same rule as gRPC ``readiness``, the gateway's body), ``/metrics``
  and ``/admin/*`` (:func:`~prefixrouter.gateway.admin.add_observability_routes`),
  ``/dashboard`` (:func:`~prefixrouter.gateway.dashboard.add_dashboard_routes`),
  with the gateway's background work (:func:`~prefixrouter.gateway.app.background`:
  health and metrics pollers, KV events, the decision-log flusher, the
  cluster node) on the same :class:`~prefixrouter.gateway.state.GatewayState`.

Both run in one event loop, so the picker's routing state is the gateway's,
touched from one thread.

**Readiness** is "able to serve picks" (the protocol's: datastore synced):
started, a cluster replica's replay done, and not shutting down. It does not
ask for a ready worker: a pool with none (vLLM still loading, a rollout of
every engine) must not take the picker out of its Service, since the picker
then answers each request a 503 with ``Retry-After`` in the OpenAI shape,
where a gateway without a picker answers an empty 500 or skips the picker.

**Shutdown** (:meth:`Running.drain`, on SIGTERM): readiness goes
``NOT_SERVING`` (gRPC) and 503 (HTTP) at once, so the gateway and Kubernetes
send no more; a request that still comes is answered 503 ``shutting_down``
with ``Retry-After`` (not picked); the open streams (every response body of
a ``FULL_DUPLEX_STREAMED`` request flows through the picker) finish within
the grace period; then the servers stop.
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
from prefixrouter.epp.exchange import Exchange, refusal
from prefixrouter.gateway.admin import Admin, add_observability_routes
from prefixrouter.gateway.app import background
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.dashboard import add_dashboard_routes
from prefixrouter.gateway.errors import NotFound, ServiceUnavailable, error_response
from prefixrouter.gateway.flow import RequestFlow
from prefixrouter.gateway.server import start_server
from prefixrouter.gateway.state import STATE, GatewayState, build_state

log = logging.getLogger("prefixrouter.epp")

READINESS_INTERVAL_S = 0.5
SHUTDOWN_RETRY_AFTER_S = 1
"""``Retry-After`` of a request refused while shutting down: another replica takes it."""
SHUTTING_DOWN = ServiceUnavailable(
    "the endpoint picker is shutting down; retry",
    code="shutting_down",
    headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)},
)
"""The answer to a request that comes while shutting down (module docstring)."""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Lifecycle:
    """Whether the picker is shutting down, and the ext_proc streams still open."""

    def __init__(self) -> None:
        self.draining = False
        self.open_streams = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def opened(self) -> None:
        self.open_streams += 1
        self._idle.clear()

    def closed(self) -> None:
        self.open_streams -= 1
        if self.open_streams == 0:
            self._idle.set()

    async def idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open (at most ``timeout_s``); whether none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class Picker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ext_proc service: one exchange per stream (none while shutting down)."""

    def __init__(self, state: GatewayState, life: Lifecycle, fallbacks: int = 0) -> None:
        self.st = state
        self.flow = RequestFlow(state)
        self.fallbacks = fallbacks
        self.life = life

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        if self.life.draining:
            # A request that still comes while shutting down: not picked here, a clear
            # 503 (the first message is the request's headers; the answer ends it).
            async for _ in request_iterator:
                yield refusal(self.st, SHUTTING_DOWN)
                return
            return
        ex = Exchange(self.st, self.flow, self.fallbacks)
        self.life.opened()
        try:
            async for req in request_iterator:
                for resp in await ex.on(req):
                    yield resp
                if ex.done and ex.settled:
                    break
        finally:
            ex.close()
            self.life.closed()

    def close(self) -> None:
        self.flow.close()


def picker_admin(state: GatewayState, life: Lifecycle) -> Admin:
    """The gateway's handlers, shutting down with ``life``: the one readiness rule.

    HTTP ``/ready`` and gRPC readiness both ask its
    :meth:`~prefixrouter.gateway.admin.Admin.readiness` (module docstring).
    """
    return Admin(state, shutting_down=lambda: life.draining)


@dataclass
class Running:
    """A started picker: its ports, its state, and how to stop it."""

    grpc_port: int
    http_port: int
    state: GatewayState
    grpc_server: grpc.aio.Server
    runner: web.AppRunner
    picker: Picker
    follow: asyncio.Task[None]
    health: health_aio.HealthServicer

    @property
    def life(self) -> Lifecycle:
        return self.picker.life

    async def drain(self, grace_s: float) -> None:
        """Shut down as the module docstring says (a warning if a stream outlived ``grace_s``)."""
        self.life.draining = True
        await _publish(self.health, False)  # at once, not at the next refresh
        if not await self.life.idle(grace_s):
            log.warning(
                "shutdown: %d ext_proc streams still open after %.0f s; cutting them off",
                self.life.open_streams,
                grace_s,
            )
        await self.stop()

    async def stop(self, grace_s: float = 1.0) -> None:
        self.follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.follow
        await self.grpc_server.stop(grace_s)
        await self.runner.cleanup()
        self.picker.close()


async def _publish(health: health_aio.HealthServicer, ready: bool) -> None:
    """Readiness on the gRPC names that follow it (module docstring)."""
    status = SERVING if ready else NOT_SERVING
    for name in protocol.HEALTH_SERVICES:
        if name != "liveness":
            await health.set(name, status)


def observability_app(admin: Admin) -> web.Application:
    """The HTTP side: the gateway's observability routes and background work.

    ``admin`` is :func:`picker_admin`'s: its ``/ready`` and gRPC readiness
    follow one rule, so HTTP and gRPC agree.
    """
    app = web.Application()
    app[STATE] = admin.st
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
    life = Lifecycle()
    admin = picker_admin(state, life)
    srv = config.server
    listening = await start_server(observability_app(admin), srv.host, srv.port, config.limits)
    picker = Picker(state, life, fallbacks)
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
    await health.set("liveness", SERVING)
    await _publish(health, False)  # until the first readiness check
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
            now, _ = admin.readiness()
            if now != last:
                await _publish(health, now)
                last = now
            await asyncio.sleep(READINESS_INTERVAL_S)

    task = asyncio.get_running_loop().create_task(follow_readiness(), name="epp-readiness")
    return Running(port, listening.port, state, server, listening.runner, picker, task, health)
