"""Real vLLM CPU engines and the gateway in front of them (``pytest -m vllm``).

One fleet per session: two vLLM engines (tiny local model, prefix caching,
prompt-token details, block size 32, a KV pool of ``KV_BLOCKS`` blocks each so
evictions happen, KV events to the gateway's bound SUB socket with a replay
socket each), each pinned to its own core. The vLLM venv and the model are
created by ``scripts/setup_vllm.sh`` when missing (a few minutes, once).

The gateway runs as a real subprocess in token mode with the model's own
tokenizer, KV events on, and tenants ``acme`` and ``globex`` that must not
share cache (vLLM workers get a ``cache_salt`` each). Further gateways (round
robin, no events) start on demand in front of the same engines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.harness.texts import record_text
from prefixrouter.real_engines.vllm_fleet import (
    KvEventsOptions,
    VllmFleet,
    VllmOptions,
    VllmSetup,
    ensure_vllm,
)
from tests import admin_client

TENANT_KEYS = {"k-acme": "acme", "k-globex": "globex"}
"""Client keys of the isolated tenants (the key, never a header, names the tenant)."""

BLOCK = 32
KV_BLOCKS = 640  # 20,480 tokens per engine: two 8k documents fit, three do not
MAX_MODEL_LEN = (KV_BLOCKS - 1) * BLOCK
REQUEST_TIMEOUT_S = 600
"""The gateways' upstream limit; clients wait a minute longer, so a 504/502 is seen."""


def document(seed: int, tokens: int) -> str:
    """A deterministic document of about ``tokens`` tokens of the tiny model."""
    return record_text(seed, tokens)


def chat(doc: str, question: str, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Answer from this document.\n\n" + doc},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


@dataclass
class Gateway:
    """A gateway subprocess and what it runs in front of."""

    server: Server

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class VllmCluster:
    setup: VllmSetup
    engines: VllmFleet
    endpoint: str
    procs: Fleet
    tmp: Path
    gateway: Gateway | None = None

    def worker_id(self, index: int) -> str:
        return f"vllm{index}"

    def engine_url(self, worker_id: str) -> str:
        index = int(worker_id.removeprefix("vllm"))
        return next(e.url for e in self.engines.engines if e.index == index)

    def start_gateway(
        self, policy: str, *, events: bool, name: str, mode: str = "token"
    ) -> Gateway:
        """A gateway subprocess on the engines (``mode`` text: no tokenizer, no events)."""
        workers = []
        for e in self.engines.engines:
            w: dict[str, Any] = {"url": e.url, "id": self.worker_id(e.index)}
            if events:
                w["kv_events_topic"] = e.topic
                w["kv_replay_endpoint"] = e.replay_endpoint
            workers.append(w)
        config: dict[str, Any] = {
            "workers": workers,
            "policy": {"name": policy},
            "routing": (
                {"mode": "token", "tokenizer": str(self.setup.model)}
                if mode == "token"
                else {"mode": "text"}
            ),
            "tenants": {"acme": {"share_cache": False}, "globex": {"share_cache": False}},
            "api_keys": TENANT_KEYS,
            "server": dict(admin_client.ADMIN_CONFIG),
            "salt_secret": "test-secret",
            "metrics_poll": {"interval_s": 0.5},
            "health": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, "timeout_s": 2.0},
            "decision_log": {"ring_size": 5000, "flush_interval_s": 0.1},
            # Generous: on an AVX2-only CPU vLLM's CPU engine is about 3x slower,
            # a cold 8k-token prefill takes about 15 s, and round robin's queue in the
            # doc-QA comparison reaches about 110 s. A tighter limit turns that
            # queue into 502s and fails the comparison instead of measuring it.
            "proxy": {"request_timeout_s": REQUEST_TIMEOUT_S},
        }
        if events:
            config["kv_events"] = {"endpoint": self.endpoint}
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        server = self.procs.start(
            "gateway-" + name, "prefixrouter.gateway", ["--config", str(path)]
        )
        asyncio.run(self.procs.wait_healthy([server], timeout_s=60))
        return Gateway(server)

    def stop_gateway(self, gw: Gateway) -> None:
        self.procs.stop(gw.server)

    def reset_caches(self) -> None:
        """Empty every engine's prefix cache and wait until the main gateway knows.

        vLLM queues ``AllBlocksCleared`` at the reset and publishes it with the
        outputs of its next step, so until a request runs, the gateway still
        believes what the engine held before. The harness's reset sends one
        tiny request straight to each engine to make that step; then the
        gateway's count of applied clears must grow for every engine. Without
        this, a test that measures right after a reset routes its first
        requests on blocks that no longer exist.
        """
        gw = self.gateway
        assert gw is not None

        async def settle() -> None:
            before = {w: s["kv_events"]["cleared_events"] for w, s in (await workers(gw)).items()}
            await reset_prefix_caches(self.engines.urls)

            async def applied() -> bool:
                now = {w: s["kv_events"]["cleared_events"] for w, s in (await workers(gw)).items()}
                return all(now[w] > n for w, n in before.items())

            await until(applied, 30, "the engines' AllBlocksCleared at the gateway")

        asyncio.run(settle())


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    setup = ensure_vllm()
    tmp = tmp_path_factory.mktemp("real-vllm")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = VllmOptions(
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=KV_BLOCKS,
        kv_events=KvEventsOptions(endpoint=endpoint, replay=True),
    )
    with VllmFleet(2, options, setup=setup, log_dir=tmp / "logs") as engines, Fleet() as procs:
        engines.start()
        cluster = VllmCluster(setup, engines, endpoint, procs, tmp)
        cluster.gateway = cluster.start_gateway("prefix_aware", events=True, name="main")
        yield cluster


# ------------------------------------------------------------------ client helpers


async def post_chat(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """A streamed chat request: ``{"id", "worker", "ttft_s", "usage"}``."""
    loop = asyncio.get_running_loop()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S + 60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        t0 = loop.time()
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            ttft = None
            usage = None
            async for line in r.content:
                if ttft is None and line.startswith(b"data:"):
                    ttft = loop.time() - t0
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or usage
            return {
                "id": r.headers.get("X-Request-Id"),
                "worker": r.headers.get("X-Prefixrouter-Worker"),
                "ttft_s": ttft,
                "usage": usage,
            }


async def decisions(gw: Gateway, ids: list[str]) -> list[dict[str, Any]]:
    """The decision records of ``ids`` once their outcomes are in."""
    return await admin_client.decisions(gw.url, ids)


async def workers(gw: Gateway) -> dict[str, dict[str, Any]]:
    return await admin_client.workers(gw.url)


async def until(check: Any, timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll ``await check()`` until it returns something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        await asyncio.sleep(0.1)
