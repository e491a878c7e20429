"""An engine's answer cut short never passes for a complete one.

A stream that ends cleanly (end of body) without ``data: [DONE]`` ends, for
the client, with an SSE ``error`` event (status 502 in the decision log);
an unstreamed 200 whose body is not JSON is answered as an OpenAI-shaped
502. Found by the fault suite (``tests/faults/``): before, both reached the
client as if complete.
"""

from __future__ import annotations

import orjson

from prefixrouter.gateway.sse import SseRelay
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run

LONG = "The quick brown fox jumps over the lazy dog. " * 60


def test_the_relay_knows_whether_done_went_through() -> None:
    relay = SseRelay(strip_usage=False)
    relay.feed(b'data: {"id": "x"}\n\n')
    assert not relay.done
    relay.feed(b"data: [DONE]\n\n")
    assert relay.done
    tail = SseRelay(strip_usage=False)
    tail.feed(b'data: {"id": "x"}\n\ndata: [DO')
    assert not tail.done
    tail.feed(b"NE]")
    assert tail.finish() == b"data: [DONE]" and tail.done  # unterminated, still the end


def test_a_stream_ended_before_done_gets_an_error_event() -> None:
    async def body() -> None:
        async with gateway_env(n=1, engines=[FakeEngine(end_after_chunks=2)]) as env:
            r = await env.chat(LONG, stream=True, max_tokens=6)
            text = await r.text()
            assert r.status == 200
            events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
            assert "[DONE]" not in events and text.count('"content"') == 2
            err = orjson.loads(events[-1])["error"]
            assert err["code"] == "502" and "[DONE]" in err["message"]
            assert (await env.decisions(1))[0]["status"] == 502
            # A whole stream is untouched.
            env.engines[0].end_after_chunks = None
            r = await env.chat(LONG + " again", stream=True, max_tokens=6)
            text = await r.text()
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text

    run(body)


def test_an_unstreamed_body_that_is_not_json_is_a_502() -> None:
    async def body() -> None:
        async with gateway_env(n=1, engines=[FakeEngine(cut_body=True)]) as env:
            r = await env.chat(LONG, max_tokens=6)
            assert r.status == 502
            err = (await r.json())["error"]
            assert err["code"] == "502" and "not JSON" in err["message"]
            assert r.headers["X-Request-Id"]
            assert (await env.decisions(1))[0]["status"] == 502

    run(body)
