"""The replay client's clock and error messages, against real HTTP servers on loopback.

* **Open loop.** A request is timed from its scheduled send time: a request
  that waits in the client for a concurrency slot has that wait in its TTFT
  (and says it waited), as a user who sent it then would count it.
* **Broken streams.** A stream that ends without ``[DONE]`` is an error that
  says what broke (the gateway's ``data: {"error": ...}`` event), not
  ``HTTP 200``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.test_utils import TestServer

from prefixrouter.harness.replay import ReplayRequest, replay

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
FIRST_TOKEN_S = 0.3


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url(""))
    finally:
        await server.close()


async def _stream(
    request: web.Request, events: list[bytes], delay_s: float = 0.0
) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(delay_s)
    for event in events:
        await resp.write(b"data: " + event + b"\n\n")
    await resp.write_eof()
    return resp


CONTENT = b'{"choices":[{"delta":{"content":"hi"}}]}'
USAGE = b'{"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}'


def _req(offset_s: float = 0.0) -> ReplayRequest:
    return ReplayRequest(offset_s, "k", "g", {"model": "m", "messages": [], "stream": True})


async def test_ttft_counts_the_wait_for_a_client_slot_from_the_scheduled_send() -> None:
    # Every answer's first token comes 0.3 s after it is asked; 6 requests due at
    # once through 2 slots go in three waves: a user who sent the last two at 0
    # waits about 0.9 s for a first token, not the 0.3 s the engine took.
    async def slow(request: web.Request) -> web.StreamResponse:
        return await _stream(request, [CONTENT, USAGE, b"[DONE]"], FIRST_TOKEN_S)

    async with _server(slow) as url:
        results = await replay(url, [_req() for _ in range(6)], concurrency=2)
    assert all(r.ok for r in results), [r.error for r in results]
    ttfts = sorted(r.ttft_s for r in results)
    waves = [ttfts[0:2], ttfts[2:4], ttfts[4:6]]
    for k, wave in enumerate(waves, start=1):
        for t in wave:  # wave k starts after k-1 waves: its TTFT counts them
            assert k * FIRST_TOKEN_S - 0.05 <= t < k * FIRST_TOKEN_S + 0.25, ttfts
    # The wait is also kept apart, and the requests that waited say so.
    queued = [r for r in results if r.queued]
    assert len(queued) == 4
    assert all(r.wait_s >= FIRST_TOKEN_S - 0.05 for r in queued)
    assert all(r.wait_s < 0.1 for r in results if not r.queued)
    for r in results:  # e2e and TTFT share the clock: both include the wait
        assert r.e2e_s >= r.ttft_s >= r.wait_s
        assert (r.prompt_tokens, r.cached_tokens) == (10, 4)


async def test_a_broken_stream_says_what_broke_not_http_200() -> None:
    # What the gateway writes when the engine's stream breaks (gateway/proxy.py):
    # an error event of its own, and no [DONE].
    broken = (
        b'{"error":{"message":"upstream stream broke: Connection reset by peer",'
        b'"type":"upstream_error","param":null,"code":"502"}}'
    )

    async def breaks(request: web.Request) -> web.StreamResponse:
        return await _stream(request, [CONTENT, broken])

    async def cut(request: web.Request) -> web.StreamResponse:
        return await _stream(request, [CONTENT])  # neither an error event nor [DONE]

    async with _server(breaks) as url:
        (res,) = await replay(url, [_req()])
    assert not res.ok and res.status == 200 and res.ttft_s >= 0
    assert "upstream stream broke: Connection reset by peer" in res.error
    async with _server(cut) as url:
        (res,) = await replay(url, [_req()])
    assert not res.ok and res.error == "stream ended without data: [DONE]"
