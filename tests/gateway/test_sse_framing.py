"""SSE framing: events end at any blank line, and pass on as they arrive, as sent.

SSE allows ``\\n``, ``\\r\\n`` and ``\\r`` line ends; sse-starlette (and so
llama-cpp-python's server) ends every event with ``\\r\\n\\r\\n``. The relay
used to split on ``\\n\\n`` only: such a stream reached the client in one
piece at its end, with a false "ended before data: [DONE]" error event
after the engine's own ``[DONE]`` and the usage chunk the client had not
asked for, and was counted a 502 (its worker ejected after 5 of them).
``data:[DONE]`` (no space, also legal) got the same false error. Also here:
the ``"usage": null`` members an OpenAI-style server adds to every chunk
once the gateway asks for usage, and an engine that answers a stream with a
JSON body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse, web

from prefixrouter.gateway.sse import SseRelay, usage_figures
from tests.gateway.helpers import Env, run
from tests.gateway.odd_engines import USAGE, chunk, odd_env, wants_usage

# Every way two line ends make a blank line, as the last line end of an event.
ENDINGS = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\r\n\n", b"\n\r\n", b"\r\r\n", b"\n\r"]


def _event(obj: object, ending: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + ending


def _content(i: int, ending: bytes) -> bytes:
    return _event(chunk(f"t{i}"), ending)


def _usage_event(ending: bytes) -> bytes:
    return _event(chunk(None, usage=USAGE, choices=False), ending)


# ---------------------------------------------------------------- the relay alone


@pytest.mark.parametrize("ending", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_each_event_is_relayed_as_soon_as_it_is_complete(ending: bytes) -> None:
    relay = SseRelay(strip_usage=True)
    for i in range(3):
        event = _content(i, ending)
        assert relay.feed(event) == event  # at once, byte for byte
    assert relay.feed(_usage_event(ending)) == b""  # the client did not ask for it
    assert relay.usage == USAGE
    done = b"data: [DONE]" + ending
    assert relay.feed(done) == done and relay.done
    assert relay.finish() == b""


@pytest.mark.parametrize("seed", range(40))
def test_any_blank_line_ends_an_event_however_the_stream_is_cut(seed: int) -> None:
    rng = random.Random(seed)
    content = [_content(i, rng.choice(ENDINGS)) for i in range(rng.randint(0, 5))]
    usage = _usage_event(rng.choice(ENDINGS))
    done = rng.choice([b"data: [DONE]", b"data:[DONE]"]) + rng.choice(ENDINGS)
    stream = b"".join([*content, usage, done])
    strip = rng.random() < 0.5
    relay = SseRelay(strip_usage=strip)
    out = b""
    at = 0
    while at < len(stream):
        size = rng.randint(1, 50)
        out += relay.feed(stream[at : at + size])
        at += size
    out += relay.finish()
    assert out == b"".join([*content, *([] if strip else [usage]), done])
    assert relay.done and usage_figures(relay.usage) == (5, 0)


def test_a_crlf_cut_after_its_cr_goes_with_its_event() -> None:
    """A chunk may end between the CR and the LF of an event's last CRLF: the
    event goes on at once, and the LF that opens the next chunk follows it,
    or is dropped with it."""
    usage = _usage_event(b"\r\n\r\n")
    kept = SseRelay(strip_usage=False)
    assert kept.feed(usage[:-1]) == usage[:-1]
    assert kept.feed(b"\ndata: [DONE]\r\n\r\n") == b"\ndata: [DONE]\r\n\r\n" and kept.done
    stripped = SseRelay(strip_usage=True)
    assert stripped.feed(usage[:-1]) == b""
    assert stripped.feed(b"\ndata: [DONE]\r\n\r\n") == b"data: [DONE]\r\n\r\n"
    assert stripped.usage == USAGE


@pytest.mark.parametrize("done", [b"data:[DONE]\n\n", b"data: [DONE]\r\n\r\n", b"data: [DONE]"])
def test_done_is_known_with_or_without_the_space_and_any_line_end(done: bytes) -> None:
    relay = SseRelay(strip_usage=False)
    out = relay.feed(_content(0, b"\n\n") + done) + relay.finish()
    assert out.endswith(done) and relay.done


def test_a_line_that_only_ends_in_done_is_not_the_end() -> None:
    relay = SseRelay(strip_usage=False)
    relay.feed(b"data: x data: [DONE]\n\n")
    relay.feed(b"data:  [DONE]\n\n")  # two spaces: the data is " [DONE]"
    assert not relay.done


NULL_CHUNKS = [
    # The compact spelling (pydantic, orjson) as the last member...
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}\n\n',
    # ...and as a middle one (OpenAI puts "obfuscation" after it).
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"b"}}],"usage":null,'
    b'"obfuscation":"x1"}\r\n\r\n',
    # Python's json.dumps spelling.
    b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "c"}}], "usage": null}\n\n',
    b'data: {"id": "c", "choices": [], "usage": null, "obfuscation": "x2"}\n\n',
]


def test_usage_null_members_go_only_when_the_client_did_not_ask_for_usage() -> None:
    text = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":",\\"usage\\":null"}}]}\n\n'
    stream = b"".join([*NULL_CHUNKS, text, _usage_event(b"\n\n"), b"data: [DONE]\n\n"])
    stripped = SseRelay(strip_usage=True)
    out = stripped.feed(stream) + stripped.finish()
    events = [orjson.loads(e[6:]) for e in out.replace(b"\r\n", b"\n").split(b"\n\n")[:-2]]
    assert len(events) == 5 and all("usage" not in e for e in events)
    assert events[1]["obfuscation"] == "x1" and events[3] == {
        "id": "c",
        "choices": [],
        "obfuscation": "x2",
    }
    assert events[4]["choices"][0]["delta"]["content"] == ',"usage":null'  # text, untouched
    assert stripped.usage == USAGE and stripped.done
    kept = SseRelay(strip_usage=False)
    assert kept.feed(stream) + kept.finish() == stream  # asked for: every byte stays
    assert kept.usage == USAGE


# ---------------------------------------------------------------- through the gateway


async def _read_event(r: ClientResponse, seen: bytearray, end: bytes) -> None:
    while end not in seen:
        part = await r.content.readany()
        assert part, "the stream ended"
        seen += part


def _starlette(gate: asyncio.Event | None = None, done: bytes = b"data: [DONE]\r\n\r\n") -> Any:
    """An sse-starlette-style engine: json.dumps events ending in CRLF CRLF, a charset."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: " + json.dumps(chunk(f"t{i}")).encode() + b"\r\n\r\n")
            if i == 0 and gate is not None:
                # Nothing more until the client has seen this event (bounded).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gate.wait(), 5.0)
        if wants_usage(body):
            usage = chunk(None, usage=USAGE, choices=False)
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\r\n\r\n")
        await resp.write(done)
        await resp.write_eof()
        return resp

    return handler


