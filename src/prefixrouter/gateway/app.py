"""The application factory: routes, and the lifespan that runs the background work.

``create_app(config)`` returns an aiohttp application with:

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (:mod:`.proxy`);
* ``GET /v1/models`` and ``/v1/models/{model}``, ``/health`` (liveness), ``/ready`` (readiness: a
  cluster replica answers 503 until it has replayed its peers' facts),
  ``/metrics`` and the ``/admin/*`` endpoints
  (:mod:`.admin`), ``/dashboard`` (:mod:`.dashboard`); ``GET /openapi.json``,
  their OpenAPI document (:mod:`.openapi`); any other path answers 404 in
  OpenAI's shape, and a known path asked with another method 405 with
  ``Allow`` (:func:`_unrouted`);
* from the catch-all (:func:`_unrouted`), ``POST`` to an engine endpoint the
  gateway relays without routing (:data:`~.proxy.PASSTHROUGH_PATHS`:
  ``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/v1/score``,
  ``/score``, ``/v1/rerank``, ``/rerank``, ``/v2/rerank``;
  :meth:`Proxy.passthrough`), and ``/v1/responses`` answered 404 saying why it
  is not routed. They are served there, not as routes, so that
  ``/openapi.json`` (whose every route must be documented) stays as it is
  until it documents them; another method on them gets 405 with ``Allow: POST``.

Its cleanup contexts (aiohttp's lifespan) open the proxy's upstream client
(:mod:`.upstream`, keep-alive connections to every worker) and
(:func:`background`, which the endpoint picker runs too) an aiohttp
session for the pollers, check every worker once, start
the per-worker health/metrics pollers, the decision-log flusher and, for a
cluster replica, its :class:`~prefixrouter.cluster.node.ClusterNode`, and on
shutdown stop them and close both. Run it with handler cancellation
on (:func:`prefixrouter.gateway.cli.run_gateway` does) so a client that
disconnects cancels its upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from prefixrouter.errors import ConfigError
from prefixrouter.gateway.access_log import note_requests
from prefixrouter.gateway.admin import Admin, add_observability_routes
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.dashboard import add_dashboard_routes
from prefixrouter.gateway.errors import MethodNotAllowed, error_response
from prefixrouter.gateway.metrics import UpstreamCollector, UpstreamGauges
from prefixrouter.gateway.openapi import OPENAPI_PATH, openapi_handler
from prefixrouter.gateway.proxy import PASSTHROUGH_PATHS, RESPONSES_PREFIX, Proxy
from prefixrouter.gateway.request_builder import ChatTokenizer
from prefixrouter.gateway.state import STATE, GatewayState, build_state
from prefixrouter.gateway.upstream import UpstreamClient


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    """The proxy's upstream client (keep-alive connections to every worker) and its gauges."""
    st = app[STATE]
    proxy_cfg = st.config.proxy
    upstream = st.upstream = UpstreamClient(
        proxy_cfg.connect_timeout_s,
        proxy_cfg.request_timeout_s,
        keepalive_s=proxy_cfg.idle_connection_s,
        stall_timeout_s=proxy_cfg.stall_timeout_s,
        # Two passed health checks are at most a poll interval plus a check
        # apart: a live worker is never silent for longer than that.
        liveness_s=st.config.metrics_poll.interval_s + st.config.health.timeout_s,
    )

    def connections() -> list[UpstreamGauges]:
        out = []
        for w in st.registry.workers.values():
            pool = upstream.pool_stats(w.endpoint)
            out.append(UpstreamGauges(w.id, pool.opened, pool.idle, pool.busy))
        return out

    collector = UpstreamCollector(connections)
    st.metrics.registry.register(collector)
    # Health checks tell the upstream timeouts whether a worker is alive.
    st.registry.on_check = lambda w, ok: upstream.heard_from(w.endpoint, alive=ok)
    try:
        yield
    finally:
        st.registry.on_check = None
        st.metrics.registry.unregister(collector)
        await upstream.close()
        st.upstream = None


