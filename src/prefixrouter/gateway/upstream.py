"""The proxy's upstream client: lean HTTP/1.1 keep-alive connections to the workers.

Why not aiohttp's client (which the health and metrics pollers still use):
per request it builds a ``ClientRequest`` and a ``ClientResponse``, starts a
task to write the body, parses the URL, and enters timer and trace contexts.
On this project's 2-core reference machine that costs about 60 µs of CPU,
which is a third of what a whole proxied request costs. The proxy needs much
less:

1. POST a prebuilt body to a known worker;
2. read the status and headers;
3. read the body, either whole or chunk by chunk as it arrives.

This module does that directly on asyncio protocols, with ``httptools``
(llhttp, the parser behind Node.js and uvicorn) parsing the responses:
Content-Length, chunked transfer encoding, or read-until-close bodies. It
costs about a third as much.

**Connections.** Each :class:`Endpoint` (scheme, host, port) keeps a stack of
idle connections, and the most recently used one is taken first. A
connection goes back to the stack only when:

* its response was read to the end, and
* both sides allowed keep-alive.

A response abandoned midway closes its connection, which is how an engine
learns to abort a request whose client left. A connection that the server
closes while idle leaves the stack at once. A connection idle for longer
than ``keepalive_s`` is closed rather than reused. The default of 4 s stays
below uvicorn's 5 s keep-alive, which vLLM and SGLang use. Without that
margin, a request could be written into a socket that the server is just
closing, and that POST would fail although the worker is fine. Like
aiohttp, this client never resends a POST on its own.

**Timeouts.**

* ``connect_timeout_s`` applies to each new connection.
* ``total_timeout_s`` runs from sending the request until its body has been
  read. When it expires, a timer closes the connection, and whoever is
  waiting gets a :class:`TotalTimeout` (a :class:`TimeoutError`, as is a
  connect that takes too long: the caller tells the two apart, since a
  request that ran out of time was being worked on and must not be sent again).
* ``first_byte_timeout_s`` (per request, optional) runs from sending the
  request until the first *body* byte arrives (a stream's headers come at
  once, its first event only after the prefill; a non-streamed answer comes
  whole at the end). When it expires the connection is closed and the waiter
  gets a :class:`FirstByteTimeout`: nothing has been relayed yet, so the
  caller may retry elsewhere.
* ``stall_timeout_s`` (per client, optional) bounds the silence between body
  bytes once the first one arrived; it raises :class:`StallTimeout`. Time
  during which the reader is behind (reading paused by flow control) is not
  silence.

Both watch for a *silent worker*, not a slow request: when a deadline
passes while the worker has sent bytes on another connection, or answered
a health check (:meth:`UpstreamClient.heard_from`), within that window, the
deadline moves to one window after the last sign of life. A request queued
behind others on a busy engine (an engine admits in order; a CPU engine's
long prefill stalls every stream) therefore waits, as it must: a retry
elsewhere would copy its prefill onto a second engine and a cut stream
loses its answer. A frozen or hung engine is silent on every connection
and is cut one window after its last byte.

Both watchdogs share one timer per request that is re-armed lazily: an
arriving body chunk only records its arrival time, and the timer, when it
fires, either finds the deadline moved (and re-arms for it) or closes the
connection. A steady stream therefore costs one clock read per chunk and
one timer wake-up per ``stall_timeout_s``.

**Per-request headers.** The fixed header block (``Host``, ``Content-Type``,
the worker's API key) is built once per :class:`Endpoint`; what changes per
request (the request id and the client's W3C trace context,
:func:`forwarded_headers`) is one small preformatted block that the proxy
builds once per request and sends on every attempt, so a retry on another
worker carries the same id.

**Flow control.** A body that arrives faster than the reader takes it
buffers at most ``high_water_bytes``; then reading from the socket pauses
until the reader has drained the buffer to half of that.

**Errors.** Refused or failed connects raise :class:`OSError` (or
:class:`TimeoutError`). Anything that goes wrong on an open connection raises
:class:`UpstreamError`, which is a :class:`ConnectionError`. Examples are a
close before or during the response, and a response that is not HTTP.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

DEFAULT_KEEPALIVE_S = 4.0
DEFAULT_HIGH_WATER_BYTES = 256 * 1024
TRACE_HEADER_MAX_CHARS = 512
"""The longest ``traceparent`` / ``tracestate`` passed on (W3C Trace Context:
vendors need only propagate 512 characters of ``tracestate``)."""


def _trace_safe(value: str) -> bool:
    """A trace header that is safe to copy into a request head: 1 to
    :data:`TRACE_HEADER_MAX_CHARS` printable ASCII characters (spaces allowed:
    ``tracestate`` members may be separated by them), so no CR/LF can split the head."""
    # isascii + isprintable: exactly " " to "~", in C (a generator over the
    # characters cost 4 µs per traced request).
    return 0 < len(value) <= TRACE_HEADER_MAX_CHARS and value.isascii() and value.isprintable()


def forwarded_headers(
    request_id: str, traceparent: str | None = None, tracestate: str | None = None
) -> bytes:
    """The per-request header lines sent to the engine (each ending in CRLF).

    * ``X-Request-Id``: the id the client gets back in its ``X-Request-Id``
      (its own when sane, :func:`~prefixrouter.gateway.access_log.client_request_id`,
      else the gateway's). vLLM uses it as its request id (the answer's ``id``
      becomes ``chatcmpl-<id>``, its logs and aborts name it), so engine logs
      and the gateway's decision and access logs can be matched.
    * ``traceparent`` and ``tracestate`` (W3C Trace Context), as the client
      sent them, when sane (:func:`_trace_safe`): vLLM continues the client's
      OpenTelemetry trace from them. ``tracestate`` without a ``traceparent``
      means nothing (the specification says to drop it) and is not sent.

    ``request_id`` must already be a sane token (printable ASCII, no CR/LF).
    """
    block = b"X-Request-Id: " + request_id.encode("ascii") + b"\r\n"
    if traceparent is not None and _trace_safe(traceparent):
        block += b"traceparent: " + traceparent.encode("ascii") + b"\r\n"
        if tracestate is not None and _trace_safe(tracestate):
            block += b"tracestate: " + tracestate.encode("ascii") + b"\r\n"
    return block


class UpstreamError(ConnectionError):
    """The connection to a worker failed after it was opened."""


class FirstByteTimeout(TimeoutError):
    """No body byte arrived within the request's first-byte timeout (safe to retry)."""


