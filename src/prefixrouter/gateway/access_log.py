"""The access log: one JSON line per HTTP request, written off the event loop.

Optional: ``access_log.path`` in the configuration or ``prefixrouter serve
--access-log PATH``. Every request the gateway answers gets one line, errors
and refusals included, in the order requests end. The fields are stable
(new ones may be added; none is renamed or removed)::

    ts            arrival, Unix seconds (float, microseconds)
    end_ts        end of the response, Unix seconds
    request_id    the X-Request-Id the client got: its own when it sent a
                  sane one (:func:`client_request_id`), else the gateway's
    method, path  the request line (path without the query string)
    status        the HTTP status; for a stream that broke after its first
                  byte the status the gateway recorded (502, 504), 499 when
                  the client went away
    tenant        the tenant its key (or trusted X-Tenant) names ("" anonymous),
                  null where none was resolved (a bad key; not a completion
                  request). Never the API key
    priority      the request's priority (null when not admitted that far)
    worker        the worker that served it (null: none)
    tier          the routing decision's tier (null: not routed)
    cached_tokens the engine-reported prompt tokens it reused (null: not reported)
    prompt_tokens the engine-reported prompt length (null: not reported)
    ttft_ms       time to the first upstream byte of a stream (null: not streamed)
    queue_wait_ms time in the overload queue (0 when it did not wait)
    latency_ms    arrival to the end of the response
    stream        the client asked for a stream (null: not a completion request)
    error         the error code (OpenAI ``error.code``) or what went wrong; null on success

The hot path appends one small :class:`RequestNote` to a list; every
``flush_interval_s`` the flusher hands the batch to a thread, which renders it
and appends it to the file, so neither JSON encoding nor the write runs on
the event loop. Lines still buffered when the gateway stops are written at
its cleanup.

The file is a :class:`~prefixrouter.gateway.log_file.LogFile`, as the
decision log's: opened when the gateway starts (:meth:`AccessLog.open`), so
a path that cannot be written stops the start with one line naming
``access_log.path``; a write that fails later (a full disk) drops the batch,
counts it in :attr:`AccessLog.dropped` and warns once per outage, and the
next batch tries again. Buffered lines are bounded (:data:`MAX_PENDING`).

:func:`note_requests` is the middleware that makes each request's note and,
at its end, hands it to the per-tenant metrics and to this log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from prefixrouter.gateway.log_file import LogFile

log = logging.getLogger("prefixrouter.gateway")

MAX_PENDING = 100_000
"""Lines waiting for the file at most; past it new ones are dropped (and counted).