async def background(app: web.Application) -> AsyncIterator[None]:
    """The state's background work, for any application that holds a :data:`STATE`.

    An aiohttp session for the pollers; every worker checked once, then the
    per-worker health/metrics pollers; the decision-log flusher; the KV-event
    subscriber; for a cluster replica, its node; endpoint discovery. The
    gateway and the endpoint picker (:mod:`prefixrouter.epp`) both run it.

    Raises:
        ConfigError: The decision log's or the access log's file cannot be
            opened for append.
    """
    st = app[STATE]
    # First, before anything is started: a log that cannot be written stops
    # the start with one line (ConfigError), not a warning at every flush later.
    st.decisions.open()
    if st.access is not None:
        try:
            st.access.open()
        except ConfigError:
            st.decisions.close()
            raise
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
    st.session = aiohttp.ClientSession(connector=connector)
    flusher = asyncio.get_running_loop().create_task(st.decisions.run(), name="decision-log")
    access = st.access
    access_flusher = (
        asyncio.get_running_loop().create_task(access.run(), name="access-log")
        if access is not None
        else None
    )
    try:
        if st.events is not None:
            await st.events.start()  # bind before the engines' first events
        if st.cluster is not None:
            await st.cluster.start()  # connects and replays in the background
        await st.registry.start(st.session)
        if st.discovery is not None:
            # Endpoint discovery adds workers to the started registry; the
            # first list's are in before traffic.
            await st.discovery.start()
        yield
    finally:
        if st.discovery is not None:
            await st.discovery.stop()
        if st.cluster is not None:
            await st.cluster.stop()
        if st.events is not None:
            await st.events.stop()
        for task in (flusher, access_flusher):
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await st.registry.stop()
        if st.counter is not None:
            await st.counter.close()
        if st.warm_ups is not None:
            await st.warm_ups.close()
        await st.session.close()
        st.session = None


def _unrouted(admin: Admin, proxy: Proxy) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The catch-all route's handler: the passthrough paths and ``/v1/responses``
    (module docstring), else 405 with ``Allow`` for a known path, else 404.

    Runs only for requests no route took, so neither the set lookup nor the
    walk over the routes costs the completions anything.
    """

    async def handler(request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in PASSTHROUGH_PATHS:
            if request.method == "POST":
                return await proxy.passthrough(request)
            return error_response(
                MethodNotAllowed(
                    f"method {request.method} is not allowed on {path}; allowed: POST",
                    headers={"Allow": "POST"},
                )
            )
        if path == RESPONSES_PREFIX or path.startswith(RESPONSES_PREFIX + "/"):
            return proxy.responses_refused()
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource.raw_match("/{tail:.*}"):
                continue
            _, methods = await resource.resolve(request)
            allowed |= methods
        if allowed:
            allow = ", ".join(sorted(allowed))
            exc = MethodNotAllowed(
                f"method {request.method} is not allowed on {request.path}; allowed: {allow}",
                headers={"Allow": allow},
            )
            return error_response(exc)
        return await admin.not_found(request)

    return handler


def create_app(config: GatewayConfig, tokenizer: ChatTokenizer | None = None) -> web.Application:
    """Build the gateway application.

    Args:
        config: A validated configuration.
        tokenizer: Token-mode tokenizer to use instead of loading ``routing.tokenizer``.

    Returns:
        The application; its state is ``app[STATE]``.
    """
    state: GatewayState = build_state(config, tokenizer)
    # Every request gets a note: per-tenant metrics and the access log read it at its end.
    notes = note_requests(state.request_done, state.builder.new_request_id)
    app = web.Application(client_max_size=config.server.max_body_bytes, middlewares=[notes])
    app[STATE] = state
    proxy = Proxy(state)
    admin = Admin(state)
    r = app.router
    r.add_post("/v1/chat/completions", proxy.chat)
    r.add_post("/v1/completions", proxy.completions)
    r.add_get("/v1/models", admin.models)
    # A model id may hold slashes (``org/name``): the rest of the path is the id.
    r.add_get("/v1/models/{model:.+}", admin.model)
    add_observability_routes(app, admin)
    add_dashboard_routes(app)  # GET /dashboard and its live feed (.dashboard)
    r.add_get(OPENAPI_PATH, openapi_handler(config))
    r.add_route("*", "/{tail:.*}", _unrouted(admin, proxy))
    app.cleanup_ctx.append(_upstream)
    app.cleanup_ctx.append(background)

    async def close_proxy(_: web.Application) -> None:
        proxy.close()

    app.on_cleanup.append(close_proxy)
    return app
