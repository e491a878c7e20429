"""The gateway's HTTP server: client timeouts, the connection cap, protocol errors.

aiohttp's server, as it comes, keeps a connection for as long as the client
likes: a request's headers or body may arrive one byte a minute, an idle
keep-alive connection lives an hour, and connections are accepted until the
process runs out of file descriptors, at which point the pollers and the
upstream connections fail too and healthy engines are marked down. This
module runs the same application with the bounds of ``limits``
(:class:`~prefixrouter.gateway.config.LimitsConfig`):

* **header timeout**: a request's line and headers must all arrive within
  ``header_timeout_s`` of its first byte (of the connection's opening, for
  the first request); else a 408 and the connection closes.
* **body timeouts**: the body must make progress every
  ``body_idle_timeout_s`` and be complete ``body_timeout_s`` after the
  headers. A handler reading it gets :class:`~.errors.RequestTimeout` (408
  in OpenAI's shape) and the connection closes after the answer; while the
  gateway itself has paused reading (its handler is behind), the body counts
  as making progress.
* **keep-alive timeout**: aiohttp's own ``keepalive_timeout``, which closes a
  connection idle between requests (or holding a partial next request:
  pipelined heads are bounded by it, not by the header timeout).
* **connection cap**: past ``max_connections`` open client connections (lowered
  to what ``RLIMIT_NOFILE`` allows, see :func:`connection_cap`) a new
  connection is answered a minimal 503 and closed at once.
* **protocol errors** (a malformed request, an oversized request line or
  header, too many headers) are answered in OpenAI's JSON shape with their
  own status (400, 414, 431), logged on one debug line without the offending
  bytes and never with a traceback.

One timer per connection carries every deadline: a deadline that moves later
(a body making progress) only updates a float, and the timer, when it fires
early, re-arms itself for the current deadline; no per-chunk timer churn.

:func:`start_server` runs an application this way; ``prefixrouter serve``
(:func:`prefixrouter.gateway.cli.run_gateway`) and the tests use it.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    LineTooLong,
)
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from prefixrouter.addresses import listen_problem
from prefixrouter.errors import PrefixRouterError
from prefixrouter.gateway.config import LimitsConfig
from prefixrouter.gateway.errors import JSON, RequestTimeout, error_body

log = logging.getLogger("prefixrouter.gateway")

# A refused connection is answered and closed at once: it must not itself
# hold a descriptor for long. Its socket is shut for writing after the 503
# and closed when the client closes or after this long, so the client reads
# the answer instead of a reset.
_REFUSE_LINGER_S = 1.0
# Refused connections open at once; past it a new one is closed unanswered.
# Each lives a round trip (1 s at most), so this answers a burst of clients
# while taking no more than this many descriptors from ``fd_reserve``.
_MAX_REFUSING = 32


class ListenError(PrefixRouterError):
    """The gateway cannot listen on its address (in use, not permitted, unknown)."""


@dataclass(frozen=True, slots=True)
class Listening:
    """A running server.

    Attributes:
        runner: Its runner (``await runner.cleanup()`` stops it).
        host: The listen address.
        port: The bound port (the real one when port 0 was asked).
        max_connections: The connection cap in force.
    """

    runner: web.AppRunner
    host: str
    port: int
    max_connections: int


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A complete HTTP/1.1 response that closes the connection (written to the socket as is)."""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {JSON}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_RAW_408 = _raw_response(
    408,
    "Request Timeout",
    error_body(
        "the request's headers did not arrive in time", "invalid_request_error", "request_timeout"
    ),
)
_RAW_503 = _raw_response(
    503,
    "Service Unavailable",
    error_body(
        "the gateway is serving its maximum number of connections; retry later",
        "service_unavailable",
        "too_many_connections",
    ),
)


def connection_cap(limits: LimitsConfig, raise_soft: bool = True) -> int:
    """The connection cap in force: ``max_connections``, or less where descriptors are short.

    Each client connection with a request in flight holds a second
    descriptor for its upstream connection, and ``fd_reserve`` more are kept
    for everything else, so ``2 * cap + fd_reserve`` must fit the soft
    ``RLIMIT_NOFILE``. With ``raise_soft`` the soft limit is first raised
    toward the hard one (as far as that takes), which an unprivileged process
    may do.
    """
    want = 2 * limits.max_connections + limits.fd_reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if raise_soft and soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # pragma: no cover - platform refuses: keep the old limit
            pass
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, (soft - limits.fd_reserve) // 2))


