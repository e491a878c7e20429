"""The gateway over HTTP in front of fake vLLM engines (one event loop, loopback)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.core.types import WorkerId
from prefixrouter.gateway.config import WorkerConfig
from tests.admin_client import ADMIN_HEADERS
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import gateway_env, run

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~2,700 chars


def _error(data: Any) -> dict[str, Any]:
    assert set(data) == {"error"}
    err = data["error"]
    assert {"message", "type", "code"} <= set(err)
    return dict(err)


def test_non_streaming_pass_through_and_affinity() -> None:
    async def body() -> None:
        async with gateway_env() as env:
            workers = set()
            for i in range(5):
                r = await env.chat(LONG + f" question {i}", temperature=0.3, vendor_field={"a": 1})
                assert r.status == 200
                data = await r.json()
                assert data["object"] == "chat.completion"
                assert data["usage"]["prompt_tokens"] > 600
                workers.add(r.headers["X-Prefixrouter-Worker"])
            assert len(workers) == 1  # same prefix -> same worker while idle
            sent = [req for e in env.engines for req in e.requests]
            assert all(
                req["vendor_field"] == {"a": 1} and req["temperature"] == 0.3 for req in sent
            )
            assert all("stream_options" not in req and "cache_salt" not in req for req in sent)
            logs = await env.decisions()
            assert [d["actual_cached_tokens"] > 0 for d in logs] == [False, True, True, True, True]
            last = logs[-1]
            for key in (
                "request_id", "model", "tenant", "prefix_key", "prefix_class", "selected_worker",
                "candidate_workers", "predicted_cached_tokens", "actual_cached_tokens",
                "queue_wait_ms", "prefill_tokens", "ttft_ms", "decision",
            ):  # fmt: skip
                assert key in last, key
            assert last["decision"]["tier"] in ("exact", "partial")
            assert last["prefill_tokens"] == last["prompt_tokens"] - last["actual_cached_tokens"]
            assert last["prefix_class"] == "system"

    run(body)


def test_streaming_injects_and_strips_the_usage_chunk() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            r = await env.chat(LONG, stream=True, max_tokens=3)
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            text = await r.text()
            assert '"usage"' not in text and text.endswith("data: [DONE]\n\n")
            assert text.count("data: ") == 5  # 3 tokens, finish chunk, [DONE]
            upstream = env.engines[0].requests[-1]
            assert upstream["stream_options"] == {"include_usage": True}
            # vLLM's per-chunk usage applies only with include_usage: not forced on.
            continuous = {"include_usage": False, "continuous_usage_stats": True}
            r = await env.chat(LONG, stream=True, max_tokens=3, stream_options=continuous)
            assert '"usage"' not in await r.text()
            upstream = env.engines[0].requests[-1]
            assert upstream["stream_options"] == {"include_usage": True}
            r = await env.chat(
                LONG, stream=True, max_tokens=3, stream_options={"include_usage": True}
            )
            text = await r.text()
            assert text.count('"usage"') == 1 and '"choices":[]' in text
            logs = await env.decisions()
            assert logs[0]["ttft_ms"] is not None and logs[0]["stream"]
            assert logs[1]["actual_cached_tokens"] > 0  # feedback from the stream's usage

    run(body)


def test_completions_endpoint() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            payload = {"model": "tiny", "prompt": LONG, "max_tokens": 2}
            r = await env.client.post("/v1/completions", json=payload)
            assert r.status == 200 and (await r.json())["object"] == "text_completion"
            r = await env.client.post("/v1/completions", json={**payload, "stream": True})
            text = await r.text()
            assert r.status == 200 and '"usage"' not in text and "[DONE]" in text

    run(body)


def test_bad_input() -> None:
    async def body() -> None:
        async with gateway_env(n=1, overrides={"server": {"max_body_bytes": 4096}}) as env:
            c = env.client
            r = await c.post("/v1/chat/completions", data=b"{not json")
            assert r.status == 400 and _error(await r.json())["code"] == "invalid_json"
            # (No model at all is the one served model's request, as vLLM serves it.)
            r = await c.post("/v1/chat/completions", json={"model": 5, "messages": []})
            err = _error(await r.json())
            assert r.status == 400 and err["param"] == "model" and "model" in err["message"]
            r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": "x"})
            assert r.status == 400 and _error(await r.json())["param"] == "messages"
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": 1.5})
            assert r.status == 400 and _error(await r.json())["param"] == "prompt"
            r = await env.chat("hi", model="gpt-unknown")
            err = _error(await r.json())
            assert r.status == 404 and err["code"] == "model_not_found"
            r = await env.chat("x" * 5000)
            assert r.status == 413 and _error(await r.json())["code"] == "request_too_large"
            r = await c.get("/nope")
            assert r.status == 404 and _error(await r.json())
            env.engines[0].status = 400  # an upstream error keeps its status and shape
            r = await env.chat("hi")
            assert r.status == 400 and _error(await r.json())["message"] == "overloaded"
            assert len(env.engines[0].requests) == 1  # a 400 is not retried
            env.engines[0].status = 503  # a refusal everywhere: the upstream's 503
            r = await env.chat("hi")
            assert r.status == 503 and _error(await r.json())
            r = await c.get("/metrics")
            text = await r.text()
            assert 'prefixrouter_requests_total{decision="none",status="400",worker=""} 4.0' in text
            assert 'status="413"' in text and 'status="404"' in text

    run(body)


def test_no_healthy_worker_is_503_with_retry_after() -> None:
    async def body() -> None:
        async with gateway_env(n=2) as env:
            for e in env.engines:
                e.healthy = False
            for _ in range(100):
                if not any(w.healthy for w in env.state.registry.workers.values()):
                    break
                await asyncio.sleep(0.05)
            r = await env.chat("hi")
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert _error(await r.json())["code"] == "no_healthy_worker"
            # /health is liveness: the gateway is alive in an engine outage (a failing
            # liveness probe would restart every gateway); the body says no worker is up.
            r = await env.client.get("/health")
            assert r.status == 200
            assert await r.json() == {
                "status": "no_healthy_worker",
                "healthy_workers": 0,
                "workers": 2,
            }
            env.engines[1].healthy = True  # back after the backoff re-check
            for _ in range(100):
                if env.state.registry.workers[WorkerId("w1")].healthy:
                    break
                await asyncio.sleep(0.05)
            r = await env.chat("hi")
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w1"

    run(body)


def test_refusal_and_unreachable_workers_are_retried_before_the_first_byte() -> None:
    async def body() -> None:
        engines = [FakeEngine(status=503), FakeEngine(die_before_first_byte=True), FakeEngine()]
        overrides = {"policy": {"name": "round_robin"}}
        async with gateway_env(engines=engines, overrides=overrides) as env:
            for i in range(6):
                r = await env.chat(LONG + str(i), stream=i % 2 == 1)
                assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w2"
                await r.read()
            logs = await env.decisions()
            assert all(d["selected_worker"] == "w2" and d["status"] == 200 for d in logs)
            retried = {w for d in logs for w in d["retried_from"]}
            assert retried == {"w0", "w1"}
            assert max(d["attempts"] for d in logs) >= 2
            # the unreachable one left routing; the refusing one did not (it is alive)
            reg = env.state.registry.workers
            assert not reg[WorkerId("w1")].healthy and reg[WorkerId("w0")].healthy
            r = await env.client.get("/metrics")
            assert 'prefixrouter_retries_total{status="503",worker="w0"}' in await r.text()

    run(body)


def test_every_worker_failing_is_a_502_naming_each_and_is_logged() -> None:
    async def body() -> None:
        engines = [FakeEngine(die_before_first_byte=True) for _ in range(2)]
        async with gateway_env(engines=engines) as env:
            r = await env.chat("hi")
            err = _error(await r.json())
            assert r.status == 502 and err["code"] == "upstream_unreachable"
            assert "w0:" in err["message"] and "w1:" in err["message"]
            (log,) = await env.decisions()
            assert log["status"] == 502 and log["attempts"] == 2
            assert sorted(log["retried_from"]) == ["w0", "w1"]
            assert "w0:" in log["error"] and "w1:" in log["error"]
            assert env.state.dispatch.load(WorkerId("w0")).in_flight == 0

    run(body)


def test_killed_worker_is_retried_and_marked_unhealthy() -> None:
    async def body() -> None:
        async with gateway_env(n=2) as env:
            r = await env.chat(LONG)
            first = r.headers["X-Prefixrouter-Worker"]
            i = int(first[1])
            await env.servers[i].close()  # the warm worker dies
            r = await env.chat(LONG)
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] != first
            assert not env.state.registry.workers[WorkerId(first)].healthy

    run(body)


def test_no_second_worker_after_bytes_reached_the_client() -> None:
    async def body() -> None:
        engines = [FakeEngine(die_after_chunks=2), FakeEngine(), FakeEngine()]
        async with gateway_env(engines=engines) as env:
            env.state.registry.workers[WorkerId("w1")].draining = True
            env.state.registry.workers[WorkerId("w2")].draining = True
            env.state.registry._rebuild()
            r = await env.chat(LONG, stream=True, max_tokens=6)
            text = await r.text()
            assert r.status == 200
            assert text.count('"content"') == 2 and '"error"' in text  # truncated + error event
            env.state.registry.workers[WorkerId("w1")].draining = False
            env.state.registry._rebuild()
            await asyncio.sleep(0.05)
            assert not engines[1].requests and not engines[2].requests
            logs = await env.decisions(1)
            assert logs[0]["status"] == 502 and logs[0]["attempts"] == 1

    run(body)


def test_client_disconnect_cancels_the_upstream_request() -> None:
    async def body() -> None:
        engines = [FakeEngine(chunk_delay_s=0.05)]
        async with gateway_env(engines=engines) as env:
            r = await env.chat(LONG, stream=True, max_tokens=200)
            await r.content.readany()
            r.close()  # the client goes away mid-stream
            for _ in range(100):
                if engines[0].cancelled:
                    break
                await asyncio.sleep(0.02)
            assert engines[0].cancelled == 1
            for _ in range(100):
                if env.state.dispatch.load(WorkerId("w0")).in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert env.state.dispatch.load(WorkerId("w0")).in_flight == 0
            engines[0].chunk_delay_s = 0
            engines[0].delay_s = 5.0  # non-streaming: the client gives up while waiting
            payload = {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}
            with contextlib.suppress(TimeoutError):
                await env.client.post(
                    "/v1/chat/completions", json=payload, timeout=aiohttp.ClientTimeout(total=0.3)
                )
            for _ in range(100):
                if engines[0].cancelled == 2:
                    break
                await asyncio.sleep(0.02)
            assert engines[0].cancelled == 2
            logs = await env.decisions()
            assert logs[-1]["status"] == 499

    run(body)


def test_admin_add_drain_remove() -> None:
    async def body() -> None:
        engines = [FakeEngine(delay_s=0.3), FakeEngine()]
        async with gateway_env(engines=engines[:1]) as env:
            from aiohttp.test_utils import TestServer

            from tests.gateway.fakes import make_app

            extra = TestServer(make_app(engines[1]))
            await extra.start_server()
            try:
                c = env.client
                r = await env.admin(
                    "POST", "/admin/workers", json={"url": str(extra.make_url("")), "id": "x"}
                )
                assert r.status == 201 and (await r.json())["healthy"]
                r = await env.admin(
                    "POST", "/admin/workers", json={"url": str(extra.make_url("")), "id": "x"}
                )
                assert r.status == 409
                r = await env.admin("POST", "/admin/workers", json={"url": "nope"})
                assert r.status == 400 and _error(await r.json())["param"] == "url"
                r = await env.admin("GET", "/admin/workers")
                assert [w["id"] for w in (await r.json())["workers"]] == ["w0", "x"]
                env.state.registry.workers[WorkerId("x")].draining = True
                env.state.registry._rebuild()
                slow = asyncio.ensure_future(env.chat(LONG))
                await asyncio.sleep(0.1)
                env.state.registry.workers[WorkerId("x")].draining = False
                env.state.registry._rebuild()
                r = await env.admin(
                    "DELETE", "/admin/workers/w0"
                )  # drains the in-flight request first
                result = await r.json()
                assert r.status == 200 and result["drained"] and result["waited_s"] > 0.05
                assert (await slow).status == 200
                r = await env.chat(LONG)
                assert r.headers["X-Prefixrouter-Worker"] == "x"
                assert WorkerId("w0") not in env.state.dispatch.router.index._lru
                r = await env.admin("DELETE", "/admin/workers/w0")
                assert r.status == 404
                r = await c.get("/v1/models")
                assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
            finally:
                await extra.close()

    run(body)


def test_admin_add_with_a_taken_kv_events_topic_is_409_and_changes_nothing() -> None:
    """A topic is one worker's: a second claim is refused whole, never half-registered."""

    async def body() -> None:
        from prefixrouter.harness.ports import free_port

        events = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
        async with gateway_env(n=1, overrides={"kv_events": events}) as env:
            reg = env.state.registry
            url = str(env.servers[0].make_url(""))

            async def add(**worker: str) -> Any:
                # A path of its own: one engine's URL under two ids is refused (409, url).
                body = {"url": f"{url}/{worker['id']}", **worker}
                return await env.admin("POST", "/admin/workers", json=body)

            r = await add(id="a", kv_events_topic="x")
            assert r.status == 201
            # The id "x" is free, but its default topic (the id) is a's.
            r = await add(id="x")
            assert r.status == 409
            err = _error(await r.json())
            assert err["code"] == "conflict" and err["param"] == "kv_events_topic"
            assert "'x'" in err["message"] and "'a'" in err["message"]
            # An explicit topic that is another worker's default.
            r = await add(id="b", kv_events_topic="w0")
            assert r.status == 409 and "'w0'" in _error(await r.json())["message"]
            r = await env.admin("GET", "/admin/workers")
            assert [w["id"] for w in (await r.json())["workers"]] == ["w0", "a"]
            assert set(reg.workers) == {"w0", "a"}
            assert [v.worker_id for v in reg.views()] == ["w0", "a"]
            assert reg.events is not None
            assert {f.topic: f.worker_id for f in reg.events.feeds()} == {"w0": "w0", "x": "a"}
            # A removed worker's feed keeps its topic until its poller has stopped.
            reg.events.add_worker(WorkerId("gone"), "g", lambda lora, salt: None)
            r = await add(id="c", kv_events_topic="g")
            assert r.status == 409 and "'gone'" in _error(await r.json())["message"]
            # Whatever the subscriber refuses, the registry is left as it was.
            reg.topic_owner = lambda topic: None  # type: ignore[method-assign]
            with pytest.raises(KeyError):
                reg._add(WorkerConfig(url=url, id="c", kv_events_topic="g"))
            del reg.topic_owner
            assert set(reg.workers) == {"w0", "a"}
            assert [v.worker_id for v in reg.views()] == ["w0", "a"]
            reg.events.remove_worker(WorkerId("gone"))
            # Nothing of the refused worker is left: it can be added with a free topic.
            r = await add(id="x", kv_events_topic="y")
            assert r.status == 201
            assert {f.topic: f.worker_id for f in reg.events.feeds()} == {
                "w0": "w0",
                "x": "a",
                "y": "x",
            }

    run(body)


