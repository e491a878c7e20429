"""Client limits of a real gateway on loopback: timeouts, the connection cap, large bodies.

The gateway runs in the test's event loop as ``prefixrouter serve`` runs it
(:func:`prefixrouter.gateway.server.start_server`), with timeouts of a
fraction of a second; the clients are raw sockets, so nothing between them
and the server papers over what the server does. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import threading
from array import array
from typing import Any

import orjson
import pytest

from prefixrouter.core.router import Router
from prefixrouter.gateway.body import SLICE_BYTES
from prefixrouter.gateway.config import LimitsConfig
from prefixrouter.gateway.flow import OFF_LOOP_BODY_BYTES
from prefixrouter.gateway.server import connection_cap
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run
from tests.gateway.served import (
    BOUND_S,
    HOST,
    LOOPS,
    closed_after,
    gateway,
    get,
    run_on,
    status_and_json,
)


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    for i in range(len(data)):
        await asyncio.sleep(every_s)
        if writer.is_closing():
            return
        writer.write(data[i : i + 1])


@pytest.mark.parametrize("loop", LOOPS)
def test_slowloris_headers_are_cut_after_the_header_timeout(loop: str) -> None:
    run_on(loop, _slowloris_headers_are_cut_after_the_header_timeout)


async def _slowloris_headers_are_cut_after_the_header_timeout() -> None:
    async with gateway({"header_timeout_s": 0.5, "keepalive_timeout_s": 30}) as (port, _):
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        feeder = asyncio.create_task(_trickle(writer, b"X-Slow: " + b"a" * 500, 0.05))
        try:
            took, data = await closed_after(reader)
        finally:
            feeder.cancel()
            writer.close()
        assert 0.4 <= took < BOUND_S
        status, body, _ = status_and_json(data)
        assert status == 408 and body["error"]["code"] == "request_timeout"


async def test_an_idle_fresh_connection_is_cut_after_the_header_timeout() -> None:
    async with gateway({"header_timeout_s": 0.5, "keepalive_timeout_s": 30}) as (port, _):
        reader, writer = await asyncio.open_connection(HOST, port)
        took, _ = await closed_after(reader)
        writer.close()
        assert 0.4 <= took < BOUND_S


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_trickled_a_byte_at_a_time_is_cut_with_408(loop: str) -> None:
    run_on(loop, _a_body_trickled_a_byte_at_a_time_is_cut_with_408)


async def _a_body_trickled_a_byte_at_a_time_is_cut_with_408() -> None:
    limits = {"body_idle_timeout_s": 5, "body_timeout_s": 0.6}
    async with gateway(limits) as (port, state):
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        # Never idle for 5 s, but the whole body is far from there after 0.6 s.
        feeder = asyncio.create_task(_trickle(writer, b"1" * 1000, 0.05))
        try:
            took, data = await closed_after(reader)
        finally:
            feeder.cancel()
            writer.close()
        assert 0.5 <= took < BOUND_S
        status, body, head = status_and_json(data)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert b"Connection: close" in head
        assert state.requests_seen == 1


async def test_a_stalled_body_is_cut_after_the_body_idle_timeout() -> None:
    async with gateway({"body_idle_timeout_s": 0.4, "body_timeout_s": 60}) as (port, _):
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", '
        )
        took, data = await closed_after(reader)
        writer.close()
        assert 0.3 <= took < BOUND_S
        assert status_and_json(data)[0] == 408


async def test_an_idle_keepalive_connection_is_closed() -> None:
    async with gateway({"keepalive_timeout_s": 0.5, "header_timeout_s": 30}) as (port, _):
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(BOUND_S):
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        # Two more requests on the same connection: active keep-alive is not cut.
        for _ in range(2):
            await asyncio.sleep(0.2)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        took, data = await closed_after(reader)
        writer.close()
        assert data.count(b"HTTP/1.1 200") == 2  # the rest of the first answer, then two
        assert took < BOUND_S


@pytest.mark.parametrize("loop", LOOPS)
def test_connections_past_the_cap_get_503_and_health_answers_once_they_close(loop: str) -> None:
    run_on(loop, _connections_past_the_cap_get_503_and_health_answers_once_they_close)


async def _connections_past_the_cap_get_503_and_health_answers_once_they_close() -> None:
    limits = {"max_connections": 4, "fd_reserve": 0, "header_timeout_s": 30}
    async with gateway(limits) as (port, _):
        async with asyncio.timeout(BOUND_S):
            while b"200 OK" not in await get(port):  # the first health check has run
                await asyncio.sleep(0.05)
        held = [await asyncio.open_connection(HOST, port) for _ in range(4)]
        await asyncio.sleep(0.1)
        status, body, _ = status_and_json(await get(port))
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        for _, writer in held:
            writer.close()
        async with asyncio.timeout(BOUND_S):
            while True:
                response = await get(port)
                if response.startswith(b"HTTP/1.1 200"):
                    break
                assert response.startswith(b"HTTP/1.1 503")
                await asyncio.sleep(0.05)


def test_the_cap_fits_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = LimitsConfig(max_connections=8192, fd_reserve=256)
    calls: list[tuple[int, int]] = []
    # The server calls the same (stdlib) module: patched here is patched there.
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: calls.append(value))
    # Hard limit 1024: no raise possible; each connection may need an upstream one too.
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    assert connection_cap(limits) == (1024 - 256) // 2
    # Room under the hard limit: the soft one is raised to fit the configured cap.
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1 << 20))
    assert connection_cap(limits) == 8192
    assert calls[-1] == (2 * 8192 + 256, 1 << 20)


def test_a_gateway_short_of_descriptors_says_why_its_cap_is_low_and_what_to_change() -> None:
    def few_descriptors() -> None:  # soft and hard: the gateway cannot raise its own
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    gw = subprocess.Popen(
        [sys.executable, "-m", "prefixrouter.gateway", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=few_descriptors,
    )
    try:
        assert gw.stdout is not None
        assert "listening on" in gw.stdout.readline()
    finally:
        gw.terminate()
        _, err = gw.communicate(timeout=30)
    # 300 descriptors less the 256 kept back leave 22 connections of two descriptors each.
    line = next(ln for ln in err.splitlines() if "max_connections" in ln)
    assert "lowered to 22" in line and "(300)" in line and "fd_reserve (256)" in line, line
    assert "ulimit -n" in line


async def test_large_bodies_are_built_off_the_event_loop() -> None:
    async with gateway({}) as (port, state):
        threads: list[str] = []
        build = state.builder.build

        def spy(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return build(*args, **kwargs)

        state.builder.build = spy  # type: ignore[method-assign]
        small = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        large = {"model": "tiny", "prompt": list(range(OFF_LOOP_BODY_BYTES // 5)), "max_tokens": 2}
        statuses = []
        for body in (small, large, b"[" * OFF_LOOP_BODY_BYTES):
            raw = body if isinstance(body, bytes) else orjson.dumps(body)
            assert (len(raw) >= OFF_LOOP_BODY_BYTES) == (body is not small)
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                + f"Content-Length: {len(raw)}\r\n\r\n".encode()
                + raw
            )
            async with asyncio.timeout(BOUND_S):
                statuses.append((await reader.read()).split()[1])
            writer.close()
        assert statuses == [b"200", b"200", b"400"]  # a large bad body is still a 400
        assert threads[0] == threading.current_thread().name
        assert threads[1].startswith("prefixrouter-parse")


def _spy(calls: list[tuple[str, Any]], fn: Any) -> Any:
    """``fn``, recording (thread name, first argument) of each call."""

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((threading.current_thread().name, args[0] if args else None))
        return fn(*args, **kwargs)

    return spy


async def _post_raw(port: int, raw: bytes) -> bytes:
    """POST ``raw`` to /v1/completions on a fresh connection; the whole response."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    async with asyncio.timeout(BOUND_S):
        response = await reader.read()
    writer.close()
    return response


