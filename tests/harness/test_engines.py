"""Cache resets and the replay client against a real simulated engine process.

One ``python -m prefixrouter.simulated_engine`` (vLLM's API and metrics,
real tokenizer, prefix cache) on loopback: a repeated prompt is served from
cache, a reset empties the cache and announces itself with one probe
request, and an engine that stays busy makes the reset fail loudly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiohttp import web

from prefixrouter.bench.engine_metrics import scrape
from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.harness.replay import ReplayRequest, replay

DOC = " ".join(f"Clause {i}: the tenant pays rent on day {i % 28 + 1}." for i in range(120))


def _ask(question: str, offset_s: float = 0.0) -> ReplayRequest:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return ReplayRequest(offset_s, "doc-qa", "doc", body)


@pytest.fixture(scope="module")
def engine() -> Iterator[Server]:
    with Fleet() as fleet:
        server = fleet.start(
            "engine", "prefixrouter.simulated_engine",
            ["--profile", "tiny-cpu", "--time-scale", "20", "--model", "tiny"],
        )  # fmt: skip
        asyncio.run(fleet.wait_healthy([server], timeout_s=60))
        yield server


@pytest.mark.timeout(60)
def test_replay_measures_and_reset_empties_the_cache(engine: Server) -> None:
    async def body() -> None:
        first, again = await replay(engine.url, [_ask("Who pays?"), _ask("When?", 0.3)])
        assert first.ok and again.ok, (first.error, again.error)
        assert 0 < first.ttft_s <= first.e2e_s
        assert first.prompt_tokens > 200 and again.cached_tokens > 200  # the document, cached
        before = (await scrape([engine.url]))[0]
        await reset_prefix_caches([engine.url])
        after = (await scrape([engine.url]))[0]
        assert after.requests - before.requests == 1  # the announcing probe, and nothing else
        (cold,) = await replay(engine.url, [_ask("Who signs?")])
        assert cold.ok and cold.cached_tokens == 0

    asyncio.run(asyncio.wait_for(body(), 50))


def test_replay_records_errors_instead_of_raising(engine: Server) -> None:
    bad = ReplayRequest(0.0, "x", "g", {"model": "no-such-model", "messages": []})
    (res,) = asyncio.run(replay(engine.url, [bad]))
    assert not res.ok and res.status >= 400 and res.error


async def test_reset_fails_loudly_when_an_engine_stays_busy() -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0"} 1.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        with pytest.raises(RuntimeError, match="still had 1 requests"):
            await reset_prefix_caches([url], drain_timeout_s=0.3)
    finally:
        await runner.cleanup()


async def test_replay_spreads_requests_over_several_urls_round_robin() -> None:
    from aiohttp.test_utils import TestServer

    hits: list[tuple[int, str]] = []

    def app(n: int) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            hits.append((n, (await request.json())["messages"][0]["content"]))
            return web.json_response({"error": {"message": "no"}}, status=400)

        a = web.Application()
        a.router.add_post("/v1/chat/completions", chat)
        return a

    servers = [TestServer(app(0)), TestServer(app(1))]
    for s in servers:
        await s.start_server()
    try:
        reqs = [
            ReplayRequest(0.01 * i, "x", "g", {"model": "m", "messages": [{"content": str(i)}]})
            for i in range(5)
        ]
        results = await replay([str(s.make_url("")) for s in servers], reqs, concurrency=1)
    finally:
        for s in servers:
            await s.close()
    assert [r.status for r in results] == [400] * 5
    assert sorted(hits, key=lambda h: h[1]) == [(i % 2, str(i)) for i in range(5)]
