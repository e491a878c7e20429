"""An engine that answered is never sent the request again; its error keeps its headers.

Before: a non-streamed answer that broke after its headers (and body bytes)
was retried on the next worker, which generated it a second time, and the
first worker was marked unreachable; ``proxy.request_timeout_s`` expiring on
a long generation did the same on every worker in turn, so the client
waited ``max_attempts`` times the timeout and every live worker left
routing. Now such a request gets a 502 (broke) or a 504 (timed out) from
its one attempt. And an engine's refusal passed on to the client lost its
``Retry-After``: its end-to-end headers now go with it.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from aiohttp import web

from prefixrouter.core.types import WorkerId
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run
from tests.gateway.odd_engines import odd_env

# A short total timeout; no first-byte timeout (a long generation is not silent).
TIMEOUT = {"proxy": {"request_timeout_s": 1.0, "first_byte_timeout_floor_s": None}}


async def _broken_body(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """A 200 whose body stops after a few bytes: the connection closes mid-answer."""
    headers = {"Content-Type": "application/json", "Content-Length": "1000"}
    resp = web.StreamResponse(status=200, headers=headers)
    await resp.prepare(request)
    await resp.write(b'{"id": "x", "choices": [')
    assert request.transport is not None
    request.transport.close()
    return resp


def test_an_answer_that_breaks_after_its_headers_is_not_sent_again() -> None:
    async def body() -> None:
        async with odd_env([_broken_body, _broken_body]) as (env, odds):
            reg = env.state.registry
            marked: list[str] = []  # workers taken out of routing as unreachable
            mark_failed = reg.mark_failed

            def spy(w: Any, error: str) -> None:
                marked.append(w.id)
                mark_failed(w, error)

            reg.mark_failed = spy  # type: ignore[method-assign]
            r = await env.chat("hi")
            err = (await r.json())["error"]
            assert r.status == 502 and "broke" in err["message"]
            assert r.headers["X-Prefixrouter-Worker"] == "w0"
            # One engine generated it; the other never saw it.
            assert [len(o.requests) for o in odds] == [1, 0]
            (log,) = await env.decisions()
            assert log["status"] == 502 and log["attempts"] == 1 and not log["retried_from"]
            # Not marked unreachable (down): it answered. A broken answer has it
            # checked at once (suspect), and the check finds it alive.
            assert marked == []

    run(body)


@pytest.mark.parametrize("stream", [False, True])
def test_the_total_timeout_is_one_504_and_leaves_live_workers_in_routing(stream: bool) -> None:
    async def body() -> None:
        engines = [FakeEngine(delay_s=5.0) for _ in range(3)]  # proxy.max_attempts: 3
        overrides = {**TIMEOUT, "policy": {"name": "round_robin"}}
        async with gateway_env(engines=engines, overrides=overrides) as env:
            t0 = time.monotonic()
            r = await env.chat("hi", stream=stream, max_tokens=None)
            took = time.monotonic() - t0
            err = (await r.json())["error"]
            assert r.status == 504 and err["code"] == "upstream_timeout"
            assert took < 2.2  # one timeout (1 s), not one per worker (3 s)
            assert sum(len(e.requests) for e in engines) == 1
            (log,) = await env.decisions()
            assert log["status"] == 504 and log["attempts"] == 1
            # Both answer their health checks: neither leaves routing.
            for w in env.state.registry.workers.values():
                assert w.healthy and not w.suspect and w.view.healthy

    run(body)


def test_the_total_timeout_mid_stream_is_a_timeout_event() -> None:
    async def body() -> None:
        engines = [FakeEngine(chunk_delay_s=0.2)]
        async with gateway_env(engines=engines, overrides=TIMEOUT) as env:
            r = await env.chat("hi", stream=True, max_tokens=30)  # 6 s of tokens
            text = await r.text()
            events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
            assert 2 <= sum('"content"' in e for e in events) < 30
            err = orjson.loads(events[-1])["error"]
            assert err["code"] == "504" and "timed out" in err["message"]
            (log,) = await env.decisions()
            assert log["status"] == 504
            w0 = env.state.registry.workers[WorkerId("w0")]
            assert w0.healthy and not w0.suspect  # a long answer, not a sick worker

    run(body)


def _refusal(status: int) -> Any:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        err = {"error": {"message": "busy", "type": "rate_limit", "param": None, "code": "busy"}}
        headers = {
            "Content-Type": "application/json; charset=utf-8",
            "Retry-After": "7",
            "X-Engine-Extra": "yes",
            "X-Request-Id": "engine-own-id",
            "Keep-Alive": "timeout=5",
        }
        return web.Response(status=status, body=orjson.dumps(err), headers=headers)

    return handler


@pytest.mark.parametrize("status", [429, 400])
def test_an_engine_error_passed_on_keeps_its_headers(status: int) -> None:
    """A refusal (429, retried, then answered) or a plain error (400): the
    client gets the engine's ``Retry-After``, its other end-to-end headers and
    its content type as sent; the request id stays the gateway's."""

    async def body() -> None:
        async with odd_env([_refusal(status), _refusal(status)]) as (env, _):
            r = await env.chat("hi", headers={"X-Request-Id": "client-id-1"})
            assert r.status == status
            assert (await r.json())["error"]["message"] == "busy"
            assert r.headers["Retry-After"] == "7" and r.headers["X-Engine-Extra"] == "yes"
            assert r.headers["Content-Type"] == "application/json; charset=utf-8"
            assert r.headers.getall("X-Request-Id") == ["client-id-1"]
            assert r.headers["X-Prefixrouter-Worker"] in ("w0", "w1")
            assert "Keep-Alive" not in r.headers  # hop-by-hop: the engine's connection only

    run(body)