def protocol_error(exc: HttpProcessingError, request_line_done: bool) -> tuple[int, str, str]:
    """(status, code, message) of a request the HTTP parser rejected.

    The message never quotes the request: aiohttp's own carries up to 100
    bytes of the offending line, which may be a credential.

    Args:
        exc: The parser's exception.
        request_line_done: The request line had ended within its limit, so an
            oversized line is a header (431), not the request line (414).
    """
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "?"
        if request_line_done:
            return 431, "header_too_large", f"a request header is longer than {limit} bytes"
        return 414, "request_line_too_long", f"the request line is longer than {limit} bytes"
    if isinstance(exc, BadHttpMessage) and exc.message.startswith("Too many headers"):
        return 431, "too_many_headers", "the request has too many headers"
    if isinstance(exc, BadStatusLine):
        return 400, "bad_request_line", "malformed HTTP request line"
    if isinstance(exc, InvalidHeader):
        return 400, "bad_header", "malformed HTTP header"
    return 400, "bad_http_request", f"malformed HTTP request ({type(exc).__name__})"


class GatewayProtocol(RequestHandler):
    """aiohttp's request handler with header and body deadlines and JSON protocol errors.

    Deadlines (``loop.time()`` values, 0 = none): ``_head_deadline`` while a
    request's head is arriving and nothing else is in progress; while a body
    arrives, ``min(_body_seen + idle, _body_start + total)`` is computed when
    the timer fires.
    """

    __slots__ = (
        "_body",
        "_body_seen",
        "_body_start",
        "_head_deadline",
        "_limits",
        "_line_bytes",
        "_line_open",
        "_on_lost",
        "_timer",
        "_timer_at",
    )

    def __init__(
        self,
        manager: Server,
        limits: LimitsConfig,
        on_lost: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._on_lost: Callable[[], None] | None = on_lost
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._head_deadline = 0.0
        self._body: StreamReader | None = None
        self._body_start = 0.0
        self._body_seen = 0.0
        # Whether the current request line has not ended yet, and its length so far:
        # tells an oversized request line (414) from an oversized header (431).
        self._line_open = True
        self._line_bytes = 0

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_deadline = self._loop.time() + self._limits.header_timeout_s
        self._arm(self._head_deadline)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._body = None
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._line_open and self._body is None:
            nl = data.find(b"\n")
            if nl < 0:
                self._line_bytes += len(data)
            else:
                self._line_bytes += nl
                self._line_open = False
        seen = self._request_count
        super().data_received(data)
        if self._request_count != seen:  # the head of one or more requests is complete
            self._head_deadline = 0.0
            message, payload = self._messages[-1] if self._messages else (None, None)
            if isinstance(message, RawRequestMessage):  # not a parse error (handle_error reads)
                self._line_open, self._line_bytes = True, 0
            if payload is not None and payload is not EMPTY_PAYLOAD and not payload.is_eof():
                now = self._loop.time()
                self._body, self._body_start, self._body_seen = payload, now, now
                self._arm(now + min(self._limits.body_idle_timeout_s, self._limits.body_timeout_s))
            else:
                self._body = None
        elif self._body is not None:
            if self._body.is_eof():
                self._body = None
            else:
                self._body_seen = self._loop.time()
        elif (
            not self._head_deadline
            and data
            and self._current_request is None
            and not self._messages
        ):
            # The first bytes of a new request on a kept-alive connection.
            self._head_deadline = self._loop.time() + self._limits.header_timeout_s
            self._arm(self._head_deadline)
        if self._body is not None and self._body.exception() is not None:
            # A body that is not what its headers say (Content-Encoding: gzip
            # that is not gzip): the parser stops there, so the connection
            # closes after the answer. Draining it (lingering) would meet the
            # error again and log it as an unhandled exception with a traceback
            # of some 35 lines, which any client could add to the log at will.
            self._body = None
            self._lingering_time = 0.0

    # ------------------------------------------------------------------ deadlines

    def _arm(self, when: float) -> None:
        """Make the timer fire at ``when`` at the latest."""
        if self._timer is not None:
            if self._timer_at <= when:
                return  # it fires first and re-arms for the deadline then in force
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport is None:
            return
        now = self._loop.time()
        body = self._body
        if body is not None:
            if body.is_eof():
                self._body = None
            else:
                if self._reading_paused:
                    # The gateway, not the client, holds the body back.
                    self._body_seen = now
                lim = self._limits
                deadline = min(
                    self._body_seen + lim.body_idle_timeout_s, self._body_start + lim.body_timeout_s
                )
                if now >= deadline:
                    self._body_timed_out(body)
                else:
                    self._arm(deadline)
                return
        if self._head_deadline:
            if self._current_request is not None or self._messages:
                self._head_deadline = 0.0  # a request is in progress: not a head
            elif now >= self._head_deadline:
                log.debug("closing a connection from %s: headers timed out", self.peername)
                self._head_deadline = 0.0
                transport = self.transport
                transport.write(_RAW_408)
                self.force_close()
            else:
                self._arm(self._head_deadline)

    def _body_timed_out(self, body: StreamReader) -> None:
        self._body = None
        log.debug("cutting a request body from %s: it timed out", self.peername)
        if self._current_request is None:
            # Not handled yet, or handled and being drained: nobody waits for it.
            self.force_close()
            return
        # The handler reading it gets a 408 to answer; the connection closes
        # after that answer instead of draining the rest (lingering).
        self._lingering_time = 0.0
        body.set_exception(RequestTimeout("the request body did not arrive in time"))

    # ------------------------------------------------------------------ errors

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """An OpenAI-shaped answer for a request aiohttp could not parse or handle."""
        if isinstance(exc, HttpProcessingError):
            line_done = not self._line_open and self._line_bytes <= self.max_line_size
            status, code, text = protocol_error(exc, line_done)
            type_ = "invalid_request_error"
            log.debug(
                "rejected a request from %s: %d %s", request.remote, status, type(exc).__name__
            )
        elif status == 504:
            code, text, type_ = "gateway_timeout", "the request timed out", "timeout_error"
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            status, code, text, type_ = 500, "internal_error", "internal error", "internal_error"
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; the error cannot be sent")
        resp = web.Response(status=status, body=error_body(text, type_, code), content_type=JSON)
        resp.force_close()
        return resp


class _Refused(asyncio.Protocol):
    """A connection past the cap: a 503, shut for writing, closed soon after."""

    def __init__(self, server: GatewayServer) -> None:
        self._server = server
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is one without subclassing asyncio.Transport).
        transport = cast(asyncio.Transport, transport)
        transport.write(_RAW_503)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_REFUSE_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it is refused

    def eof_received(self) -> bool:
        return False  # the client has read the answer and closed: close

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server.refused_open -= 1