class StallTimeout(TimeoutError):
    """The body stopped arriving for longer than the stall timeout."""


class TotalTimeout(TimeoutError):
    """The request's total timeout expired (the engine may still be working on it)."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One endpoint's connections.

    Attributes:
        opened: Connections opened since the client started.
        idle: Pooled connections waiting for a request.
        busy: Connections carrying a request now.
    """

    opened: int
    idle: int
    busy: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to reach one worker.

    Attributes:
        scheme: ``http`` or ``https``.
        host: Host name or address to connect to.
        port: TCP port.
        base_path: Path prefix of the worker's API (``""`` or ``/prefix``).
        header_lines: The fixed request header lines: ``Host``, ``Content-Type``
            and the worker's own headers (an API key), each ending in CRLF.
    """

    scheme: str
    host: str
    port: int
    base_path: str
    header_lines: bytes

    @classmethod
    def from_url(cls, url: str, headers: dict[str, str] | None = None) -> Endpoint:
        """Parse a worker's base URL (``http[s]://host[:port][/prefix]``).

        Raises:
            ValueError: The URL has another scheme or no host.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        lines = [f"Host: {parts.netloc}", "Content-Type: application/json"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        block = "".join(line + "\r\n" for line in lines).encode("latin-1")
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), block)

    def request_head(self, path: str, body_length: int, extra: bytes = b"") -> bytes:
        """The request line and headers of a POST of ``body_length`` bytes to ``path``.

        ``extra``: the request's own header lines (:func:`forwarded_headers`),
        after the endpoint's fixed ones.
        """
        return b"POST %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n" % (
            (self.base_path + path).encode("latin-1"),
            self.header_lines,
            extra,
            body_length,
        )


