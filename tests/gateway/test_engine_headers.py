"""The request id and W3C trace context reach the engine on every attempt."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from prefixrouter.gateway import upstream
from tests.gateway.fakes import FakeEngine, make_app
from tests.gateway.helpers import gateway_env, run

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7"


def _recording(engine: FakeEngine, seen: list[dict[str, str]]) -> web.Application:
    """A fake engine whose completion requests' headers are recorded in ``seen``."""
    app = make_app(engine)

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST":
            seen.append({k.lower(): v for k, v in request.headers.items()})
        resp: web.StreamResponse = await handler(request)
        return resp

    app.middlewares.append(record)
    return app


def test_the_head_carries_the_request_headers_after_the_fixed_ones() -> None:
    ep = upstream.Endpoint.from_url("http://h:1/p", {"Authorization": "Bearer k"})
    extra = upstream.forwarded_headers("abc", TRACEPARENT, TRACESTATE)
    head = ep.request_head("/v1/x", 7, extra)
    assert head.startswith(b"POST /p/v1/x HTTP/1.1\r\nHost: h:1\r\n")
    assert b"Authorization: Bearer k\r\nX-Request-Id: abc\r\ntraceparent: " in head
    assert head.endswith(b"tracestate: " + TRACESTATE.encode() + b"\r\nContent-Length: 7\r\n\r\n")
    assert ep.request_head("/v1/x", 7) == ep.request_head("/v1/x", 7, b"")


def test_trace_headers_that_are_not_sane_are_dropped() -> None:
    forwarded_headers = upstream.forwarded_headers
    assert forwarded_headers("r", "x" * 513) == b"X-Request-Id: r\r\n"
    assert forwarded_headers("r", "a\x00b") == b"X-Request-Id: r\r\n"
    # tracestate means nothing without a traceparent (W3C Trace Context).
    assert forwarded_headers("r", None, TRACESTATE) == b"X-Request-Id: r\r\n"
    assert forwarded_headers("r", TRACEPARENT, "é") == (
        b"X-Request-Id: r\r\ntraceparent: " + TRACEPARENT.encode() + b"\r\n"
    )


def test_client_id_and_trace_context_reach_the_engine() -> None:
    async def main() -> None:
        seen: list[dict[str, str]] = []
        async with gateway_env(apps=[_recording(FakeEngine(), seen)]) as env:
            headers = {
                "X-Request-Id": "client-abc",
                "traceparent": TRACEPARENT,
                "tracestate": TRACESTATE,
            }
            for stream in (False, True):
                r = await env.chat("hello", headers=headers, stream=stream)
                await r.read()
                assert r.status == 200 and r.headers["X-Request-Id"] == "client-abc"
            assert len(seen) == 2
            for h in seen:
                assert h["x-request-id"] == "client-abc"
                assert h["traceparent"] == TRACEPARENT and h["tracestate"] == TRACESTATE

    run(main)


def test_without_a_sane_client_id_the_engine_gets_the_gateways() -> None:
    async def main() -> None:
        seen: list[dict[str, str]] = []
        async with gateway_env(apps=[_recording(FakeEngine(), seen)]) as env:
            for headers in (None, {"X-Request-Id": "has space"}, {"X-Request-Id": "x" * 129}):
                r = await env.chat("hello", headers=headers)
                await r.read()
                assert r.status == 200
                sent = seen[-1]["x-request-id"]
                assert sent == r.headers["X-Request-Id"]  # the id the client got back
                assert sent not in ("has space", "x" * 129)
                assert "traceparent" not in seen[-1]
            ids = [h["x-request-id"] for h in seen]
            assert len(set(ids)) == 3  # one per request
            decisions = await env.decisions()
            assert {d["request_id"] for d in decisions} >= set(ids)

    run(main)


def test_a_retry_on_another_worker_sends_the_same_id() -> None:
    async def main() -> None:
        seen: list[dict[str, str]] = []
        engines = [FakeEngine(status=503), FakeEngine(status=503), FakeEngine()]
        apps = [_recording(e, seen) for e in engines]
        async with gateway_env(apps=apps) as env:
            most = 0
            for i in range(6):
                seen.clear()
                r = await env.chat(
                    f"retry me {i}", headers={"X-Request-Id": "rid-1", "traceparent": TRACEPARENT}
                )
                await r.read()
                assert r.status == 200
                assert seen and all(h["x-request-id"] == "rid-1" for h in seen)
                assert all(h["traceparent"] == TRACEPARENT for h in seen)
                most = max(most, len(seen))
            assert most >= 2  # some request was refused and retried elsewhere

    run(main)
