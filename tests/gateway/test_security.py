"""Issue 12, items 1, 2 and 5: the admin API, who a request's tenant is, dedicated workers.

In-process tests (fake vLLM engines, one event loop) pin each rule; the last
test runs the same attacks against real ``prefixrouter serve`` and
``prefixrouter engine`` processes on loopback.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp.test_utils import TestServer

from prefixrouter.core.types import WorkerId
from prefixrouter.errors import ConfigError
from prefixrouter.gateway.cli import ADMIN_KEY_ENV, build_config
from prefixrouter.gateway.config import config_from_dict, load_config
from prefixrouter.harness.processes import Fleet, Server
from tests.admin_client import ADMIN_HEADERS, ADMIN_KEY
from tests.gateway.fakes import FakeEngine, make_app
from tests.gateway.helpers import Env, gateway_env, run

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~2,700 chars
ALICE = {"Authorization": "Bearer k-alice"}
TENANTS: dict[str, Any] = {
    "api_keys": {"k-alice": "alice", "k-bob": "bob"},
    "tenants": {"alice": {"share_cache": False}},
}


def _error(data: Any) -> dict[str, Any]:
    assert set(data) == {"error"}
    err = data["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    return dict(err)


def _cached(data: Any) -> int:
    return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])


# -- 1. the admin API -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tenancy",
    [{}, {"require_api_key": True, "api_keys": {"k-alice": "alice"}}],
    ids=["defaults", "require_api_key"],
)
def test_without_an_admin_key_the_admin_api_is_off(tenancy: dict[str, Any]) -> None:
    async def body() -> None:
        extra = TestServer(make_app(FakeEngine()))
        await extra.start_server()
        overrides = {"server": {"admin_api_key": None}, **tenancy}
        try:
            async with gateway_env(n=2, overrides=overrides) as env:
                c = env.client
                calls = [
                    ("POST", "/admin/workers", {"url": str(extra.make_url("")), "id": "evil"}),
                    ("DELETE", "/admin/workers/w0", None),
                    ("GET", "/admin/workers", None),
                    ("GET", "/admin/decisions", None),
                    ("GET", "/admin/process", None),
                ]
                for auth in (None, "Bearer k-alice", f"Bearer {ADMIN_KEY}"):
                    headers = {"Authorization": auth} if auth else None
                    for method, path, json in calls:
                        r = await c.request(method, path, json=json, headers=headers)
                        assert r.status == 403, (method, path, auth)
                        err = _error(await r.json())
                        assert err["type"] == "permission_error"
                        assert err["code"] == "admin_api_disabled"
                        assert "server.admin_api_key" in err["message"]
                assert sorted(env.state.registry.workers) == ["w0", "w1"]
                assert not extra_requests(env)
                # Health checks, scrapers and model listings carry no key.
                for path in ("/health", "/metrics", "/v1/models"):
                    assert (await c.get(path)).status == 200, path
        finally:
            await extra.close()

    def extra_requests(env: Env) -> bool:
        return any(w.id == "evil" for w in env.state.registry.workers.values())

    run(body)


def test_the_admin_key_is_required_bearer_in_any_case() -> None:
    async def body() -> None:
        overrides = {"api_keys": {"k-alice": "alice"}, "require_api_key": True}
        async with gateway_env(n=1, overrides=overrides) as env:
            c = env.client
            refused = [
                None,
                "Bearer k-alice",  # a tenant's key is not the admin key
                f"Bearer {ADMIN_KEY}x",
                f"Bearer {ADMIN_KEY[:-1]}",
                f"Basic {ADMIN_KEY}",
                ADMIN_KEY,
            ]
            for auth in refused:
                headers = {"Authorization": auth} if auth else None
                r = await c.delete("/admin/workers/w0", headers=headers)
                assert r.status == 401, auth
                assert _error(await r.json())["type"] == "authentication_error"
                assert r.headers["WWW-Authenticate"] == "Bearer"
            assert list(env.state.registry.workers) == ["w0"]
            for scheme in ("Bearer", "bearer", "BEARER"):
                r = await c.get(
                    "/admin/workers", headers={"Authorization": f"{scheme} {ADMIN_KEY}"}
                )
                assert r.status == 200, scheme
            r = await env.admin("DELETE", "/admin/workers/w0")
            assert r.status == 200 and not env.state.registry.workers

    run(body)


def test_serve_takes_the_admin_key_from_the_option_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server: {admin_api_key: from-file}\n")
    args = (None, 8080, "127.0.0.1", None, "prefix_aware")
    assert build_config(path, *args).server.admin_api_key == "from-file"
    assert build_config(path, *args, "from-option").server.admin_api_key == "from-option"
    assert build_config(None, *args).server.admin_api_key is None
    with pytest.raises(ConfigError, match=r"server\.admin_api_key: must not be empty"):
        config_from_dict({"server": {"admin_api_key": " "}})


# -- 2. the tenant comes from the key --------------------------------------------------------


def test_the_removed_tenant_header_setting_is_an_error_that_names_its_successor(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("api_keys: {k: acme}\ntenant_header: true\n")
    with pytest.raises(
        ConfigError, match=r"old\.yaml:2: tenant_header: removed.*trust_tenant_header"
    ):
        load_config(path)
    path.write_text("tenant_header: false\n")  # what the new default means anyway
    cfg = load_config(path)
    assert cfg.trust_tenant_header is False
    assert config_from_dict({"trust_tenant_header": True}).trust_tenant_header


def test_a_header_cannot_claim_a_tenant_or_its_cache() -> None:
    async def body() -> None:
        async with gateway_env(n=2, overrides=TENANTS) as env:
            for _ in range(2):
                r = await env.chat(LONG, headers=ALICE)
                assert r.status == 200
            assert _cached(await r.json()) > 0
            alice_salts = {req["cache_salt"] for e in env.engines for req in e.requests}
            assert len(alice_salts) == 1
            # Issue 12: no key (or an unknown one) plus X-Tenant got alice's cache.
            r = await env.chat(LONG, headers={"X-Tenant": "alice"})
            assert r.status == 200 and _cached(await r.json()) == 0
            sent = [req for e in env.engines for req in e.requests][-1]
            assert sent.get("cache_salt") is None
            for key in ("k-nobody", "k-alice2"):
                r = await env.chat(
                    LONG, headers={"Authorization": f"Bearer {key}", "X-Tenant": "alice"}
                )
                assert r.status == 401
                assert _error(await r.json())["code"] == "invalid_api_key"
            logs = await env.decisions()
            assert [d["tenant"] for d in logs] == ["alice", "alice", ""]
            assert logs[2]["predicted_cached_tokens"] == 0
            assert "alice" not in logs[2]["namespace"]

    run(body)


def test_a_trusted_header_selects_only_tenants_without_keys_that_share() -> None:
    async def body() -> None:
        overrides = {**TENANTS, "trust_tenant_header": True}
        async with gateway_env(n=1, overrides=overrides) as env:
            for claimed in ("alice", "bob"):  # isolated and keyed / keyed
                r = await env.chat(LONG, headers={"X-Tenant": claimed})
                assert r.status == 403, claimed
                err = _error(await r.json())
                assert err["code"] == "tenant_header_refused" and err["param"] == "X-Tenant"
                assert f"'{claimed}'" in err["message"]
            r = await env.chat(LONG, headers={"X-Tenant": "carol"})
            assert r.status == 200
            r = await env.chat(LONG, headers={**ALICE, "X-Tenant": "carol"})  # the key wins
            assert r.status == 200
            assert [d["tenant"] for d in await env.decisions()] == ["carol", "alice"]

    run(body)


def test_the_clients_cache_salt_stays_out_of_the_decision_log(tmp_path: Path) -> None:
    secret = "client-private-salt-8e1f"

    async def body() -> None:
        log = tmp_path / "decisions.jsonl"
        overrides = {**TENANTS, "decision_log": {"path": str(log), "flush_interval_s": 0.05}}
        async with gateway_env(n=1, overrides=overrides) as env:
            for headers in (None, None, ALICE, ALICE):
                r = await env.chat(LONG, headers=headers, cache_salt=secret)
                assert r.status == 200
            logs = await env.decisions()
            # The salt still separates the cache, and the router still predicts within it.
            assert [d["actual_cached_tokens"] > 0 for d in logs] == [False, True, False, True]
            assert logs[1]["predicted_cached_tokens"] > 0
            assert logs[3]["predicted_cached_tokens"] > 0
            ring = orjson.dumps(logs)
            for _ in range(100):
                if log.exists() and len(log.read_bytes().splitlines()) == 4:
                    break
                await asyncio.sleep(0.05)
            text = log.read_bytes()
            assert len(text.splitlines()) == 4
            for blob in (ring, text):
                assert secret.encode() not in blob

    run(body)


# -- 5. workers reserved for tenants ---------------------------------------------------------


def test_a_dedicated_worker_serves_its_tenant_and_refusals_name_the_tenant() -> None:
    async def body() -> None:
        overrides = {**TENANTS, "api_keys": {**TENANTS["api_keys"], "k-carol": "carol"}}
        # The workers' tenants lists, as in examples/sglang.yaml.
        options = [{"tenants": ["alice"]}, {"tenants": ["bob"]}]
        async with gateway_env(n=2, overrides=overrides, worker_options=options) as env:
            reg = env.state.registry
            for i in range(5):  # alice isolates her cache, bob shares his
                for who, worker in (("alice", "w0"), ("bob", "w1")):
                    r = await env.chat(LONG + str(i), headers={"Authorization": f"Bearer k-{who}"})
                    assert r.status == 200, (who, await r.text())
                    assert r.headers["X-Prefixrouter-Worker"] == worker
            # No worker admits carol, nor anonymous requests: 403, naming the tenant.
            for headers, who in (
                ({"Authorization": "Bearer k-carol"}, "tenant 'carol'"),
                (None, "without a tenant"),
            ):
                r = await env.chat(LONG, headers=headers)
                assert r.status == 403
                err = _error(await r.json())
                assert err["code"] == "tenant_not_served" and err["type"] == "permission_error"
                assert who in err["message"] and "w0: tenant, w1: tenant" in err["message"]
                assert "healthy" not in err["message"]
            # alice's own worker down: 503 (it may come back), still about the tenant.
            env.engines[0].healthy = False  # its health checks fail from now on
            reg.mark_failed(reg.workers[WorkerId("w0")], "test")
            r = await env.chat(LONG, headers=ALICE)
            assert r.status == 503 and "Retry-After" in r.headers
            msg = _error(await r.json())["message"]
            assert "tenant 'alice'" in msg and "w0: health, w1: tenant" in msg

    run(body)


def test_with_expose_workers_off_clients_learn_no_worker_name_or_state() -> None:
    """No X-Prefixrouter-Worker, no worker ids in refusals; the decision log keeps them."""

    async def body() -> None:
        overrides = {**TENANTS, "server": {"expose_workers": False}}
        options = [{"tenants": ["alice"]}, {"tenants": ["alice"]}]
        async with gateway_env(n=2, overrides=overrides, worker_options=options) as env:
            r = await env.chat(LONG, headers=ALICE)
            assert r.status == 200 and "X-Prefixrouter-Worker" not in r.headers
            rid = r.headers["X-Request-Id"]
            (record,) = [d for d in await env.decisions() if d["request_id"] == rid]
            assert record["selected_worker"] in ("w0", "w1")
            r = await env.chat(LONG, headers={"Authorization": "Bearer k-bob"})  # not served
            msg = _error(await r.json())["message"]
            assert r.status == 403 and "2 by tenant" in msg
            reg = env.state.registry
            for i, w in enumerate(("w0", "w1")):
                env.engines[i].healthy = False
                reg.mark_failed(reg.workers[WorkerId(w)], "test")
            r = await env.chat(LONG, headers=ALICE)
            msg = _error(await r.json())["message"]
            assert r.status == 503 and "2 by health" in msg
            for text in (msg, str(dict(r.headers))):
                assert "w0" not in text and "w1" not in text and "127.0.0.1" not in text

    run(body)


def test_a_tenant_no_worker_of_its_model_admits_gets_403_not_a_retry_forever() -> None:
    async def body() -> None:
        # w0 serves alice's model to alice only; w1 serves another model.
        options = [{"tenants": ["alice"], "models": ["tiny"]}, {"models": ["other"]}]
        async with gateway_env(n=2, overrides=TENANTS, worker_options=options) as env:
            r = await env.chat(LONG, headers={"Authorization": "Bearer k-bob"})
            assert r.status == 403 and "Retry-After" not in r.headers
            err = _error(await r.json())
            assert err["code"] == "tenant_not_served" and "tenant 'bob'" in err["message"]

    run(body)


def test_headers_that_are_not_utf8_get_clear_errors() -> None:
    async def body() -> None:
        overrides = {"trust_tenant_header": True}
        async with gateway_env(n=1, overrides=overrides) as env:
            port = env.client.server.port
            for request in (
                # A bearer key that is not UTF-8, on the admin API: 401, not a 500.
                b"GET /admin/workers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n",
                # An X-Tenant that is not UTF-8: 400 (it would reach the decision log).
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Tenant: \xff\xfe\r\n"
                b"Content-Type: application/json\r\nContent-Length: 2\r\n",
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                body = b"{}" if request.startswith(b"POST") else b""
                writer.write(request + b"Connection: close\r\n\r\n" + body)
                await writer.drain()
                answer = await reader.read()
                writer.close()
                status = int(answer.split(b" ", 2)[1])
                assert status in (400, 401), answer
                data = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
                _error(data)

    run(body)


# -- end to end: real processes --------------------------------------------------------------


def _start_engines(fleet: Fleet, n: int) -> list[Server]:
    return [
        fleet.start(
            f"engine{i}",
            "prefixrouter.simulated_engine",
            [
                "--profile",
                "tiny-cpu",
                "--time-scale",
                "4",
                "--model",
                "tiny",
                "--kv-blocks",
                "2048",
            ],
        )
        for i in range(n)
    ]


@pytest.mark.timeout(120)
def test_real_processes_admin_off_no_tenant_claims_dedicated_workers(tmp_path: Path) -> None:
    with Fleet() as fleet:
        engines = _start_engines(fleet, 2)
        asyncio.run(fleet.wait_healthy(engines))
        config = {
            "workers": [
                {"url": engines[0].url, "id": "e0", "tenants": ["alice"]},
                {"url": engines[1].url, "id": "e1", "tenants": ["bob", ""]},
            ],
            **TENANTS,
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gw = fleet.start("gateway", "prefixrouter.gateway", ["--config", str(path)])
        # The same configuration, with the admin key from the environment.
        keyed = fleet.start(
            "gateway+key",
            "prefixrouter.gateway",
            ["--config", str(path)],
            env={ADMIN_KEY_ENV: ADMIN_KEY},
        )
        asyncio.run(fleet.wait_healthy([gw, keyed]))

        async def body() -> None:
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 2,
            }
            async with aiohttp.ClientSession() as s:

                async def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
                    async with s.post(
                        url + "/v1/chat/completions", json=chat, headers=headers
                    ) as r:
                        return r.status, (await r.json()) | {
                            "worker": r.headers.get("X-Prefixrouter-Worker")
                        }

                # 1: anonymous admin calls change nothing.
                async with s.post(
                    gw.url + "/admin/workers", json={"url": engines[1].url, "id": "x"}
                ) as r:
                    assert r.status == 403 and "server.admin_api_key" in (await r.text())
                async with s.delete(gw.url + "/admin/workers/e0") as r:
                    assert r.status == 403
                async with s.get(keyed.url + "/admin/workers") as r:
                    assert r.status == 401
                async with s.get(keyed.url + "/admin/workers", headers=ADMIN_HEADERS) as r:
                    assert r.status == 200
                    assert [w["id"] for w in (await r.json())["workers"]] == ["e0", "e1"]
                # 5 + 2: alice's key reaches her dedicated worker and her cache.
                results = [await post(gw.url, ALICE) for _ in range(2)]
                assert [(st, d["worker"]) for st, d in results] == [(200, "e0"), (200, "e0")]
                assert _cached(results[1][1]) > 0
                # A header claiming alice: anonymous, so never her worker or cache.
                st, data = await post(gw.url, {"X-Tenant": "alice"})
                assert st == 200 and data["worker"] == "e1" and _cached(data) == 0
                st, data = await post(
                    gw.url, {"Authorization": "Bearer guess", "X-Tenant": "alice"}
                )
                assert st == 401

        asyncio.run(asyncio.wait_for(body(), 60))
        assert os.environ.get(ADMIN_KEY_ENV) is None  # the key went to the child only


def test_an_unknown_key_is_refused_before_the_body_is_read() -> None:
    async def body() -> None:
        async with gateway_env(n=1, overrides=TENANTS) as env:
            reader, writer = await asyncio.open_connection("127.0.0.1", env.client.server.port)
            # Headers announce a body that never comes: the 401 must not wait for it.
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.close()
            assert head.startswith(b"HTTP/1.1 401")

    run(body)
