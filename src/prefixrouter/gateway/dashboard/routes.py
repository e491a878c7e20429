"""The dashboard's HTTP routes, registered on any application that holds a gateway state.

* ``GET /dashboard``: the page (HTML; it holds no data, so it is served without a key);
* ``GET /dashboard/static/{name}``: its script and style sheet, shipped in the
  package (no CDN: the page works air-gapped; a ``Content-Security-Policy``
  of ``'self'`` keeps it from loading anything else);
* ``GET /dashboard/events``: the live view, server-sent events: ``hello``
  once (the latest snapshot, the chart history and recent decisions), then
  ``tick`` every second (:mod:`.feed`);
* ``GET /dashboard/snapshot``: the ``hello`` payload as one JSON document
  (``prefixrouter top --once``, scripts).

Access: the two data routes follow ``/admin/*``'s rule, never an anonymous
admin. Their records are per request and per tenant (the tenant, the client's
own request id, the model, prompt sizes, timings): unlike ``/metrics``, whose
series are aggregates, they would let one tenant watch another's traffic. So
with ``server.admin_api_key`` set they need it, in the ``Authorization: Bearer
KEY`` header (never a query parameter, which access logs and proxies record);
with none configured they answer 403 ``admin_api_disabled``, whose message
names the setting. The page and its assets hold no data and are served either
way: the page reads the key from its URL's fragment (``/dashboard#key=KEY``,
URL-encoded: :func:`dashboard_url`; a browser never sends the fragment) or asks
for it, and sends the header itself; on the 403 it says how to turn the
dashboard on.

:func:`add_dashboard_routes` registers all of this, with the feed's start and
stop, on an application whose ``app[STATE]`` is set; the gateway's
:func:`~prefixrouter.gateway.app.create_app` calls it, and so can another
front end (the endpoint picker) serving the same state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib import resources
from urllib.parse import quote

import orjson
from aiohttp import web

from prefixrouter.gateway.admin import ADMIN_DISABLED, check_admin_key
from prefixrouter.gateway.dashboard.feed import DashboardFeed, sse_event
from prefixrouter.gateway.errors import JSON, Forbidden, GatewayError, NotFound, error_response
from prefixrouter.gateway.state import STATE

DASHBOARD_PATH = "/dashboard"
FEED = web.AppKey("prefixrouter_dashboard", DashboardFeed)
"""Where the application keeps its :class:`DashboardFeed`."""
STATIC = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
DASHBOARD_DISABLED = (
    "the dashboard's data (each request's tenant, request id, sizes and timings) is served "
    "only with the admin API key, as /admin/* is; " + ADMIN_DISABLED
)
"""The 403's message when no admin key is configured: it names the setting that turns it on."""


def dashboard_url(base_url: str, admin_api_key: str | None = None) -> str:
    """The dashboard's address on a gateway at ``base_url``, with the key in the fragment.

    The key is percent-encoded (every character but letters, digits and
    ``-._~``): a ``%`` or ``&`` of a key chosen by hand would otherwise be read
    as an escape or cut the key short; the page decodes it.
    """
    url = base_url.rstrip("/") + DASHBOARD_PATH
    return f"{url}#key={quote(admin_api_key, safe='')}" if admin_api_key else url


def _asset(name: str) -> bytes:
    return resources.files("prefixrouter.gateway.dashboard").joinpath("static", name).read_bytes()


class DashboardRoutes:
    """The dashboard's handlers for one application."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        key = app[STATE].config.server.admin_api_key
        self._key = key.encode() if key else None
        self._page = _asset("dashboard.html")
        self._static = {name: (_asset(name), ctype) for name, ctype in STATIC.items()}

    def _check(self, request: web.Request) -> None:
        """Let a data request through only with the admin key (the module docstring's rule).

        Raises:
            Forbidden: No admin key is configured (``admin_api_disabled``).
            Unauthorized: The key is missing or wrong.
        """
        if self._key is None:
            raise Forbidden(DASHBOARD_DISABLED, code="admin_api_disabled")
        check_admin_key(request, self._key)

    @property
    def feed(self) -> DashboardFeed:
        return self.app[FEED]

    async def page(self, request: web.Request) -> web.Response:
        """``GET /dashboard``."""
        resp = web.Response(body=self._page, content_type="text/html", charset="utf-8")
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["Cache-Control"] = "no-store"
        return resp

    async def static(self, request: web.Request) -> web.Response:
        """``GET /dashboard/static/{name}``."""
        asset = self._static.get(request.match_info["name"])
        if asset is None:
            return error_response(NotFound(f"no dashboard asset {request.match_info['name']!r}"))
        body, ctype = asset
        resp = web.Response(body=body, content_type=ctype, charset="utf-8")
        resp.headers["Cache-Control"] = "no-cache"
        return resp

    async def snapshot(self, request: web.Request) -> web.Response:
        """``GET /dashboard/snapshot``."""
        try:
            self._check(request)
        except GatewayError as exc:
            return error_response(exc)
        self.feed.watch()  # an unwatched feed builds a fresh snapshot first
        return web.Response(body=orjson.dumps(self.feed.hello()), content_type=JSON)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """``GET /dashboard/events``: ``hello``, then a ``tick`` a second until either side ends."""
        try:
            self._check(request)
        except GatewayError as exc:
            return error_response(exc)
        feed = self.feed
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # a buffering proxy would hold the ticks back
            }
        )
        await resp.prepare(request)
        queue = feed.subscribe()
        try:
            await resp.write(sse_event("hello", feed.hello()))
            while (data := await queue.get()) is not None:
                await resp.write(data)
        except ConnectionError:
            pass  # the client went away
        finally:
            feed.unsubscribe(queue)
        return resp


def add_dashboard_routes(app: web.Application) -> None:
    """Register the dashboard's routes and its feed's lifecycle on ``app``.

    Call it before any catch-all route (aiohttp matches in registration
    order). The feed starts with the application and, on shutdown, ends every
    open stream first so that the server does not wait on them.
    """
    feed = app[FEED] = DashboardFeed(app[STATE])
    routes = DashboardRoutes(app)
    r = app.router
    r.add_get(DASHBOARD_PATH, routes.page)
    r.add_get(DASHBOARD_PATH + "/static/{name}", routes.static)
    r.add_get(DASHBOARD_PATH + "/events", routes.events)
    r.add_get(DASHBOARD_PATH + "/snapshot", routes.snapshot)

    async def lifespan(_: web.Application) -> AsyncIterator[None]:
        feed.start()
        try:
            yield
        finally:
            await feed.stop()

    async def end_streams(_: web.Application) -> None:
        feed.close_subscribers()

    app.cleanup_ctx.append(lifespan)
    app.on_shutdown.append(end_streams)