def test_admin_add_with_kv_events_connect_checks_the_publisher() -> None:
    """Connect mode over the admin API: a publisher is one worker's; no socket, no connect."""

    async def body() -> None:
        from prefixrouter.harness.ports import free_port

        taken = f"tcp://127.0.0.1:{free_port()}"
        connect = [{"kv_events_connect": taken}]
        async with gateway_env(n=1, worker_options=connect) as env:
            events = env.state.events
            assert events is not None and events.endpoint is None  # connects, binds nothing
            url = str(env.servers[0].make_url(""))

            async def add(**worker: str) -> Any:
                # A path of its own: one engine's URL under two ids is refused (409, url).
                body = {"url": f"{url}/{worker['id']}", **worker}
                return await env.admin("POST", "/admin/workers", json=body)

            for spelling in (taken, taken.replace("127.0.0.1", "localhost")):  # one socket
                r = await add(id="a", kv_events_connect=spelling)
                assert r.status == 409, await r.text()
                err = _error(await r.json())
                assert err["param"] == "kv_events_connect" and "'w0'" in err["message"]
            other = f"tcp://127.0.0.1:{free_port()}"
            r = await add(id="b", kv_events_connect=other)
            assert r.status == 201
            assert {f.worker_id: f.publisher for f in events.feeds()} == {"w0": taken, "b": other}
            r = await env.admin("DELETE", "/admin/workers/b?timeout=0")
            assert r.status == 200
            assert [f.worker_id for f in events.feeds()] == ["w0"]
        async with gateway_env(n=1) as env:
            assert env.state.events is None
            r = await env.admin(
                "POST",
                "/admin/workers",
                json={
                    "url": str(env.servers[0].make_url("c")),  # not w0's URL: that is a 409
                    "id": "c",
                    "kv_events_connect": taken,
                },
            )
            assert r.status == 400
            err = _error(await r.json())
            assert err["param"] == "kv_events_connect" and "without KV events" in err["message"]
            assert set(env.state.registry.workers) == {"w0"}

    run(body)