async def _stream(env: Env, **kw: Any) -> ClientResponse:
    return await env.chat("hi", stream=True, **kw)


def test_a_crlf_stream_is_relayed_event_by_event_and_ends_clean() -> None:
    async def body() -> None:
        gate = asyncio.Event()
        async with odd_env([_starlette(gate)]) as (env, odds):
            r = await _stream(env)
            assert r.status == 200
            seen = bytearray()
            # The first event arrives while the engine holds back the rest.
            await asyncio.wait_for(_read_event(r, seen, b"\r\n\r\n"), 2.0)
            assert bytes(seen).startswith(b'data: {"id": "chatcmpl-1"') and b"t1" not in seen
            gate.set()
            seen += await r.read()
            expected = b"".join(
                b"data: " + json.dumps(chunk(f"t{i}")).encode() + b"\r\n\r\n" for i in range(3)
            )
            # As the engine sent it, less the usage chunk only the gateway asked for.
            assert bytes(seen) == expected + b"data: [DONE]\r\n\r\n"
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            assert wants_usage(odds[0].requests[0])
            (log,) = await env.decisions()
            assert log["status"] == 200 and log["error"] is None

    run(body)


def test_crlf_streams_leave_healthy_workers_in_routing() -> None:
    """Before, each CRLF stream counted as a 502: the outlier rule ejected a worker."""

    async def body() -> None:
        async with odd_env([_starlette(), _starlette()]) as (env, _):
            for _ in range(12):
                r = await _stream(env)
                text = await r.text()
                assert text.endswith("data: [DONE]\r\n\r\n") and '"error"' not in text
            workers = env.state.registry.workers.values()
            assert not any(w.ejected for w in workers)
            assert all(d["status"] == 200 for d in await env.decisions())

    run(body)


def test_done_without_a_space_ends_a_stream_clean() -> None:
    async def body() -> None:
        async with odd_env([_starlette(done=b"data:[DONE]\n\n")]) as (env, _):
            r = await _stream(env)
            text = await r.text()
            assert text.endswith("data:[DONE]\n\n") and '"error"' not in text
            (log,) = await env.decisions()
            assert log["status"] == 200

    run(body)


def test_a_stream_answered_with_json_is_relayed_as_json() -> None:
    """An engine that ignores ``"stream": true``: its JSON answer goes on as it
    came (no SSE error event after it), and counts as the answer it is."""
    answer = {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": USAGE,
    }

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(answer)

    async def body() -> None:
        async with odd_env([handler]) as (env, _):
            r = await _stream(env)
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
            assert await r.json() == answer
            (log,) = await env.decisions()
            assert log["status"] == 200 and log["error"] is None

    run(body)


def test_usage_null_on_every_chunk_reaches_only_a_client_that_asked() -> None:
    """OpenAI-style servers put ``"usage": null`` on every chunk under
    ``include_usage``, which the gateway always sets: a client that did not
    set it gets the chunks a direct call gives it, without that member."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = wants_usage(body)
        for text in ("a", "b"):
            obj = chunk(text, usage=None) if usage else chunk(text)
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        if usage:
            last = chunk(None, usage=USAGE, choices=False)
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def body() -> None:
        async with odd_env([handler]) as (env, _):
            plain = await (await _stream(env)).text()
            direct = b"".join(b"data: " + json.dumps(chunk(t)).encode() + b"\n\n" for t in "ab")
            assert plain == (direct + b"data: [DONE]\n\n").decode()
            asked = await (await _stream(env, stream_options={"include_usage": True})).text()
            assert asked.count('"usage": null') == 2 and '"prompt_tokens": 5' in asked

    run(body)


def test_an_event_cut_by_a_break_does_not_swallow_the_error_event() -> None:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(chunk("a")).encode() + b"\r\n\r\n")
        await resp.write(b'data: {"id": "chatcmpl-1", "cho')  # then the engine dies
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    async def body() -> None:
        async with odd_env([handler]) as (env, _):
            text = await (await _stream(env)).text()
            events = text.replace("\r\n", "\n").split("\n\n")
            assert events[-1] == "" and events[-2].startswith("data: {")
            err = orjson.loads(events[-2][6:])["error"]
            assert err["code"] == "502" and "broke" in err["message"]

    run(body)