The flusher empties the list every ``flush_interval_s``; the bound keeps a
stalled write (a hung disk) from growing the process."""

FIELDS = (
    "ts",
    "end_ts",
    "request_id",
    "method",
    "path",
    "status",
    "tenant",
    "priority",
    "worker",
    "tier",
    "cached_tokens",
    "prompt_tokens",
    "ttft_ms",
    "queue_wait_ms",
    "latency_ms",
    "stream",
    "error",
)
"""The fields of every line, in their order (module docstring)."""


@dataclass(slots=True, eq=False)
class RequestNote:
    """What the gateway learns about one request while it serves it."""

    ts: float
    method: str
    path: str
    start: float = 0.0
    end_ts: float = 0.0
    latency_s: float = 0.0
    request_id: str | None = None
    status: int | None = None
    tenant: str | None = None
    priority: int | None = None
    worker: str | None = None
    tier: str | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    ttft_s: float | None = None
    queue_wait_s: float = 0.0
    stream: bool | None = None
    error: str | None = None


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1e3, 3) if seconds is not None else None


def render(note: RequestNote) -> dict[str, Any]:
    """One access-log line (the fields of :data:`FIELDS`)."""
    return {
        "ts": round(note.ts, 6),
        "end_ts": round(note.end_ts, 6),
        "request_id": note.request_id,
        "method": note.method,
        "path": note.path,
        "status": note.status,
        "tenant": note.tenant,
        "priority": note.priority,
        "worker": note.worker,
        "tier": note.tier,
        "cached_tokens": note.cached_tokens,
        "prompt_tokens": note.prompt_tokens,
        "ttft_ms": _ms(note.ttft_s),
        "queue_wait_ms": _ms(note.queue_wait_s),
        "latency_ms": _ms(note.latency_s),
        "stream": note.stream,
        "error": note.error,
    }


def _lines(batch: list[RequestNote]) -> list[bytes]:
    out = []
    for note in batch:
        try:
            out.append(orjson.dumps(render(note)) + b"\n")
        except (TypeError, orjson.JSONEncodeError):  # a path that is not UTF-8
            log.warning("access log: dropped a line that is not JSON-serializable")
    return out


class AccessLog:
    """Buffered JSON lines appended to ``path`` by a thread (module docstring).

    Args:
        path: The file (appended; its folder is made).
        flush_interval_s: How often the buffer is written.
    """

    def __init__(self, path: Path, flush_interval_s: float = 1.0) -> None:
        self.path = path
        self.flush_interval_s = flush_interval_s
        self._pending: list[RequestNote] = []
        self._file = LogFile(path, "access log", "access_log.path")

    @property
    def written(self) -> int:
        """Lines written to the file."""
        return self._file.written

    @property
    def dropped(self) -> int:
        """Lines that never reached the file (module docstring)."""
        return self._file.dropped

    def open(self) -> None:
        """Open the file for append now (the gateway's startup).

        Raises:
            ConfigError: It cannot be opened for append; the message names
                ``access_log.path``, the path and why.
        """
        self._file.open()

    def record(self, note: RequestNote) -> None:
        """Keep one finished request's line (the hot path: one append)."""
        if len(self._pending) < MAX_PENDING:
            self._pending.append(note)
        else:
            self._file.dropped += 1

    def _write(self, batch: list[RequestNote]) -> None:
        """Render and append ``batch`` (on the flusher's thread, or at close); never raises
        :class:`OSError` (a failed write is dropped and counted, module docstring)."""
        self._file.write(_lines(batch))

    def take(self) -> list[RequestNote]:
        """The buffered notes, emptying the buffer."""
        batch, self._pending = self._pending, []
        return batch

    async def run(self) -> None:
        """Write the buffer on a thread every ``flush_interval_s`` until cancelled; then close."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(self.flush_interval_s)
                batch = self.take()
                if batch:
                    try:
                        await loop.run_in_executor(None, self._write, batch)
                    except Exception:  # a bug in one batch must not stop the flusher for good
                        log.exception("access log: flush failed")
        finally:
            self.close()

    def close(self) -> None:
        """Write what is buffered and close the file; never raises (the shutdown path)."""
        try:
            batch = self.take()
            if batch:
                self._write(batch)
        except Exception:  # the cleanup after it must run
            log.exception("access log: flush failed")
        self._file.close()


MAX_REQUEST_ID_CHARS = 128
"""The longest client ``X-Request-Id`` the gateway keeps."""


def client_request_id(value: str | None) -> str | None:
    """A client's ``X-Request-Id`` if it is a sane token, else None (the gateway makes one).

    Sane: 1 to :data:`MAX_REQUEST_ID_CHARS` printable ASCII characters, no
    space. Kept, the client's id is echoed in the response and written in the
    logs, so a request can be followed end to end; anything else (a long or
    binary value, one that would split a log line) is not echoed anywhere.
    The router still routes under an id of the gateway's own, unique per
    request (a client may send the same id twice); the decision log has both.
    """
    if value and len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value):
        return value
    return None


NOTE = web.RequestKey("prefixrouter_note", RequestNote)
"""Where a request keeps its :class:`RequestNote`."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def note_of(request: web.Request, clock: Callable[[], float] = time.monotonic) -> RequestNote:
    """The request's note (a fresh one outside :func:`note_requests`, as in unit tests)."""
    note = request.get(NOTE)
    if note is None:
        note = request[NOTE] = RequestNote(time.time(), request.method, request.path, clock())
    return note


def note_requests(
    done: Callable[[RequestNote], None],
    new_request_id: Callable[[], str],
    clock: Callable[[], float] = time.monotonic,
) -> Middleware:
    """The middleware: a note per request, ``done(note)`` at its end.

    A request's id is the client's own ``X-Request-Id`` when it is sane
    (:func:`client_request_id`), else a fresh one; a response that carries no
    ``X-Request-Id`` yet (anything but a completion the proxy routed) gets
    it, so every line's id is one a client saw (where the response was not
    already sent).
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        note = RequestNote(time.time(), request.method, request.path, clock())
        note.request_id = client_request_id(request.headers.get("X-Request-Id"))
        request[NOTE] = note
        try:
            resp = await handler(request)
        except asyncio.CancelledError:
            if note.status is None:
                note.status = 499
            raise
        except web.HTTPException as exc:
            note.status = exc.status
            raise
        except BaseException:
            note.status = 500
            raise
        else:
            if note.status is None:
                note.status = resp.status
            if note.request_id is None:
                note.request_id = resp.headers.get("X-Request-Id") or new_request_id()
            if not resp.prepared and "X-Request-Id" not in resp.headers:
                resp.headers["X-Request-Id"] = note.request_id
            return resp
        finally:
            note.end_ts = time.time()
            note.latency_s = clock() - note.start
            if note.request_id is None:
                note.request_id = new_request_id()
            try:
                done(note)
            except Exception:  # bookkeeping must not cost the client its answer
                log.exception("request bookkeeping failed")

    return middleware