def test_tenant_isolation_and_cache_salt() -> None:
    async def body() -> None:
        overrides = {
            "tenants": {"acme": {"share_cache": False}, "globex": {"share_cache": False}},
            "api_keys": {"k-acme": "acme", "k-globex": "globex", "k-a": "a", "k-b": "b"},
        }
        async with gateway_env(overrides=overrides) as env:
            acme = {"Authorization": "Bearer k-acme"}
            r = await env.chat(LONG, headers=acme)
            r = await env.chat(LONG, headers=acme)
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            r = await env.chat(LONG, headers={"Authorization": "Bearer k-globex"})
            data = await r.json()
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            logs = await env.decisions()
            assert logs[1]["tenant"] == "acme" and logs[1]["decision"]["tier"] == "exact"
            assert logs[2]["tenant"] == "globex" and logs[2]["predicted_cached_tokens"] == 0
            salts = {req.get("cache_salt") for e in env.engines for req in e.requests}
            assert len(salts) == 2 and None not in salts
            # sharing tenants share the warm route and send no salt
            r1 = await env.chat(LONG + "shared", headers={"Authorization": "Bearer k-a"})
            r2 = await env.chat(LONG + "shared", headers={"Authorization": "Bearer k-b"})
            assert r1.headers["X-Prefixrouter-Worker"] == r2.headers["X-Prefixrouter-Worker"]
            assert (await env.decisions(1))[0]["decision"]["tier"] == "exact"

    run(body)


