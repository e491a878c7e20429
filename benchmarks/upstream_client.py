"""CPU per request of the proxy's upstream client against aiohttp's, side by side.

One upstream process (:mod:`prefixrouter.bench.instant`: an aiohttp + uvloop
server answering every completion at once with a vLLM-shaped body) and,
in this process on uvloop, sequential POSTs of the 8 KB overhead body over one
keep-alive connection, in alternating rounds:

* ``aiohttp``: ``aiohttp.ClientSession.post`` and ``read`` (what the gateway
  used before, and what ``gateway_overhead.py``'s bare proxy uses);
* ``upstream``: :class:`prefixrouter.gateway.upstream.UpstreamClient`;
* ``raw``: the floor: a prebuilt request written on an asyncio protocol that
  waits for ``Content-Length`` bytes of answer (no parsing, no pooling, no
  timeouts).

CPU time is this thread's (``time.thread_time``), so the upstream process's
time is not counted; each figure is the median over ``--rounds`` rounds of
``--requests`` requests. The ratios (``upstream`` / ``aiohttp``) are the point.

Usage::

    python benchmarks/upstream_client.py [--requests 3000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import aiohttp
import orjson
import uvloop

from prefixrouter.bench.overhead import overhead_bodies
from prefixrouter.gateway.upstream import Endpoint, UpstreamClient
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.stats import percentile

PATH = "/v1/chat/completions"


class _RawConnection(asyncio.Protocol):
    """The floor: write the request, wait for the header and Content-Length bytes."""

    def __init__(self) -> None:
        self.buf = b""
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.done is None:
            return
        head = self.buf[:end].lower()
        length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
        if len(self.buf) >= end + 4 + length and not self.done.done():
            self.done.set_result(None)


async def measure(port: int, requests: int, rounds: int) -> dict[str, Any]:
    body = overhead_bodies()[0]
    url = f"http://127.0.0.1:{port}{PATH}"
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    client = UpstreamClient(connect_timeout_s=3.0, total_timeout_s=600.0)
    endpoint = Endpoint.from_url(f"http://127.0.0.1:{port}")
    loop = asyncio.get_running_loop()
    _, raw = await loop.create_connection(_RawConnection, "127.0.0.1", port)
    raw_request = endpoint.request_head(PATH, len(body)) + body

    async def with_aiohttp() -> None:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()

    async def with_upstream() -> None:
        resp = await client.post(endpoint, PATH, body)
        await resp.read()
        resp.release()

    async def with_raw() -> None:
        raw.buf, raw.done = b"", loop.create_future()
        raw.transport.write(raw_request)
        await raw.done

    kinds = {"aiohttp": with_aiohttp, "upstream": with_upstream, "raw": with_raw}
    per_request: dict[str, list[float]] = {k: [] for k in kinds}
    for one in kinds.values():  # warm up every path
        for _ in range(300):
            await one()
    for r in range(rounds):
        order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
        for name in order:
            one = kinds[name]
            t = time.thread_time()
            for _ in range(requests):
                await one()
            per_request[name].append(1e6 * (time.thread_time() - t) / requests)
    await session.close()
    await client.close()
    raw.transport.close()
    us = {k: round(percentile(v, 0.5), 1) for k, v in per_request.items()}
    return {
        "cpu_us_per_request": us,
        "upstream_over_aiohttp": round(us["upstream"] / us["aiohttp"], 3),
        "upstream_over_raw": round(us["upstream"] / us["raw"], 3),
        "requests": requests,
        "rounds": rounds,
    }


async def _healthy_then_measure(
    fleet: Fleet, upstream: Server, args: argparse.Namespace
) -> dict[str, Any]:
    await fleet.wait_healthy([upstream])
    return await measure(upstream.port, args.requests, args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="requests per round and client")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    port = free_port()
    with Fleet() as fleet:
        cmd = [sys.executable, "-m", "prefixrouter.bench.instant", "--ports", str(port)]
        upstream = fleet.start_command("instant engine", cmd, port)
        result = uvloop.run(_healthy_then_measure(fleet, upstream, args))
    if not args.json:
        us = result["cpu_us_per_request"]
        print("client CPU per request (µs), median of rounds:")
        for name, value in us.items():
            print(f"  {name:9s} {value:7.1f}")
        print(f"upstream / aiohttp: {result['upstream_over_aiohttp']:.2f}")
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
