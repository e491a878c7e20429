"""Two gateway replicas connected to a real vLLM engine that binds its KV-event publisher.

Run with ``pytest -m vllm -q tests/real_vllm/test_kv_events_replicas.py``
(about a minute: one engine, two gateways). The engine's
``--kv-events-config`` has ``"endpoint": "tcp://*:P"``, so vLLM binds its PUB
socket; both gateways connect to it (``workers[].kv_events_connect``) and no
gateway binds anything. A document asked through gateway A only is then
predicted exactly by gateway B, which learned of it from the engine's events
alone; after the engine restarts, both gateways' sockets reconnect by
themselves and hear the new process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefixrouter.harness.processes import Fleet
from prefixrouter.real_engines.vllm_fleet import (
    KvEventsOptions,
    VllmEngine,
    VllmFleet,
    VllmOptions,
    VllmSetup,
    ensure_vllm,
)
from tests import admin_client
from tests.real_vllm.conftest import (
    BLOCK,
    KV_BLOCKS,
    MAX_MODEL_LEN,
    Gateway,
    chat,
    decisions,
    document,
    post_chat,
    until,
    workers,
)

pytestmark = pytest.mark.vllm
WORKER = "vllm0"


@dataclass
class Replicas:
    setup: VllmSetup
    engines: VllmFleet
    gateways: list[Gateway]
    tmp: Path

    @property
    def engine(self) -> VllmEngine:
        return self.engines.engines[0]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    setup = ensure_vllm()
    tmp = tmp_path_factory.mktemp("vllm-replicas")
    options = VllmOptions(
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=KV_BLOCKS,
        kv_events=KvEventsOptions(endpoint=None, replay=True),  # the engine binds
    )
    with VllmFleet(1, options, setup=setup, log_dir=tmp / "logs") as engines, Fleet() as procs:
        (engine,) = engines.start()
        assert engine.publisher is not None
        config: dict[str, Any] = {
            "workers": [
                {
                    "url": engine.url,
                    "id": WORKER,
                    "kv_events_topic": engine.topic,
                    "kv_events_connect": engine.publisher,
                    "kv_replay_endpoint": engine.replay_endpoint,
                }
            ],
            "routing": {"mode": "token", "tokenizer": str(setup.model)},
            "server": dict(admin_client.ADMIN_CONFIG),
            "metrics_poll": {"interval_s": 0.5},
            "health": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "timeout_s": 2.0},
            "decision_log": {"flush_interval_s": 0.1},
            "proxy": {"request_timeout_s": 120},
        }
        path = tmp / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))  # the same file for both replicas
        servers = [
            procs.start(f"gateway-{n}", "prefixrouter.gateway", ["--config", str(path)])
            for n in "ab"
        ]
        asyncio.run(procs.wait_healthy(servers, timeout_s=60))
        yield Replicas(setup, engines, [Gateway(s) for s in servers], tmp)


async def messages(gw: Gateway) -> int:
    return int((await workers(gw))[WORKER]["kv_events"]["messages"])


async def until_both_hear(r: Replicas, seed: int) -> None:
    """Small requests straight to the engine until both gateways heard its events.

    A bound PUB socket drops what it sends before a subscriber is connected
    (the gateways' start, a reconnect after a restart).
    """
    before = [await messages(g) for g in r.gateways]
    for attempt in range(60):
        await post_chat(r.engine.url, chat(document(seed + attempt, 100), "warm-up"))
        now = [await messages(g) for g in r.gateways]
        if all(n > b for n, b in zip(now, before, strict=True)):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the gateways never heard the engine's events")


async def asked_on_a_predicted_by_b(r: Replicas, seed: int) -> None:
    a, b = r.gateways
    doc = document(seed, 2000)
    stored = (await workers(b))[WORKER]["kv_events"]["stored_events"]
    first = await post_chat(a.url, chat(doc, "First?"))
    await decisions(a, [first["id"]])

    async def b_heard() -> bool:
        return bool((await workers(b))[WORKER]["kv_events"]["stored_events"] > stored)

    await until(b_heard, 30, "gateway B hearing the engine store the document")
    second = await post_chat(b.url, chat(doc, "Second?"))
    (rec,) = await decisions(b, [second["id"]])
    print(f"B predicted {rec['predicted_cached_tokens']} actual {rec['actual_cached_tokens']}")
    assert rec["actual_cached_tokens"] >= 1900
    assert rec["predicted_cached_tokens"] == rec["actual_cached_tokens"]


def test_both_replicas_hear_the_engine_and_reconnect_after_its_restart(
    replicas: Replicas,
) -> None:
    async def first_process() -> None:
        await until_both_hear(replicas, 500)
        await asked_on_a_predicted_by_b(replicas, 510)
        for gw in replicas.gateways:
            feed = (await workers(gw))[WORKER]["kv_events"]
            assert feed["connect"] == replicas.engine.publisher
            assert feed["gaps"] == 0 and feed["decode_errors"] == 0

    asyncio.run(first_process())
    replicas.engines.restart(replicas.engine)  # same ports, a cold cache

    async def second_process() -> None:
        for gw in replicas.gateways:

            async def healthy(gw: Gateway = gw) -> bool:
                return bool((await workers(gw))[WORKER]["healthy"])

            await until(healthy, 60, "the gateway's health check passing again")
        await until_both_hear(replicas, 600)
        for gw in replicas.gateways:
            w = (await workers(gw))[WORKER]
            # The sequence reset, or the new process_start_time, told each gateway.
            assert w["kv_events"]["restarts"] + w["restarts"] >= 1
        await asked_on_a_predicted_by_b(replicas, 610)

    asyncio.run(second_process())