def test_metrics_poll_feeds_views_and_prometheus_names() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            view = env.state.registry.workers[WorkerId("w0")].view
            assert view.kv_capacity_blocks == 4096 and view.block_size == 16
            for i in range(3):
                await (await env.chat(LONG + str(i), stream=True)).read()
            r = await env.client.get("/metrics")
            text = await r.text()
            for name in (
                "prefixrouter_input_tokens_total",
                "prefixrouter_ttft_seconds_bucket",
                "prefixrouter_queue_wait_seconds_bucket",
                "prefixrouter_kv_evictions_total",
                "prefixrouter_evicted_prefix_age_seconds_bucket",
                "prefixrouter_warm_abandoned_total",
                "prefixrouter_prefill_tokens_saved_total",
                "prefixrouter_cache_prediction_error_tokens_bucket",
                "prefixrouter_requests_total",
            ):
                assert name in text, name
            assert 'prefixrouter_ttft_seconds_count{hit="warm",prefix_class="system"} 2.0' in text
            assert 'prefixrouter_ttft_seconds_count{hit="cold",prefix_class="system"} 1.0' in text
            assert 'kind="cached",model="tiny",pool="default",prefix_class="system"' in text
            # Three requests one after another: one kept-alive connection, idle now.
            assert 'prefixrouter_upstream_connections_opened_total{worker="w0"} 1.0' in text
            assert 'prefixrouter_upstream_connections{state="idle",worker="w0"} 1.0' in text
            assert 'prefixrouter_upstream_connections{state="busy",worker="w0"} 0.0' in text
            r = await env.admin("GET", "/admin/process")
            stats = await r.json()
            assert stats["requests"] == 3 and stats["cpu_user_s"] > 0

    run(body)


