"""A lean HTTP/1.1 load generator for overhead measurements (raw asyncio protocols).

The client shares the machine's CPUs with the router it measures, so it must
cost little: no HTTP library, one keep-alive connection per request in flight,
requests pre-serialized. Responses are read by ``Content-Length`` or chunked
transfer encoding (peer routers relay upstream bodies either way).

* :func:`open_loop`: a fixed offered rate for a duration; each latency counts
  from the *scheduled* send time, so a router that falls behind is charged for
  the queue it builds (no coordinated omission);
* :func:`closed_loop`: ``connections`` clients back to back; completed requests
  per second is the router's throughput ceiling.

The same approach as ``benchmarks/gateway_overhead.py`` (our gateway only),
generalized to any router and any response framing.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from prefixrouter.stats import nearest_rank

_LENGTH = re.compile(rb"content-length: *(\d+)")
_CHUNKED = re.compile(rb"transfer-encoding: *chunked")


def build_requests(port: int, path: str, bodies: Sequence[bytes]) -> list[bytes]:
    """Serialized ``POST path`` requests with JSON ``bodies`` for ``127.0.0.1:port``."""
    head = (
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    )
    return [head.format(path=path, port=port, n=len(b)).encode() + b for b in bodies]


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def _complete(self) -> int:
        """Bytes of the first complete response in the buffer, or -1."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return -1
        head = bytes(self.buf[:end]).lower()
        self.status = int(head[9:12])
        m = _LENGTH.search(head)
        if m:
            need = end + 4 + int(m.group(1))
            return need if len(self.buf) >= need else -1
        if _CHUNKED.search(head):
            pos = end + 4
            while True:
                eol = self.buf.find(b"\r\n", pos)
                if eol < 0:
                    return -1
                size = int(bytes(self.buf[pos:eol]).split(b";")[0], 16)
                pos = eol + 2 + size + 2
                if len(self.buf) < pos:
                    return -1
                if size == 0:
                    return pos
        return end + 4  # no body

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None:
            return
        n = self._complete()
        if n >= 0:
            del self.buf[:n]
            w, self.waiter = self.waiter, None
            if not w.done():
                w.set_result(self.status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))
        self.transport = None

    async def request(self, raw: bytes) -> int:
        if self.transport is None:
            raise ConnectionError("connection closed")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


class _Pool:
    """Idle keep-alive connections to one port; opens more on demand."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: deque[_Conn] = deque()

    async def get(self) -> _Conn:
        while self.idle:
            conn = self.idle.popleft()
            if conn.transport is not None:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", self.port)
        return conn

    def put(self, conn: _Conn) -> None:
        self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


@dataclass(slots=True)
class Latencies:
    """Latencies (seconds) and errors of an open-loop phase.

    Percentiles are :mod:`prefixrouter.stats`'s nearest rank.
    """

    values: list[float] = field(default_factory=list)
    errors: int = 0

    def extend(self, other: Latencies) -> None:
        self.values += other.values
        self.errors += other.errors

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.values)
        if not lat:
            return {"requests": 0, "errors": self.errors, "p50_ms": 0.0, "p99_ms": 0.0}
        return {
            "requests": len(lat),
            "errors": self.errors,
            "p50_ms": round(1e3 * nearest_rank(lat, 0.50), 4),
            "p99_ms": round(1e3 * nearest_rank(lat, 0.99), 4),
            "mean_ms": round(1e3 * statistics.fmean(lat), 4),
        }


async def open_loop(
    port: int, requests: Sequence[bytes], rate: float, seconds: float, warmup: int = 50
) -> Latencies:
    """Send at ``rate`` per second for ``seconds`` (after ``warmup`` sequential requests)."""
    clock = time.perf_counter
    pool = _Pool(port)
    loop = asyncio.get_running_loop()
    out = Latencies()

    async def one(i: int, at: float, record: bool) -> None:
        try:
            conn = await pool.get()
            status = await conn.request(requests[i % len(requests)])
        except (ConnectionError, OSError):
            out.errors += record
            return
        if record:
            out.values.append(clock() - at)
            out.errors += status != 200
        pool.put(conn)

    for i in range(warmup):
        await one(i, clock(), False)
    n = max(1, int(rate * seconds))
    start = clock() + 0.05
    tasks: list[asyncio.Task[None]] = []
    for i in range(n):
        at = start + i / rate
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(i, at, True)))
    await asyncio.gather(*tasks)
    pool.close()
    return out


async def closed_loop(
    port: int, requests: Sequence[bytes], connections: int, seconds: float
) -> dict[str, float]:
    """``connections`` clients back to back for ``seconds``; completed requests per second."""
    loop = asyncio.get_running_loop()
    clock = time.perf_counter
    counts = {"done": 0, "errors": 0}
    stop_at = 0.0

    async def client(k: int, record: bool) -> None:
        try:
            _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
        except OSError:
            counts["errors"] += record
            return
        i = k
        try:
            while clock() < stop_at:
                status = await conn.request(requests[i % len(requests)])
                i += connections
                if record:
                    counts["done" if status == 200 else "errors"] += 1
        except ConnectionError:
            counts["errors"] += record
        finally:
            if conn.transport is not None:
                conn.transport.close()

    stop_at = clock() + 0.5  # warm-up
    await asyncio.gather(*(client(k, False) for k in range(connections)))
    t0 = clock()
    stop_at = t0 + seconds
    await asyncio.gather(*(client(k, True) for k in range(connections)))
    elapsed = clock() - t0
    return {"rps": counts["done"] / elapsed, "requests": counts["done"], "errors": counts["errors"]}
