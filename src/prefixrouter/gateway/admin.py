"""Admin and discovery endpoints: workers, decisions, process figures, models, health.

* ``GET /admin/workers``: every worker's state (health, draining, models,
  in-flight requests, last engine figures, the view the router reads).
* ``POST /admin/workers``: add a worker; the body is a worker entry of the
  configuration (``{"url": ..., "id": ..., "kind": ...}``), validated the same
  way (400 naming the field, 409 for an existing id, a ``url`` that reaches
  another worker's engine, or a ``kv_events_topic``
  or ``kv_events_connect`` another worker has; 400 for ``kv_events_connect``
  on a gateway started without KV events, which has no socket to connect).
  Answers after the first health check, with the worker's state.
* ``DELETE /admin/workers/{id}?timeout=S``: drain (no new requests), wait for
  its in-flight requests up to ``S`` seconds (default ``proxy.drain_timeout_s``;
  a finite number, 0 or more, else 400 naming ``timeout``), then remove. A
  ``DELETE`` of a worker already draining joins that drain and answers its
  result. The id is the rest of the path, ``/`` included (an id may hold one,
  as a configured ``rack1/gpu0``; ``%2F`` works as well).
* ``GET /admin/decisions?limit=N``: the newest N decision-log records (default 100).
* ``GET /admin/process``: the gateway's pid, CPU seconds and request count, so a
  benchmark can measure CPU per request without reading ``/proc``.

Access: every ``/admin/*`` endpoint, reads included, needs
``server.admin_api_key`` as a bearer token (``Authorization: Bearer KEY``,
``Bearer`` in any case, the key compared in constant time); a missing or
wrong key is a 401. With no key configured the admin API is off: every call
is a 403 naming the setting. Reads are guarded too because they are not
harmless: the decision log names tenants, request ids and prefix keys, and
the worker list the fleet's addresses. Tenant keys (``api_keys``) never open
the admin API. ``/v1/models``, ``/health`` and ``/metrics`` stay open (a
load balancer's health check and a Prometheus scraper carry no key; they
expose no tenant or prompt data).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import ValidationError

from prefixrouter.core.types import WorkerId
from prefixrouter.gateway.config import WorkerConfig
from prefixrouter.gateway.errors import (
    JSON,
    BadRequest,
    Conflict,
    Forbidden,
    GatewayError,
    NotFound,
    Unauthorized,
    error_response,
    json_body,
    model_not_found,
)
from prefixrouter.gateway.state import GatewayState
from prefixrouter.gateway.tenancy import bearer_token

ADMIN_DISABLED = (
    "the admin API is off: set server.admin_api_key (prefixrouter serve --admin-api-key "
    "or PREFIXROUTER_ADMIN_API_KEY) and send it as 'Authorization: Bearer KEY'"
)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type=JSON)


def _model_card(model: str, reported: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's model object of one served model (``/v1/models`` and ``/v1/models/{model}``).

    ``reported``: vLLM's extra fields as the workers listed them
    (:meth:`~prefixrouter.gateway.workers.WorkerRegistry.model_card`:
    ``root``, ``parent``, ``max_model_len``, the smallest of the workers'),
    included only when a worker reported them: clients size their context
    from ``max_model_len`` and tell adapters by ``parent``.
    """
    return {"id": model, "object": "model", "created": 0, "owned_by": "prefixrouter", **reported}


def check_admin_key(request: web.Request, key: bytes) -> None:
    """Let the call through only with ``key`` as its bearer token.

    Raises:
        Unauthorized: The key is missing or wrong.
    """
    given = bearer_token(request.headers.get("Authorization"))
    # compare_digest: the time taken says nothing about how much of the key matched.
    # (A header's bytes that are not UTF-8 arrive surrogate-escaped: keep them.)
    raw = given.encode("utf-8", "surrogateescape") if given is not None else None
    if raw is None or not hmac.compare_digest(raw, key):
        raise Unauthorized(
            "admin endpoints need the admin API key as 'Authorization: Bearer KEY'",
            headers={"WWW-Authenticate": "Bearer"},
        )