@dataclass(slots=True)
class UpstreamResponse:
    """A worker's response: status and headers now, the body as it arrives.

    Read the body with :meth:`read` (whole) or :meth:`readany` (chunk by
    chunk), then call :meth:`release` (the connection may be reused if the
    body was read to the end) or :meth:`close` (the request is abandoned).

    Attributes:
        status: HTTP status code.
        headers: Response headers, names in lower case (a repeated header keeps its last value).
    """

    status: int
    headers: dict[str, str]
    _conn: _Connection = field(repr=False)
    _ended: bool = field(default=False, repr=False)

    @property
    def content_type(self) -> str:
        """The media type without parameters (``""`` if the worker sent none)."""
        value = self.headers.get("content-type", "")
        return value.split(";", 1)[0].strip().lower()

    async def readany(self) -> bytes:
        """The next part of the body as it arrived; ``b""`` once the body is complete.

        Raises:
            UpstreamError: The connection broke before the body was complete.
            FirstByteTimeout: No body byte within the request's first-byte timeout.
            StallTimeout: The body stopped arriving (the client's stall timeout).
            TotalTimeout: The total timeout expired.
        """
        return await self._conn.next_chunk()

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        parts: list[bytes] = []
        while chunk := await self._conn.next_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def buffered_bytes(self) -> int:
        """Body bytes received and not read yet (bounded by flow control)."""
        return self._conn.buffered

    def release(self) -> None:
        """Done with the response: reuse the connection if it is clean, else close it."""
        self._end(reusable=True)

    def close(self) -> None:
        """Abandon the response and close its connection (the worker aborts the request)."""
        self._end(reusable=False)

    def _end(self, reusable: bool) -> None:
        # Once only: after a release the connection may already carry another
        # request, which a second release (or a late close) must not touch.
        if not self._ended:
            self._ended = True
            self._conn.finish(reusable)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time.

    httptools calls the ``on_*`` methods from ``feed_data`` while this
    protocol's ``data_received`` runs.
    """

    def __init__(self, client: UpstreamClient, endpoint: Endpoint) -> None:
        self.client = client
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: dict[str, str] = {}
        self._head: asyncio.Future[int] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._deadline: asyncio.TimerHandle | None = None
        # The first-byte / stall watchdog (see the module docstring).
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = 0.0
        self._first_byte_s: float | None = None
        self._sent_at = 0.0
        self._last_data = 0.0
        self._received_at = 0.0  # loop time of the last read from the socket
        self._got_body = False
        self._until_close = False  # a body without length or chunking: it ends at close
        self._informational = False  # a 1xx interim response, before the real one

    @property
    def buffered(self) -> int:
        """Body bytes received and not read yet."""
        return self._buffered

    # ------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        # One clock read per read from the socket: the worker's sign of life
        # (the timeouts' liveness) and, in on_body, this body's arrival time.
        now = self._received_at = self._now()
        self.client._heard[self.endpoint] = now
        parser = self._parser
        if parser is None:
            # Bytes while no request is outstanding: the connection is not clean.
            self._abort(UpstreamError("unexpected bytes from the worker between responses"))
            return
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._abort(UpstreamError(f"invalid HTTP response from the worker: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        if self._parser is None or self._complete:
            return
        if self._head is not None and self._head.done() and self._until_close:
            self._message_done(keep_alive=False)
            return
        if self._head is None or not self._head.done():
            why = "closed the connection before answering"
        else:
            why = "closed the connection before the response was complete"
        self._fail(UpstreamError(f"the worker {why}" + (f": {exc}" if exc else "")))

    # ----------------------------------------------------------- httptools

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None and self._head is not None
        status = self._parser.get_status_code()
        if status < 200:
            # An interim response (100 Continue, 103 Early Hints): the real one follows.
            self._informational = True
            self._headers = {}
            return
        headers = self._headers
        chunked = "chunked" in headers.get("transfer-encoding", "")
        self._until_close = "content-length" not in headers and not chunked
        if not self._head.done():
            self._head.set_result(status)

    def on_body(self, body: bytes) -> None:
        if self._got_body:
            self._last_data = self._received_at
        else:
            self._first_body()
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > self.client.high_water_bytes and not self._paused:
            self._paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        if self._informational:
            self._informational = False
            return
        self._message_done(self._parser.should_keep_alive())

    # -------------------------------------------------------------- request

    async def request(
        self, head: bytes, body: bytes, timeout_s: float, first_byte_s: float | None = None
    ) -> UpstreamResponse:
        """Send one request and wait for the response's status and headers."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._headers = {}
        self._chunks.clear()
        self._buffered = 0
        self._complete = self._keep_alive = self._until_close = self._informational = False
        self._error = None
        self._head = loop.create_future()
        self._deadline = loop.call_later(timeout_s, self._timed_out, timeout_s)
        self._got_body = False
        self._first_byte_s = first_byte_s
        if first_byte_s is not None and first_byte_s < timeout_s:
            self._sent_at = loop.time()
            self._watch_at = self._sent_at + first_byte_s
            self._watch = loop.call_at(self._watch_at, self._watchdog)
        self.transport.writelines((head, body))
        try:
            status = await self._head
        except BaseException:
            self.finish(reusable=False)  # cancelled or failed: the worker must abort
            raise
        return UpstreamResponse(status, self._headers, self)

    async def next_chunk(self) -> bytes:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= self.client.high_water_bytes // 2:
                    self._paused = False
                    self._last_data = self._now()  # the silence counts from here
                    if self.transport is not None and not self.closed:
                        self.transport.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def finish(self, reusable: bool) -> None:
        """End the request: back to the pool if clean and complete, else close."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._unwatch()
        clean = (
            reusable
            and self._complete
            and self._keep_alive
            and self._error is None
            and not self._chunks
            and not self.closed
        )
        self._parser = None
        self._head = None
        self._chunks.clear()
        if clean:
            self.client._put_back(self)
        else:
            self._abort(None)

    # ------------------------------------------------------------- internal

    def _message_done(self, keep_alive: bool) -> None:
        self._complete = True
        self._keep_alive = keep_alive
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._unwatch()
        self._wake()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _first_body(self) -> None:
        """The first body byte: the first-byte watch ends, the stall watch starts."""
        self._got_body = True
        stall_s = self.client.stall_timeout_s
        if stall_s is None:
            self._unwatch()
            return
        loop = asyncio.get_running_loop()
        now = self._last_data = self._received_at
        if self._watch is not None and self._watch_at <= now + stall_s:
            # The first-byte timer fires before the stall deadline: it finds the
            # body and re-arms for that deadline. A body that ends before then
            # (a whole answer) costs no second timer.
            return
        self._unwatch()
        self._watch_at = now + stall_s
        self._watch = loop.call_at(self._watch_at, self._watchdog)

    def _watchdog(self) -> None:
        """The first-byte or stall deadline may have passed: re-arm or give up."""
        self._watch = None
        if self._parser is None or self._complete:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        error: TimeoutError
        if self._got_body:
            stall_s = self.client.stall_timeout_s
            assert stall_s is not None
            if self._paused:
                self._last_data = now  # we stopped reading: not the worker's silence
            window = stall_s
            due = self._last_data + stall_s
            error = StallTimeout(f"the worker sent nothing for {stall_s:g} s")
        else:
            first_byte_s = self._first_byte_s
            assert first_byte_s is not None
            window = first_byte_s
            due = self._sent_at + first_byte_s
            error = FirstByteTimeout(
                f"the worker sent no first byte within {first_byte_s:g} s and was silent"
                " on every connection meanwhile"
            )
        if now >= due:
            # Past this request's deadline: cut it only if the worker is silent
            # to everyone too (see the module docstring).
            client = self.client
            liveness = client.liveness_s if client.liveness_s > window else window
            heard = client.last_heard(self.endpoint) + liveness
            due = heard if heard > due else due
        if now < due:
            self._watch_at = due
            self._watch = loop.call_at(due, self._watchdog)
            return
        self._abort(error)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _timed_out(self, timeout_s: float) -> None:
        self._deadline = None
        self._abort(TotalTimeout(f"the worker did not complete its answer within {timeout_s:g} s"))

    def _abort(self, error: BaseException | None) -> None:
        if error is not None:
            self._fail(error)
        self.closed = True
        self.client._forget(self)
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class UpstreamClient:
    """Keep-alive connections to the workers, for the proxy's requests.

    Args:
        connect_timeout_s: Time allowed to open a connection.
        total_timeout_s: Time allowed from sending a request to the end of its body.
        stall_timeout_s: Longest silence allowed between body bytes after the
            first (None: only the total timeout applies).
        keepalive_s: An idle connection older than this is closed, not reused.
        liveness_s: Longest silence of a live worker (the gap between two of
            its passed health checks): the first-byte and stall timeouts cut a
            request only once its worker has been silent at least this long.
        high_water_bytes: Body bytes buffered per connection before reading pauses.
        ssl_context: TLS settings for ``https`` workers (default: the system's
            trusted CAs, with ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured).
    """

    def __init__(
        self,
        connect_timeout_s: float,
        total_timeout_s: float,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        stall_timeout_s: float | None = None,
        liveness_s: float = 0.0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.liveness_s = liveness_s
        self.total_timeout_s = total_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.keepalive_s = keepalive_s
        self.high_water_bytes = high_water_bytes
        self._idle: dict[Endpoint, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._ssl = ssl_context
        self._opened: dict[Endpoint, int] = {}
        self._heard: dict[Endpoint, float] = {}  # endpoint -> last sign of life (loop time)

    async def post(
        self,
        endpoint: Endpoint,
        path: str,
        body: bytes,
        first_byte_timeout_s: float | None = None,
        headers: bytes = b"",
    ) -> UpstreamResponse:
        """POST ``body`` (JSON) to ``path`` on ``endpoint``; returns once the headers are in.

        Args:
            endpoint: The worker.
            path: The API path (``/v1/chat/completions``).
            body: The JSON body.
            first_byte_timeout_s: Time allowed from sending until the first
                body byte (None: only the total timeout).
            headers: The request's own header lines (:func:`forwarded_headers`).

        Raises:
            OSError: The connection could not be opened (refused, unreachable).
            FirstByteTimeout: No body byte within ``first_byte_timeout_s``
                (also from the response's first read).
            TotalTimeout: No answer within the total timeout.
            TimeoutError: Connecting took too long.
            UpstreamError: The connection broke or the answer was not HTTP.
        """
        conn = self._take_idle(endpoint)
        if conn is None:
            conn = await self._connect(endpoint)
        return await conn.request(
            endpoint.request_head(path, len(body), headers),
            body,
            self.total_timeout_s,
            first_byte_timeout_s,
        )

    def heard_from(self, endpoint: Endpoint, alive: bool = True) -> None:
        """What the worker showed now: alive (bytes, a passed health check) or not.

        The first-byte and stall timeouts cut a request only once its worker
        has been silent for their window (at least ``liveness_s``; see the
        module docstring). A failed health check (``alive=False``) ends the
        benefit of the doubt: the requests waiting on the worker are cut at
        their own deadlines.
        """
        self._heard[endpoint] = asyncio.get_running_loop().time() if alive else -math.inf

    def last_heard(self, endpoint: Endpoint) -> float:
        """When the worker last showed it is alive (loop time; -inf: never)."""
        return self._heard.get(endpoint, -math.inf)

    def idle_connections(self, endpoint: Endpoint) -> int:
        """Idle pooled connections to ``endpoint`` (for tests and inspection)."""
        return len(self._idle.get(endpoint, ()))

    def pool_stats(self, endpoint: Endpoint) -> PoolStats:
        """Connections to ``endpoint``: opened so far, idle and busy now.

        For the scrape-time metrics: a count of opened connections that keeps
        growing under steady traffic means keep-alive is not working (the
        engine closes connections, or ``keepalive_s`` is longer than the
        engine's keep-alive). It walks the open connections, so it is not
        meant for the request path.
        """
        idle = self.idle_connections(endpoint)
        open_ = sum(1 for c in self._open if c.endpoint == endpoint)
        return PoolStats(self._opened.get(endpoint, 0), idle, max(0, open_ - idle))

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        for conn in list(self._open):
            conn.finish(reusable=False)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks

    # ------------------------------------------------------------- internal

    def _take_idle(self, endpoint: Endpoint) -> _Connection | None:
        stack = self._idle.get(endpoint)
        if not stack:
            return None
        oldest_allowed = time.monotonic() - self.keepalive_s
        while stack:
            conn = stack.pop()  # most recently used first
            if not conn.closed and conn.idle_since >= oldest_allowed:
                return conn
            conn.finish(reusable=False)
        return None

    async def _connect(self, endpoint: Endpoint) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context: ssl.SSLContext | None = None
        if endpoint.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        conn = _Connection(self, endpoint)
        async with asyncio.timeout(self.connect_timeout_s):
            await loop.create_connection(
                lambda: conn, endpoint.host, endpoint.port, ssl=ssl_context
            )
        self._open.add(conn)
        self._opened[endpoint] = self._opened.get(endpoint, 0) + 1
        return conn

    def _put_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.endpoint, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        stack = self._idle.get(conn.endpoint)
        if stack and conn in stack:
            stack.remove(conn)
