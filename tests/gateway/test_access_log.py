"""The access log after live traffic: one line per request, errors and refusals included.

Real processes: two simulated engines behind ``python -m prefixrouter.gateway``
with an access log and two tenants (``beta`` limited to one request per 5 s).
Requests that succeed (plain and streamed), are refused by a tenant limit,
fail validation, carry a bad key, name an unknown model or path, and a
``/health`` probe each get exactly one line, found by the ``X-Request-Id`` the
client got, with the documented fields and the right values; no line holds
an API key. The per-tenant metrics count the same requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.gateway.access_log import FIELDS
from tests.gateway.live import LiveGateway, live_gateway
from tests.gateway.test_tenant_limits import by_label

KEYS = {"key-alpha-secret": "alpha", "key-beta-secret": "beta"}
ALPHA = {"Authorization": "Bearer key-alpha-secret"}
BETA = {"Authorization": "Bearer key-beta-secret"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    tmp = tmp_path_factory.mktemp("access-log")
    config = {
        "api_keys": KEYS,
        "tenants": {"beta": {"requests_per_s": 0.2, "burst": 1}, "alpha": {"priority": 3}},
        "access_log": {"path": str(tmp / "access.jsonl"), "flush_interval_s": 0.1},
    }
    with live_gateway(tmp, config) as gw:
        yield gw


def _chat(**kw: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is a prefix cache? " * 20}],
        "max_tokens": 4,
    }
    return {**body, **kw}


def _lines(path: Path, ids: set[str], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The log's lines, polled until every id in ``ids`` has one (bounded)."""
    end = time.monotonic() + timeout_s
    while True:
        lines = [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []
        if ids <= {x["request_id"] for x in lines} or time.monotonic() > end:
            return lines
        time.sleep(0.1)


def test_one_line_per_request_with_its_fields(gateway: LiveGateway) -> None:
    url = gateway.url
    sent: list[tuple[str, int, str]] = []  # (what, status, request id)

    async def traffic() -> str:
        async with aiohttp.ClientSession() as s:

            async def go(what: str, method: str, path: str, **kw: Any) -> None:
                async with s.request(method, url + path, **kw) as r:
                    await r.read()
                    sent.append((what, r.status, r.headers["X-Request-Id"]))

            await go("ok", "POST", "/v1/chat/completions", json=_chat(), headers=ALPHA)
            await go(
                "stream",
                "POST",
                "/v1/chat/completions",
                json=_chat(stream=True),
                headers={**ALPHA, "X-Priority": "-2"},
            )
            await go(
                "beta",
                "POST",
                "/v1/completions",
                json={"model": "tiny", "prompt": "hi"},
                headers=BETA,
            )
            await go("limited", "POST", "/v1/chat/completions", json=_chat(), headers=BETA)
            await go("bad_json", "POST", "/v1/chat/completions", data=b"{", headers=ALPHA)
            await go(
                "bad_key",
                "POST",
                "/v1/chat/completions",
                json=_chat(),
                headers={"Authorization": "Bearer nope"},
            )
            await go(
                "no_model", "POST", "/v1/chat/completions", json=_chat(model="big"), headers=ALPHA
            )
            await go("health", "GET", "/health")
            await go("no_path", "GET", "/nowhere")
            async with s.get(url + "/metrics") as r:
                return await r.text()

    metrics = asyncio.run(asyncio.wait_for(traffic(), 60))
    statuses = {what: status for what, status, _ in sent}
    assert statuses == {
        "ok": 200,
        "stream": 200,
        "beta": 200,
        "limited": 429,
        "bad_json": 400,
        "bad_key": 401,
        "no_model": 404,
        "health": 200,
        "no_path": 404,
    }
    ids = {rid for _, _, rid in sent}
    assert len(ids) == len(sent)
    path = Path(gateway.config["access_log"]["path"])
    lines = _lines(path, ids)
    seen = [x["request_id"] for x in lines]
    assert len(seen) == len(set(seen))  # never two lines for one request
    by_id = {x["request_id"]: x for x in lines}
    got = {what: by_id[rid] for what, _, rid in sent}
    for what, status, _ in sent:
        line = got[what]
        assert tuple(line) == FIELDS and line["status"] == status, (what, line)
        assert line["end_ts"] >= line["ts"] and line["latency_ms"] >= 0
    workers = {"e0", "e1"}

    ok, stream = got["ok"], got["stream"]
    assert ok["tenant"] == "alpha" and ok["priority"] == 3 and ok["worker"] in workers
    assert ok["tier"] and ok["prompt_tokens"] > 100 and ok["cached_tokens"] is not None
    assert ok["ttft_ms"] is None and ok["stream"] is False and ok["error"] is None
    assert stream["priority"] == -2 and stream["stream"] is True and stream["ttft_ms"] > 0
    assert stream["worker"] in workers and stream["path"] == "/v1/chat/completions"
    assert got["beta"]["tenant"] == "beta" and got["beta"]["path"] == "/v1/completions"

    limited = got["limited"]
    assert limited["tenant"] == "beta" and limited["error"] == "rate_limit_exceeded"
    assert limited["worker"] is None and limited["tier"] is None
    # The key names the tenant before the body is read, so a bad body still has one.
    assert got["bad_json"]["tenant"] == "alpha" and got["bad_json"]["error"] == "invalid_json"
    assert got["bad_key"]["tenant"] is None and got["bad_key"]["error"] == "invalid_api_key"
    assert got["no_model"]["tenant"] == "alpha" and got["no_model"]["error"] == "model_not_found"
    assert got["health"]["method"] == "GET" and got["health"]["tenant"] is None
    assert got["no_path"]["path"] == "/nowhere"

    text = path.read_text()
    assert all(key not in text and key not in metrics for key in KEYS)
    assert by_label(metrics, "prefixrouter_tenant_rejected_total", "tenant") == {"beta": 1.0}
    reqs = by_label(metrics, "prefixrouter_tenant_requests_total", "tenant")
    assert reqs["alpha"] == 4 and reqs["beta"] == 2  # 200, 200, 400, 404; 200, 429