class Admin:
    """Admin and discovery handlers of one gateway.

    ``shutting_down``: whether the process is shutting down (then not ready,
    whatever else holds; :meth:`readiness`).
    """

    def __init__(
        self, state: GatewayState, shutting_down: Callable[[], bool] = lambda: False
    ) -> None:
        self.st = state
        self.shutting_down = shutting_down
        key = state.config.server.admin_api_key
        self._admin_key = key.encode() if key else None

    def _check(self, request: web.Request) -> None:
        """Let the call through only with the admin key (see the module docstring).

        Raises:
            Forbidden: No admin key is configured.
            Unauthorized: The key is missing or wrong.
        """
        if self._admin_key is None:
            raise Forbidden(ADMIN_DISABLED, code="admin_api_disabled")
        check_admin_key(request, self._admin_key)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the union of the workers' models and adapters."""
        reg = self.st.registry
        data = [_model_card(m, reg.model_card(m)) for m in reg.models()]
        return _json({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: one model of ``/v1/models`` (OpenAI's retrieve,
        the SDK's ``models.retrieve``); 404 ``model_not_found`` for any other."""
        model = request.match_info["model"]
        if model not in self.st.registry.models():
            return error_response(model_not_found(model))
        return _json(_model_card(model, self.st.registry.model_card(model)))

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: liveness: 200 while the process serves, whatever the engines' state.

        An engine outage must not fail it: a liveness probe that failed then
        would have every gateway restarted, which brings no engine back and
        drops the requests in flight. The body says whether a worker can take
        requests (``status``: ``ok`` or ``no_healthy_worker``, with
        ``healthy_workers`` and ``workers``); meanwhile requests get 503 with
        ``Retry-After``. Readiness is ``/ready``.
        """
        reg = self.st.registry
        healthy = sum(1 for w in reg.workers.values() if w.healthy and w.ready and not w.draining)
        body = {
            "status": "ok" if healthy else "no_healthy_worker",
            "healthy_workers": healthy,
            "workers": len(reg.workers),
        }
        return _json(body)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether this gateway may take traffic, and ``/ready``'s body (:meth:`ready`).

        Not while shutting down (``status`` ``shutting_down``), checked first. A
        lone gateway is ready once started. A cluster replica is ready once it
        has replayed its peers' facts up to where the stream stood when it
        started, and its configuration was found compatible with the live
        peers': before, it would route documents its peers hold cold. One that
        cannot replay (NATS unreachable) is ready on its own view after
        ``cluster.ready_without_nats_s``. ``status`` says which
        (:attr:`ClusterNode.status <prefixrouter.cluster.node.ClusterNode.status>`).
        """
        draining = self.shutting_down()
        node = self.st.cluster
        if node is None:
            return not draining, {"status": "shutting_down" if draining else "ready"}
        body = {
            "status": "shutting_down" if draining else node.status,
            "replica": node.origin,
            "connected": node.connected,
            "replayed": node.link.replayed,
            "peers": [p.origin for p in node.registry.live()],
        }
        return not draining and node.ready, body

    async def ready(self, request: web.Request) -> web.Response:
        """``GET /ready``: 200 once this gateway may take traffic, else 503 (:meth:`readiness`)."""
        ok, body = self.readiness()
        return _json(body, 200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text format."""
        resp = web.Response(body=self.st.metrics.exposition())
        resp.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        return resp

    async def list_workers(self, request: web.Request) -> web.Response:
        """``GET /admin/workers``."""
        try:
            self._check(request)
        except GatewayError as exc:
            return error_response(exc)
        dispatch = self.st.dispatch
        data = [
            w.to_dict(dispatch.load(w.id).in_flight, dispatch.index_blocks(w.id))
            for w in self.st.registry.workers.values()
        ]
        return _json({"workers": data})

    async def add_worker(self, request: web.Request) -> web.Response:
        """``POST /admin/workers``."""
        try:
            self._check(request)
            try:
                body = json_body(await request.read())
            except (HttpProcessingError, RequestPayloadError) as exc:  # gzip that is not gzip
                raise BadRequest(
                    f"malformed request body ({type(exc).__name__})", code="invalid_body"
                ) from None
            try:
                wc = WorkerConfig.model_validate(body)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"]) or "(body)"
                msg = err["msg"].removeprefix("Value error, ")
                raise BadRequest(f"{field}: {msg}", param=field) from None
            if (taken := self.st.registry.workers.get(WorkerId(wc.id))) is not None:
                # A draining one holds its id until its DELETE has answered.
                draining = " and is draining: add it again once removed" if taken.draining else ""
                raise Conflict(f"worker {wc.id!r} exists{draining}", param="id")
            if (owner := self.st.registry.engine_owner(wc.url)) is not None:
                # One engine counted as two workers: twice its capacity, its cache index split.
                raise Conflict(
                    f"url: worker {owner!r} has the same engine ({wc.url}); "
                    f"remove it before adding it as {wc.id!r}",
                    param="url",
                )
            topic = wc.kv_events_topic
            if topic is not None and (owner := self.st.registry.topic_owner(topic)) is not None:
                raise Conflict(
                    f"kv_events_topic {topic!r} is used by worker {owner!r}",
                    param="kv_events_topic",
                )
            publisher = wc.kv_events_connect
            if publisher is not None:
                if self.st.events is None:
                    raise BadRequest(
                        "kv_events_connect: this gateway was started without KV events "
                        "(set kv_events.endpoint or a configured worker's kv_events_connect)",
                        param="kv_events_connect",
                    )
                if (owner := self.st.registry.publisher_owner(publisher)) is not None:
                    raise Conflict(
                        f"kv_events_connect {publisher!r} is used by worker {owner!r}",
                        param="kv_events_connect",
                    )
            try:
                w = await self.st.registry.add(wc)
            except ValueError as exc:
                # The message starts with the field it is about ("kv_events_connect: ...");
                # the URL and headers were checked by WorkerConfig, so none fails here.
                field, sep, _ = str(exc).partition(":")
                param = field if sep and field in WorkerConfig.model_fields else None
                raise BadRequest(str(exc), param=param) from None
        except GatewayError as exc:
            return error_response(exc)
        return _json(w.to_dict(0), 201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        """``DELETE /admin/workers/{id}``: drain, then remove (a second call joins the drain).

        ``timeout`` is a finite number of seconds, 0 or more: ``inf`` would
        hold the worker draining as long as any request of it runs, and
        ``nan`` compares false with everything (it read as 0); a negative
        one is a typo, not "at once". Each is a 400 naming ``timeout``.
        """
        try:
            self._check(request)
            wid = WorkerId(request.match_info["id"])
            if wid not in self.st.registry.workers:
                raise NotFound(f"no worker {wid!r}", param="id")
            timeout = self.st.config.proxy.drain_timeout_s
            if "timeout" in request.query:
                try:
                    timeout = float(request.query["timeout"])
                except ValueError:
                    timeout = math.nan
                if not (math.isfinite(timeout) and timeout >= 0):
                    raise BadRequest(
                        "timeout: must be a finite number of seconds, 0 or more", param="timeout"
                    )
            result = await self.st.registry.drain_and_remove(wid, timeout)
        except GatewayError as exc:
            return error_response(exc)
        return _json(result)

    async def decisions(self, request: web.Request) -> web.Response:
        """``GET /admin/decisions?limit=N``."""
        try:
            self._check(request)
            raw = request.query.get("limit", "100")
            # ASCII digits only: str.isdigit also takes "²" and "١", which int() refuses.
            if not (raw.isascii() and raw.isdigit()):
                raise BadRequest("limit: must be a non-negative integer", param="limit")
        except GatewayError as exc:
            return error_response(exc)
        return _json({"decisions": self.st.decisions.recent(int(raw))})

    async def process(self, request: web.Request) -> web.Response:
        """``GET /admin/process``: pid, CPU seconds, requests seen."""
        try:
            self._check(request)
        except GatewayError as exc:
            return error_response(exc)
        return _json(self.st.process_stats())

    async def not_found(self, request: web.Request) -> web.Response:
        """Any other path: 404 in OpenAI's shape."""
        return error_response(NotFound(f"no route {request.method} {request.path}"))


def add_observability_routes(app: web.Application, admin: Admin) -> None:
    """Serve ``/health``, ``/ready``, ``/metrics`` and ``/admin/*`` on ``app``.

    The one place these routes are listed: the gateway's application and the
    endpoint picker's HTTP port (:mod:`prefixrouter.epp`) both call it, so the
    two serve the same observability, from the same state.
    """
    r = app.router
    r.add_get("/health", admin.health)
    r.add_get("/ready", admin.ready)
    r.add_get("/metrics", admin.metrics)
    r.add_get("/admin/workers", admin.list_workers)
    r.add_post("/admin/workers", admin.add_worker)
    # The id is the rest of the path: an id may hold "/" (a configured "rack1/gpu0").
    r.add_delete("/admin/workers/{id:.+}", admin.remove_worker)
    r.add_get("/admin/decisions", admin.decisions)
    r.add_get("/admin/process", admin.process)
