"""What the shipped Envoy bootstrap does around the picker, through a real Envoy.

One fleet for the module: two simulated engines, one ``prefixrouter epp``
with ``--fallbacks 1``, and two Envoys on the shipped bootstrap (fail
closed), one per request body mode. Each test is one rule of the data plane:

* fallbacks go in the ``envoy.lb`` metadata, never in the header
  ``ORIGINAL_DST`` routes on (a list there was a 503 for every request);
* an HTTP/2 request that ends with trailers is picked (it skipped the picker);
* a ``BUFFERED`` request's stream is not held to its end;
* a picker that hangs is a bounded 503 in the OpenAI error shape.

(The bootstrap's routes, which need no Envoy to read, are checked in ``test_bootstrap``.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import orjson
import pytest

from prefixrouter.epp.envoy import EXT_PROC_FILTER, hcm, http_filter, render, start_envoy
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS, workers
from tests.epp.fleet import (
    BOUND_S,
    MODES,
    Stack,
    chat_body,
    client,
    envoy_stat,
    post,
    requests_done,
    start_engines,
    start_picker,
    start_stack,
    wait_discovered,
    wait_up,
    write_config,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("epp-data-plane"), 2, "--fallbacks", "1") as s:
        yield s


@pytest.mark.parametrize("mode", MODES)
async def test_fallbacks_with_the_shipped_bootstrap_serve_every_request(
    stack: Stack, mode: str
) -> None:
    """``--fallbacks 1``: served by the pick; was a 503 each (``original_dst_host_invalid``)."""
    envoy = stack.envoys[mode]
    names = {e.name for e in stack.engines}
    async with client() as s:
        answers = [await post(s, envoy.url, chat_body(f"fallbacks {mode} {i}")) for i in range(4)]
        streamed = await post(s, envoy.url, chat_body(f"fallbacks {mode}", stream=True))
    assert [(a.status, a.worker in names) for a in answers] == [(200, True)] * 4, answers[0].body
    assert streamed.status == 200 and streamed.done
    assert await envoy_stat(envoy.admin_url, "original_dst_host_invalid") == 0
    suspects = [i for i, w in (await workers(stack.picker.http)).items() if not w["healthy"]]
    assert suspects == []  # Envoy's 503s made workers suspect


def _h2_post(port: int, body: bytes, trailers: bool) -> tuple[dict[bytes, bytes], bytes]:
    """One HTTP/2 POST (prior knowledge) whose body ends with a trailer HEADERS frame.

    No HTTP client at hand sends request trailers, so this speaks HTTP/2
    frames with the ``h2`` state machine over a blocking socket (bounded).
    """
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection((HOST, port), timeout=BOUND_S) as sock:
        conn.initiate_connection()
        request = [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http")]
        request += [(":authority", "epp-test"), ("content-type", "application/json")]
        conn.send_headers(1, request)
        conn.send_data(1, body, end_stream=not trailers)
        if trailers:
            conn.send_headers(1, [("x-client-trailer", "1")], end_stream=True)
        sock.sendall(conn.data_to_send())
        headers: dict[bytes, bytes] = {}
        out = b""
        while True:
            data = sock.recv(65536)
            if not data:
                raise AssertionError(f"connection closed before the stream ended: {out[:200]!r}")
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    headers = {bytes(k): bytes(v) for k, v in ev.headers}
                elif isinstance(ev, h2.events.DataReceived):
                    out += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                    return headers, out
            sock.sendall(conn.data_to_send())


@pytest.mark.parametrize("mode", MODES)
async def test_an_http2_request_with_trailers_is_picked(stack: Stack, mode: str) -> None:
    """Its body ends at the trailers: was forwarded unpicked (round robin, or a lost body)."""
    port = stack.envoys[mode].listen_port
    ok = orjson.dumps(chat_body(f"trailers {mode}", stream=True))
    headers, body = await asyncio.to_thread(_h2_post, port, ok, True)
    assert headers[b":status"] == b"200", body[:300]
    assert headers[b"x-prefixrouter-worker"] in {e.name.encode() for e in stack.engines}
    assert body.rstrip().endswith(b"data: [DONE]")
    # The picker's rules apply: an unknown model is its 404, not the engine's answer,
    # counted by the picker (once: this request's own count, not an earlier case's).
    unknown = orjson.dumps({**chat_body("trailers"), "model": "no-such-model"})
    before = await requests_done(stack.picker.http, 404)
    headers, body = await asyncio.to_thread(_h2_post, port, unknown, True)
    assert headers[b":status"] == b"404" and b"model_not_found" in body
    assert await requests_done(stack.picker.http, 404) == before + 1


async def test_a_buffered_request_streams_its_response(stack: Stack) -> None:
    """``BUFFERED`` requests, ``STREAMED`` responses: the first event comes before the last.

    A buffered response held the whole SSE stream until its end (first event
    at 0.158 s of 0.160 s); streamed, the first comes at once.
    """
    body = chat_body("a long stream", stream=True, max_tokens=4000, ignore_eos=True)
    arrivals: list[float] = []
    async with client() as s:
        t0 = time.monotonic()
        async with s.post(stack.envoys["BUFFERED"].url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data:"):
                    arrivals.append(time.monotonic() - t0)
    assert len(arrivals) > 100
    total = arrivals[-1]
    # Held to the end, every event arrives within a few ms of the last.
    assert arrivals[0] < total / 2, (arrivals[0], total)


@pytest.mark.parametrize("mode", MODES)
async def test_a_hung_picker_is_a_bounded_503_in_the_openai_shape(
    tmp_path: Path, mode: str
) -> None:
    """A stopped picker: the wait for its answer is bounded; a 503 in the OpenAI shape.

    The bootstrap's bound is 45 s (the overload queue's wait and a margin),
    here rendered at 2 s: in ``BUFFERED`` mode the ext_proc filter's
    ``message_timeout`` ends the wait and its ``status_on_error`` is the 503;
    in ``FULL_DUPLEX_STREAMED`` mode (Envoy has no message timeout there)
    the connection manager's ``stream_idle_timeout`` before the pick ends it.
    The body is the OpenAI error shape, from the bootstrap's ``local_reply_config``.
    """
    with Fleet() as fleet:
        engines = start_engines(fleet, 1)
        config = write_config(tmp_path / "epp.yaml", engines, server=dict(ADMIN_CONFIG))
        picker = start_picker(fleet, config)
        pool = [(HOST, engines[0].port)]
        boot = render(free_port(), picker.grpc_port, free_port(), pool, body_mode=mode)
        if mode == "BUFFERED":
            http_filter(hcm(boot), EXT_PROC_FILTER)["message_timeout"] = "2s"
        else:
            hcm(boot)["stream_idle_timeout"] = "2s"
        envoy = start_envoy(fleet, boot, name="envoy-hung", workdir=tmp_path)
        await wait_up(fleet, [*engines, picker.server], [envoy])
        await wait_discovered(picker, ADMIN_HEADERS)
        async with client() as s:
            assert (await post(s, envoy.url, chat_body("before"))).status == 200
            os.kill(picker.server.process.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                hung = await post(s, envoy.url, chat_body("while stopped"))
                waited = time.monotonic() - t0
            finally:
                os.kill(picker.server.process.pid, signal.SIGCONT)
            after = await post(s, envoy.url, chat_body("after"))
    assert hung.status == 503 and waited < 10, (hung.status, waited)
    assert hung.headers["content-type"] == "application/json"
    assert hung.body["error"]["code"] == "endpoint_picker_unavailable"
    assert after.status == 200