async def _post(port: int, raw: bytes) -> tuple[int, dict[str, Any], bytes]:
    return status_and_json(await _post_raw(port, raw))


async def test_no_parse_of_a_large_token_prompt_holds_the_whole_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One orjson call holds the GIL for all of its document, so the event
    # loop thread waits behind a whole-body parse even on the parse thread.
    # (The fake engine, in this process, parses the body whole on the loop.)
    ids = list(range(100_000, 100_000 + OFF_LOOP_BODY_BYTES // 4))
    raw = orjson.dumps({"model": "tiny", "prompt": ids, "max_tokens": 2})
    sizes: list[int] = []  # of the documents parsed on the parse thread
    real = orjson.loads

    def spy(data: Any) -> Any:
        if threading.current_thread().name.startswith("prefixrouter-parse"):
            sizes.append(len(data))
        return real(data)

    async with gateway({}) as (port, _):
        monkeypatch.setattr(orjson, "loads", spy)
        status, _, _ = await _post(port, raw)
        parsed = list(sizes)
        bad_status, bad, _ = await _post(port, raw[:-1])  # no closing brace
        monkeypatch.undo()
    assert status == 200
    assert parsed and max(parsed) <= SLICE_BYTES + 16 < len(raw)  # slices, never the whole
    assert bad_status == 400 and bad["error"]["code"] == "invalid_json"
    with pytest.raises(orjson.JSONDecodeError) as exc:
        orjson.loads(raw[:-1])
    assert bad["error"]["message"] == f"invalid JSON body: {exc.value}"  # orjson's own words


async def test_large_bodies_are_hashed_off_the_event_loop_and_routed_with_those_blocks() -> None:
    async with gateway({}) as (port, state):
        router = state.dispatch.router
        hashed: list[tuple[str, Any]] = []
        routed: list[tuple[str, Any]] = []
        blocks_for = router.blocks_for

        def hash_spy(request: Any) -> Any:
            # What the blocks must be, taken now: once answered, a large
            # request's token list is emptied on the parse thread.
            hashed.append((threading.current_thread().name, Router.blocks_for(router, request)))
            return blocks_for(request)

        router.blocks_for = hash_spy  # type: ignore[method-assign]
        route = router.route

        def route_spy(*args: Any, **kwargs: Any) -> Any:
            routed.append((threading.current_thread().name, args[3] if len(args) > 3 else None))
            return route(*args, **kwargs)

        router.route = route_spy  # type: ignore[method-assign]
        tokens = {"model": "tiny", "prompt": list(range(OFF_LOOP_BODY_BYTES // 5)), "max_tokens": 2}
        text = {"model": "tiny", "prompt": "word " * (OFF_LOOP_BODY_BYTES // 5), "max_tokens": 2}
        for body in (tokens, text):  # token mode and text mode
            hashed.clear()
            routed.clear()
            status, _, _ = await _post(port, orjson.dumps(body))
            assert status == 200
            ((hash_thread, expected),) = hashed  # hashed once, on the parse thread
            assert hash_thread.startswith("prefixrouter-parse")
            ((route_thread, blocks),) = routed  # routed on the loop, with those blocks
            assert route_thread == threading.current_thread().name
            assert blocks is not None and blocks == expected


def test_a_retry_routes_the_blocks_hashed_for_the_first_attempt() -> None:
    async def body() -> None:
        engines = [FakeEngine(status=503), FakeEngine()]
        overrides = {"policy": {"name": "round_robin"}}
        async with gateway_env(engines=engines, overrides=overrides) as env:
            router = env.state.dispatch.router
            hashed: list[tuple[str, Any]] = []
            router.blocks_for = _spy(hashed, router.blocks_for)  # type: ignore[method-assign]
            for i in range(4):
                r = await env.chat(f"question {i}")
                assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w1"
            r = await env.client.get("/metrics")  # the refusing worker was tried first
            assert 'prefixrouter_retries_total{status="503",worker="w0"}' in await r.text()
            assert len(hashed) == 4  # once per request, not once per attempt

    run(body)


async def test_a_large_body_is_freed_on_the_parse_thread_once_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefixrouter.gateway import flow as proxy_mod

    dropped: list[tuple[str, int, Any]] = []
    drop = proxy_mod._drop_parsed

    def drop_spy(built: Any) -> None:
        tokens = built.routing.tokens
        drop(built)
        dropped.append((threading.current_thread().name, len(built.body), tokens))

    monkeypatch.setattr(proxy_mod, "_drop_parsed", drop_spy)
    async with gateway({}) as (port, _state):
        ids = list(range(OFF_LOOP_BODY_BYTES // 5))
        for model, answer in (("tiny", 200), ("no-such-model", 404)):  # routed, then refused
            dropped.clear()
            status, _, _ = await _post(
                port, orjson.dumps({"model": model, "prompt": ids, "max_tokens": 2})
            )
            assert status == answer
            async with asyncio.timeout(BOUND_S):
                while not dropped:
                    await asyncio.sleep(0.01)
            ((thread, body_left, tokens),) = dropped
            assert thread.startswith("prefixrouter-parse")
            # The ids were packed on the parse thread; the body's containers are emptied.
            assert body_left == 0 and isinstance(tokens, array) and list(tokens) == ids
        dropped.clear()
        small = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        assert (await _post(port, orjson.dumps(small)))[0] == 200
        await asyncio.sleep(0.05)
        assert dropped == []  # a small body is parsed and freed on the loop: no hand-off


async def test_a_large_token_prompt_is_packed_and_forwarded_unchanged() -> None:
    """Packed off the loop (no list of a million ints for the collector to walk).

    A streamed request is re-serialized (the gateway asks for the usage
    chunk): the engine must still get the client's ids, in order.
    """
    fake = FakeEngine()
    async with gateway({}, fake) as (port, state):
        ids = [7, 0, 2**32 - 1, *range(100_000, 100_000 + OFF_LOOP_BODY_BYTES // 6)]
        packed: list[Any] = []
        admit = state.dispatch.admit

        def admit_spy(request: Any, *args: Any, **kwargs: Any) -> Any:
            packed.append(request.tokens)
            return admit(request, *args, **kwargs)

        state.dispatch.admit = admit_spy  # type: ignore[method-assign]
        for stream in (False, True):
            raw = orjson.dumps({"model": "tiny", "prompt": ids, "max_tokens": 2, "stream": stream})
            response = await _post_raw(port, raw)  # a stream's body is not one JSON
            assert response.split()[1] == b"200"
            sent = fake.requests[-1]
            assert sent["prompt"] == ids
            assert sent.get("stream_options", {}).get("include_usage", False) is stream
        assert len(packed) == 2 and all(isinstance(t, array) and t.typecode == "I" for t in packed)


async def test_the_gateway_lowers_the_switch_interval_while_it_serves() -> None:
    import sys

    from prefixrouter.gateway.cli import run_gateway
    from prefixrouter.gateway.config import GatewayConfig

    before = sys.getswitchinterval()
    config = GatewayConfig.model_validate(
        {"server": {"port": 0}, "limits": {"gil_switch_interval_s": 0.00025}}
    )
    serving = asyncio.ensure_future(run_gateway(config, announce=False))
    try:
        async with asyncio.timeout(BOUND_S):
            while sys.getswitchinterval() == before:
                await asyncio.sleep(0.01)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
    assert sys.getswitchinterval() == before