def test_decision_log_file(tmp_path: Any) -> None:
    path = tmp_path / "d.jsonl"

    async def body() -> None:
        async with gateway_env(n=1, overrides={"decision_log": {"path": str(path)}}) as env:
            for i in range(3):
                assert (await env.chat(f"q{i}")).status == 200

    run(body)
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert len(rows) == 3 and all(r["status"] == 200 for r in rows)


def test_token_mode_routes_on_the_engines_block_size() -> None:
    async def body() -> None:
        overrides = {"routing": {"mode": "token"}}
        async with gateway_env(n=2, overrides=overrides) as env:
            assert env.state.dispatch.block_size == 16  # from vllm:cache_config_info
            workers = set()
            for i in range(3):
                r = await env.chat(LONG + f" q{i}")
                assert r.status == 200
                workers.add(r.headers["X-Prefixrouter-Worker"])
            assert len(workers) == 1
            logs = await env.decisions()
            assert logs[-1]["predicted_cached_tokens"] > 0 and logs[-1]["actual_cached_tokens"] > 0

    run(body)


def test_health_backoff_grows_and_is_bounded() -> None:
    async def body() -> None:
        overrides = {
            "health": {"backoff_initial_s": 0.5, "backoff_factor": 2.0, "backoff_max_s": 3}
        }
        async with gateway_env(n=1, overrides=overrides) as env:
            reg = env.state.registry
            assert [reg._backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
            w = reg.workers[WorkerId("w0")]
            env.engines[0].healthy = False
            assert not await reg.check(w)
            assert not w.healthy and w.failures == 1 and w.backoff_s == 0.5
            assert not await reg.check(w)
            assert w.backoff_s == 1.0 and "503" in (w.last_error or "")
            env.engines[0].healthy = True
            assert await reg.check(w)
            assert w.healthy and w.failures == 0 and w.backoff_s == 0.5

    run(body)


def test_lint_observe_mode_counts_findings_and_forwards_the_body_unchanged() -> None:
    async def body() -> None:
        async with gateway_env(n=1, overrides={"metrics": {"lint_observe": True}}) as env:
            system = "Generated at 2026-11-29T15:04:05Z. " + LONG
            r = await env.chat("What is the cap?", system=system)
            assert r.status == 200
            await r.read()
            text = await (await env.client.get("/metrics")).text()
            assert 'prefixrouter_lint_findings_total{kind="timestamp"' in text
            received = env.engines[0].requests[-1]
            assert received["messages"][0]["content"] == system  # observed, never changed

        async with gateway_env(n=1) as env:  # off by default
            await (await env.chat("Q?", system="Generated at 2026-11-29T15:04:05Z. " + LONG)).read()
            text = await (await env.client.get("/metrics")).text()
            assert "prefixrouter_lint_findings_total{" not in text

    run(body)


def test_a_client_that_leaves_after_the_usage_chunk_still_leaves_its_feedback() -> None:
    async def body() -> None:
        engines = [FakeEngine(chunk_delay_s=0.2)]
        async with gateway_env(engines=engines) as env:
            r = await env.chat(
                LONG, stream=True, max_tokens=2, stream_options={"include_usage": True}
            )
            seen = b""
            while b'"usage"' not in seen:
                seen += await r.content.readany()
            r.close()  # gone before [DONE], as some clients do once they have the usage
            logs = await env.decisions(1)
            assert logs[0]["status"] == 499
            assert logs[0]["actual_cached_tokens"] is not None  # fed back all the same

    run(body)


def test_a_rejected_request_leaves_no_phantom_prefix_in_the_index() -> None:
    """Issue 12, item 6: a 400 (prompt past the context length) is taken back.

    The index mirrors 40 blocks of 256 characters; the document takes 10. Each
    rejected prompt (about 23 blocks) would leave its blocks behind for the
    speculative TTL: its retry would be predicted warm, and a second one would
    evict the document, which the engine still holds.
    """

    async def body() -> None:
        engines = [FakeEngine(max_prompt_tokens=1000, num_gpu_blocks=160)]
        async with gateway_env(engines=engines) as env:
            dispatch = env.state.dispatch
            w0 = WorkerId("w0")
            for _ in range(100):  # the metrics poll mirrors the engine's KV size
                if dispatch.index_capacity(w0) == 40:
                    break
                await asyncio.sleep(0.05)
            assert dispatch.index_capacity(w0) == 40
            for _ in range(2):
                r = await env.chat("What does it say?", system=LONG)
                assert r.status == 200
            too_long = ["Lorem ipsum dolor sit amet. " * 210, "Sed ut perspiciatis. " * 280]
            for text in (too_long[0], too_long[0], too_long[1]):
                r = await env.chat(text, system="")
                assert r.status == 400 and "context length" in _error(await r.json())["message"]
            r = await env.chat("And the second part?", system=LONG)
            assert r.status == 200
            logs = await env.decisions()
            doc, rejected = [logs[1], logs[-1]], logs[2:5]
            assert [d["status"] for d in rejected] == [400, 400, 400]
            assert rejected[1]["predicted_cached_tokens"] == 0  # the identical retry: cold
            for d in doc:  # the document stays predicted warm, as the engine holds it
                assert d["predicted_cached_tokens"] > 0 and d["actual_cached_tokens"] > 0
            assert len(dispatch.router.index) == dispatch.index_blocks(w0) <= 11  # the document

    run(body)


def test_attempts_without_prefill_take_their_routing_back() -> None:
    """A refusal retried elsewhere, then a stream whose client left before the first byte."""

    async def body() -> None:
        engines = [FakeEngine(status=503), FakeEngine(delay_s=5.0)]
        overrides = {"policy": {"name": "round_robin"}}
        async with gateway_env(engines=engines, overrides=overrides) as env:
            payload = {
                "model": "tiny",
                "messages": [{"role": "user", "content": LONG}],
                "stream": True,
            }
            with contextlib.suppress(TimeoutError):
                await env.client.post(
                    "/v1/chat/completions", json=payload, timeout=aiohttp.ClientTimeout(total=0.5)
                )
            for _ in range(200):
                if engines[1].cancelled and env.state.dispatch.load(WorkerId("w1")).in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            (log,) = await env.decisions()
            assert log["status"] == 499 and log["retried_from"] == ["w0"]
            assert len(engines[0].requests) == 1 and engines[1].cancelled == 1
            index = env.state.dispatch.router.index
            assert index.blocks_of(WorkerId("w0")) == 0  # refused: nothing cached there
            assert index.blocks_of(WorkerId("w1")) == 0  # aborted before its first byte
            assert len(index) == 0 and index.speculative_entries == 0

    run(body)


def test_admin_add_with_a_bad_url_is_400_naming_url() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            for url in (
                "http://",
                "https:///",
                "http://host:notaport",
                "http://127.0.0.1:99999",
                "http://[::1",
                "http:// spaces here",
            ):
                r = await env.admin("POST", "/admin/workers", json={"url": url, "id": "t1"})
                assert r.status == 400, url
                err = _error(await r.json())
                assert err["param"] == "url" and err["message"].startswith("url: "), url
            r = await env.admin(
                "POST", "/admin/workers", json={"url": "http://a:1", "api_key": "abc\r\nX: 1"}
            )
            assert r.status == 400 and _error(await r.json())["param"] == "api_key"
            # One engine under a second id: 409 naming both ids.
            url = str(env.servers[0].make_url("")).rstrip("/") + "/v1"
            r = await env.admin("POST", "/admin/workers", json={"url": url, "id": "again"})
            assert r.status == 409
            err = _error(await r.json())
            assert err["param"] == "url" and "'w0'" in err["message"]
            assert "'again'" in err["message"]
            assert set(env.state.registry.workers) == {"w0"}

    run(body)


def test_admin_add_with_a_body_that_is_not_its_content_encoding_is_400() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            headers = {**ADMIN_HEADERS, "Content-Encoding": "gzip"}
            r = await env.client.post(
                "/admin/workers", data=b'{"url": "http://a:1"}', headers=headers
            )
            assert r.status == 400 and _error(await r.json())["code"] == "invalid_body"

    run(body)


def test_a_clients_sane_request_id_is_kept_in_the_answer_and_the_logs(tmp_path: Path) -> None:
    access = tmp_path / "access.jsonl"
    overrides = {"access_log": {"path": str(access), "flush_interval_s": 0.05}}

    async def body() -> None:
        async with gateway_env(n=2, overrides=overrides) as env:
            mine = {"X-Request-Id": "my-id-123"}
            # The same id twice at once: the router still routes each under its own.
            first, second = await asyncio.gather(
                env.chat(LONG, headers=mine), env.chat(LONG + "?", headers=mine)
            )
            assert first.status == second.status == 200
            assert first.headers["X-Request-Id"] == second.headers["X-Request-Id"] == "my-id-123"
            records = [d for d in await env.decisions() if d.get("client_request_id")]
            assert [d["client_request_id"] for d in records] == ["my-id-123"] * 2
            assert len({d["request_id"] for d in records}) == 2
            assert all(d["request_id"].startswith("pr-") for d in records)
            for bad in ("has space", "x" * 129, "tab\tin", "ünï"):
                r = await env.chat(LONG, headers={"X-Request-Id": bad})
                assert r.status == 200 and r.headers["X-Request-Id"].startswith("pr-"), bad
            r = await env.client.get("/health", headers={"X-Request-Id": "probe-1"})
            assert r.headers["X-Request-Id"] == "probe-1"
            r = await env.chat(LONG, model="nope", headers={"X-Request-Id": "bad-model-1"})
            assert r.status == 404 and r.headers["X-Request-Id"] == "bad-model-1"
            for _ in range(100):
                lines = access.read_bytes().splitlines() if access.exists() else []
                if len(lines) >= 8:
                    break
                await asyncio.sleep(0.05)
        ids = [orjson.loads(x)["request_id"] for x in access.read_bytes().splitlines()]
        assert ids.count("my-id-123") == 2 and "probe-1" in ids and "bad-model-1" in ids

    run(body)
