"""A client that disconnects has its engine request aborted, as vLLM does.

Long requests (seconds of decoding) are sent streamed and non-streamed, the
clients hang up, and ``/metrics`` must show the batch and the queue empty
within a fraction of a second, where an engine that computed them to their
end would stay busy for seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from aiohttp import ClientResponse

from prefixrouter.core.types import WorkerId
from prefixrouter.sim.engine import EngineModel
from prefixrouter.sim.profiles import get_profile
from prefixrouter.simulated_engine import EngineServer
from prefixrouter.simulated_engine.runtime import EngineRuntime
from tests.simulated_engine.conftest import long_text, served

LABELS = '{engine="0",model_name="tiny"}'
MAX_TOKENS = 1000  # tiny-cpu decodes ~3 ms/step: >= 6 s of wall time at time_scale 0.5
DEADLINE_S = 1.0  # how long the gauges may take to drop after the disconnects


async def _gauges(client: Any) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for line in text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"vllm:{name}{LABELS} "):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def _wait_for(client: Any, ok: Any, deadline_s: float) -> dict[str, float]:
    """Poll the gauges until ``ok(gauges)`` or the deadline; return the last reading."""
    end = time.monotonic() + deadline_s
    while True:
        g = await _gauges(client)
        if ok(g) or time.monotonic() > end:
            return g
        await asyncio.sleep(0.01)


async def _raw_post(host: str, port: int, path: str, body: dict[str, Any]) -> asyncio.StreamWriter:
    """Send a non-streamed request on its own TCP connection; the caller hangs up."""
    _, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    return writer


async def test_disconnected_clients_leave_the_engine_within_a_step() -> None:
    async with served(time_scale=0.5) as (client, server):
        assert isinstance(server, EngineServer)
        url = client.make_url("/")
        host, port = url.host, url.port
        assert host is not None and port is not None
        streams: list[ClientResponse] = []
        for i in range(3):
            body = {"prompt": long_text(60, seed=i), "max_tokens": MAX_TOKENS, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200
            streams.append(resp)
        writers = []
        for i in range(3, 6):
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": long_text(60, seed=i)}],
                "max_tokens": MAX_TOKENS,
            }
            writers.append(await _raw_post(host, port, "/v1/chat/completions", chat))
        # Six long requests: as many run as the KV cache holds, the rest queue.
        busy = await _wait_for(
            client,
            lambda g: g["num_requests_running"] + g["num_requests_waiting"] == 6,
            5.0,
        )
        assert busy["num_requests_running"] >= 1, busy
        assert busy["num_requests_running"] + busy["num_requests_waiting"] == 6, busy
        assert busy["kv_cache_usage_perc"] > 0
        for resp in streams:
            await resp.content.readuntil(b"\n\n")  # the first token came; then hang up
            resp.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        t0 = time.monotonic()
        idle = await _wait_for(
            client,
            lambda g: g["num_requests_running"] == g["num_requests_waiting"] == 0,
            DEADLINE_S,
        )
        took = time.monotonic() - t0
        assert idle["num_requests_running"] == 0, (idle, took)
        assert idle["num_requests_waiting"] == 0, (idle, took)
        assert idle["kv_cache_usage_perc"] == 0, idle
        engine = server.engine
        assert engine.aborted == 6 and engine.completed == 0
        assert engine.next_wakeup() is None  # nothing left to compute
        assert server.in_flight == 0 and server.runtime.in_flight == 0
        # The engine still serves, and reuses what the aborted prefills cached.
        again = {"prompt": long_text(60, seed=0), "max_tokens": 2}
        data = await (await client.post("/v1/completions", json=again)).json()
        assert data["usage"]["completion_tokens"] == 2
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_cancelling_a_decoding_request_frees_its_slot_and_kv() -> None:
    rt = EngineRuntime(EngineModel(WorkerId("w"), get_profile("tiny-cpu")), time_scale=1.0)
    handle = rt.submit((), 64, 2000)  # ~6 s of decoding on tiny-cpu
    other = rt.submit((), 32, 3)
    await handle.first
    assert rt.engine.num_running == 2
    rt.cancel(handle.request_id)
    assert rt.engine.aborted == 0  # it leaves at the end of the step in flight
    done = await asyncio.wait_for(other.done, 1.0)
    assert done.output_tokens == 3
    end = time.monotonic() + 1.0
    while rt.engine.num_running and time.monotonic() < end:
        await asyncio.sleep(0.005)
    assert rt.engine.num_running == 0 and rt.engine.kv_used_blocks == 0
    assert rt.engine.aborted == 1 and rt.engine.next_wakeup() is None
    assert not handle.done.done()
    rt.cancel(handle.request_id)  # again, and after completion: nothing happens
    rt.cancel(other.request_id)
    assert rt.engine.aborted == 1 and rt.engine.completed == 1
    rt.stop()
