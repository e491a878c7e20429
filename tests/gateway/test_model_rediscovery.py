"""A worker's model list is read again: on restart, on a 404 for a listed model, periodically."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from tests.gateway.fakes import FakeEngine, make_app
from tests.gateway.helpers import Env, gateway_env, run

RARELY = {"metrics_poll": {"models_interval_s": 3600.0}}


async def _listed(env: Env) -> list[str]:
    r = await env.client.get("/v1/models")
    assert r.status == 200
    return [m["id"] for m in (await r.json())["data"]]


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_restart_with_another_model_is_listed_again() -> None:
    async def main() -> None:
        engines = [FakeEngine(start_time=1.0), FakeEngine(start_time=1.0)]
        async with gateway_env(engines=engines, overrides=RARELY) as env:
            assert await _listed(env) == ["tiny"]
            engines[1].model, engines[1].start_time = "tiny2", 2.0  # restarted with tiny2

            async def both() -> bool:
                return await _listed(env) == ["tiny", "tiny2"]

            await _until(both)
            for i in range(6):
                r = await env.chat(f"q{i}", model="tiny2")
                assert r.status == 200, await r.text()
                assert r.headers["X-Prefixrouter-Worker"] == "w1"
                r = await env.chat(f"q{i}")
                assert r.status == 200, await r.text()
                assert r.headers["X-Prefixrouter-Worker"] == "w0"  # w1 no longer serves tiny

    run(main)


def test_a_404_for_a_listed_model_is_retried_and_relists_the_worker() -> None:
    async def main() -> None:
        engines = [FakeEngine(), FakeEngine()]
        async with gateway_env(engines=engines, overrides=RARELY) as env:
            await asyncio.sleep(1.1)  # past REDISCOVER_MIN_S since the first listing
            engines[0].model = "tiny2"  # swapped without a restart the gateway can see
            for i in range(8):
                r = await env.chat(f"question {i}", system=f"system prompt {i} " * 20)
                assert r.status == 200, await r.text()
                assert r.headers["X-Prefixrouter-Worker"] == "w1"
            assert any(b.get("model") == "tiny" for b in engines[0].requests)  # it was tried

            async def relisted() -> bool:
                return await _listed(env) == ["tiny", "tiny2"]

            await _until(relisted)
            r = await env.chat("now", model="tiny2")
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w0"

    run(main)


def test_the_last_workers_404_is_answered_and_the_model_stays_known() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with gateway_env(engines=[engine], overrides=RARELY) as env:
            await asyncio.sleep(1.1)
            engine.model = "tiny2"
            r = await env.chat("hi")
            assert r.status == 404  # the engine's own answer: no other worker to try
            assert (await r.json())["error"]["message"] == "The model `tiny` does not exist."

            async def relisted() -> bool:
                return await _listed(env) == ["tiny2"]

            await _until(relisted)
            # No worker lists it now: an outage of a known model (503), as for a
            # removed worker's model, not a name never served (404).
            r = await env.chat("hi again")
            assert r.status == 503 and "Retry-After" in r.headers
            r = await env.chat("nonsense", model="never-served")
            assert r.status == 404

    run(main)


def test_adapters_loaded_at_runtime_are_listed_periodically() -> None:
    async def main() -> None:
        engine = FakeEngine()
        overrides = {"metrics_poll": {"models_interval_s": 0.3}}
        async with gateway_env(engines=[engine], overrides=overrides) as env:
            engine.adapters = ("lora-a",)  # POST /v1/load_lora_adapter on the engine

            async def loaded() -> bool:
                return await _listed(env) == ["lora-a", "tiny"]

            await _until(loaded)
            r = await env.chat("use the adapter", model="lora-a")
            assert r.status == 200, await r.text()
            engine.adapters = ()  # unloaded

            async def unloaded() -> bool:
                return await _listed(env) == ["tiny"]

            await _until(unloaded)
            assert env.state.registry.serves("lora-a")  # 503 while gone, not 404
            r = await env.chat("use the adapter", model="lora-a")
            assert r.status == 503

    run(main)


def test_models_carry_root_parent_and_max_model_len() -> None:
    async def main() -> None:
        engines = [FakeEngine(adapters=("lora-a",)), FakeEngine(adapters=("lora-a",))]
        apps = []
        for engine, mml in zip(engines, (8192, 4096), strict=True):
            app = make_app(engine)

            @web.middleware
            async def add_len(request: web.Request, handler: Any, mml: int = mml) -> Any:
                resp = await handler(request)
                if request.path == "/v1/models":
                    data = orjson.loads(resp.body)
                    for item in data["data"]:
                        item["max_model_len"] = mml
                    resp.body = orjson.dumps(data)
                return resp

            app.middlewares.append(add_len)
            apps.append(app)
        async with gateway_env(apps=apps) as env:
            r = await env.client.get("/v1/models")
            cards = {m["id"]: m for m in (await r.json())["data"]}
            assert cards["tiny"]["root"] == "tiny" and cards["tiny"]["parent"] is None
            assert cards["lora-a"]["root"] == "/lora" and cards["lora-a"]["parent"] == "tiny"
            # The smallest of the workers': a client sizing its context fits on any.
            assert cards["tiny"]["max_model_len"] == 4096
            r = await env.client.get("/v1/models/lora-a")
            assert (await r.json()) == cards["lora-a"]
        # A worker whose models are configured reports nothing more.
        async with gateway_env(n=1, worker_options=[{"models": ["tiny"]}]) as env:
            r = await env.client.get("/v1/models")
            (card,) = (await r.json())["data"]
            assert set(card) == {"id", "object", "created", "owned_by"}

    run(main)