class GatewayServer(Server):
    """aiohttp's low-level server making :class:`GatewayProtocol` connections, up to a cap.

    Connections are counted when their protocol is made (the accept loop may
    take many connections before any is set up, so counting later would let
    a burst past the cap) and uncounted when they are lost. (A protocol whose
    transport then fails to be made is never lost, and stays counted: event
    loops do that only on errors rarer than the cap is wide.)
    """

    def __init__(self, *args: Any, limits: LimitsConfig, cap: int, **kwargs: Any) -> None:
        kwargs["keepalive_timeout"] = limits.keepalive_timeout_s
        kwargs["max_line_size"] = limits.max_request_line_bytes
        kwargs["max_field_size"] = limits.max_header_bytes
        kwargs["max_headers"] = limits.max_headers
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.cap = cap
        self.open = 0
        self.refused = 0
        self.refused_open = 0

    def _lost(self) -> None:
        self.open -= 1

    def __call__(self) -> Any:  # a RequestHandler, or a refusal past the cap
        if self.open >= self.cap:
            self.refused += 1
            if self.refused_open >= _MAX_REFUSING:
                # Even refusals would eat the reserve: close without an answer.
                return _Dropped()
            self.refused_open += 1
            return _Refused(self)
        self.open += 1
        return GatewayProtocol(self, self.limits, self._lost, loop=self._loop, **self._kwargs)


class _Dropped(asyncio.Protocol):
    """A connection closed unanswered (refusals themselves are at their bound)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()


class GatewayRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose server is a :class:`GatewayServer`."""

    def __init__(self, app: web.Application, limits: LimitsConfig, cap: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self._cap = cap

    async def _make_server(self) -> Server:
        base = await super()._make_server()  # starts the app; its kwargs are the handler's
        return GatewayServer(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=asyncio.get_running_loop(),
            limits=self._limits,
            cap=self._cap,
            **base._kwargs,
        )


async def start_server(
    app: web.Application, host: str, port: int, limits: LimitsConfig, backlog: int = 2048
) -> Listening:
    """Start ``app`` (its startup and cleanup contexts too) and listen on ``host:port``.

    Raises:
        ListenError: The address cannot be bound; the app is stopped again.
    """
    cap = connection_cap(limits)
    if cap < limits.max_connections:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "limits.max_connections %d lowered to %d: the file-descriptor limit (%d) less "
            "limits.fd_reserve (%d) leaves two descriptors a connection for no more; raise "
            "the limit (ulimit -n) or lower limits.fd_reserve",
            limits.max_connections,
            cap,
            soft,
            limits.fd_reserve,
        )
    runner = GatewayRunner(app, limits, cap, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(listen_problem(host, port, exc)) from None
    bound = port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        bound = sockets[0].getsockname()[1]
    return Listening(runner, host, bound, cap)
