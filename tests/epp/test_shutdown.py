"""SIGTERM drains the picker: open streams finish, new requests are refused, readiness drops.

In ``FULL_DUPLEX_STREAMED`` mode every response body flows through the
picker, so a picker that stopped at once cut every running completion off
(about 1 s after SIGTERM, no ``[DONE]``). One slow engine (time scale 1), one
picker, one Envoy on the shipped bootstrap.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixrouter.harness.processes import Fleet
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS
from tests.epp.fleet import (
    BOUND_S,
    chat_body,
    client,
    engine_args,
    post,
    start_picker,
    start_proxy,
    wait_discovered,
    wait_up,
    write_config,
)

SLOW = engine_args(time_scale=1)  # about 4 ms a token: a long stream outlasts the SIGTERM
GRACE_S = 20
EXIT_S = 5.0
"""A drained picker exits within this of its last stream's end: well before :data:`GRACE_S`."""


async def _grpc_readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return int(reply.status)


def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests(tmp_path: Path) -> None:
    async def body() -> None:
        with Fleet() as fleet:
            engine = fleet.start("engine0", "prefixrouter.simulated_engine", SLOW)
            config = write_config(tmp_path / "epp.yaml", [engine], server=dict(ADMIN_CONFIG))
            picker = start_picker(fleet, config, "--shutdown-grace-s", str(GRACE_S))
            envoy = start_proxy(fleet, picker, [engine], tmp_path)
            await wait_up(fleet, [engine, picker.server], [envoy])
            await wait_discovered(picker, ADMIN_HEADERS)
            assert await _grpc_readiness(picker.grpc_port) == health_pb2.HealthCheckResponse.SERVING
            long = chat_body("a long answer", stream=True, max_tokens=600, ignore_eos=True)
            async with client() as s:
                first = asyncio.Event()
                events: list[bytes] = []

                async def stream() -> None:
                    url = envoy.url + "/v1/chat/completions"
                    async with s.post(url, json=long) as r:
                        assert r.status == 200
                        async for line in r.content:
                            if line.startswith(b"data:"):
                                events.append(line.strip())
                                first.set()

                running = asyncio.create_task(stream())
                await asyncio.wait_for(first.wait(), BOUND_S)
                picker.server.process.send_signal(signal.SIGTERM)
                # Not ready at once, on both ports (polled: the signal is handled async).
                for _ in range(int(BOUND_S / 0.02)):
                    async with s.get(picker.http + "/ready") as r:
                        if r.status == 503:
                            assert (await r.json())["status"] == "shutting_down"
                            break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError("/ready still 200 after SIGTERM")
                not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
                assert await _grpc_readiness(picker.grpc_port) == not_serving
                refused = await post(s, envoy.url, chat_body("after SIGTERM"))
                assert not running.done()  # the stream was still running meanwhile
                await asyncio.wait_for(running, BOUND_S)
                ended = time.monotonic()
            assert events[-1] == b"data: [DONE]" and len(events) > 100
            assert refused.status == 503 and refused.worker is None
            assert refused.body["error"]["code"] == "shutting_down"
            assert refused.headers["retry-after"] == "1"
            # Drained: the picker exits on its own once its last stream ended, well before
            # the grace period (one that sat the grace out would exit 20 s after SIGTERM).
            code = await asyncio.to_thread(picker.server.process.wait, EXIT_S)
            exited_after = time.monotonic() - ended
            assert code == 0 and exited_after < EXIT_S, (code, exited_after)

    asyncio.run(asyncio.wait_for(body(), 90))
