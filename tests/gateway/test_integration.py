"""Integration: the gateway as a process in front of three engine-server processes.

Real HTTP on loopback: ``python -m prefixrouter.simulated_engine`` (a simulated
vLLM: real tokenizer, prefix cache, vLLM metrics and usage) three times, and
``python -m prefixrouter.gateway`` with a YAML config. Every process is started
on a free port and stopped by its PID at the end (the harness's
:func:`~prefixrouter.harness.processes.stop_process`); every wait is bounded.
Tests that change the fleet (drain, kill) run last.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Server, stop_process
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS

PY = sys.executable
DOC = " ".join(
    f"Section {i}: the committee reviewed item {i * 7} and approved it." for i in range(90)
)


@dataclass
class Cluster:
    gateway: str
    engines: list[str]
    procs: dict[str, subprocess.Popen[bytes]]
    log: Path


def wait_up(name: str, url: str, proc: subprocess.Popen[bytes]) -> None:
    """Until ``url``'s ``/health`` answers 200 (the harness's wait; fails if ``proc`` exits)."""
    wait_healthy([Server(name, int(url.rsplit(":", 1)[1]), proc)], timeout_s=30.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        engines = []
        for i in range(3):
            port = free_port()
            cmd = [PY, "-m", "prefixrouter.simulated_engine", "--port", str(port),
                   "--profile", "tiny-cpu", "--time-scale", "4", "--model", "tiny",
                   "--kv-blocks", "2048"]  # fmt: skip
            procs[f"e{i}"] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
            engines.append(f"http://127.0.0.1:{port}")
        for i, url in enumerate(engines):
            wait_up(f"e{i}", url, procs[f"e{i}"])
        log = tmp / "decisions.jsonl"
        cfg = tmp / "gateway.yaml"
        cfg.write_bytes(
            orjson.dumps(  # JSON is YAML
                {
                    "workers": [{"url": u, "id": f"e{i}"} for i, u in enumerate(engines)],
                    "server": {"max_body_bytes": 65536, **ADMIN_CONFIG},
                    "tenants": {"acme": {"share_cache": False}, "globex": {"share_cache": False}},
                    "api_keys": {"k-acme": "acme", "k-globex": "globex"},
                    "metrics_poll": {"interval_s": 0.5},
                    "health": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
                    "decision_log": {"path": str(log), "flush_interval_s": 0.1},
                }
            )
        )
        gw = subprocess.Popen(
            [PY, "-m", "prefixrouter.gateway", "--config", str(cfg), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        procs["gateway"] = gw
        assert gw.stdout is not None
        line = gw.stdout.readline().decode()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        gateway = match.group(1)
        wait_up("gateway", gateway, gw)
        yield Cluster(gateway, engines, procs, log)
    finally:
        for proc in procs.values():
            stop_process(proc)


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You answer questions about the minutes."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 4,
        **extra,
    }


async def _post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        return r.status, r.headers.copy(), await r.read()


def _run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


def _log_records(c: Cluster, ids: set[str]) -> dict[str, dict[str, Any]]:
    end = time.monotonic() + 5
    found: dict[str, dict[str, Any]] = {}
    while time.monotonic() < end:
        for line in c.log.read_bytes().splitlines() if c.log.exists() else []:
            rec = orjson.loads(line)
            if rec["request_id"] in ids:
                found[rec["request_id"]] = rec
        if len(found) == len(ids):
            break
        time.sleep(0.1)
    return found


def test_same_prefix_same_worker_and_cached_token_feedback(cluster: Cluster) -> None:
    async def body() -> None:
        async with aiohttp.ClientSession() as s:
            results = [
                await _post(s, cluster.gateway + "/v1/chat/completions", _chat(DOC + f" Q{i}?"))
                for i in range(4)
            ]
        assert all(st == 200 for st, _, _ in results)
        workers = {h["X-Prefixrouter-Worker"] for _, h, _ in results}
        assert len(workers) == 1
        cached = [
            orjson.loads(b)["usage"]["prompt_tokens_details"]["cached_tokens"]
            for _, _, b in results
        ]
        assert cached[0] == 0 and all(c > 500 for c in cached[1:])
        ids = {h["X-Request-Id"] for _, h, _ in results}
        records = _log_records(cluster, ids)
        assert len(records) == 4
        for (_, h, b), i in zip(results, range(4), strict=True):
            rec = records[h["X-Request-Id"]]
            usage = orjson.loads(b)["usage"]
            assert rec["actual_cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
            assert rec["prompt_tokens"] == usage["prompt_tokens"]
            if i:
                assert rec["decision"]["tier"] in ("exact", "partial")
                assert rec["predicted_cached_tokens"] > 0

    _run(body())


def test_spreading_under_load(cluster: Cluster) -> None:
    async def body() -> None:
        prefix = "Shared instructions for the load test. " * 40
        async with aiohttp.ClientSession() as s:
            reqs = [
                _post(
                    s,
                    cluster.gateway + "/v1/chat/completions",
                    _chat(prefix + f" item {i}", max_tokens=48, stream=True),
                )
                for i in range(24)
            ]
            results = await asyncio.gather(*reqs)
        assert all(st == 200 for st, _, _ in results)
        used = {h["X-Prefixrouter-Worker"] for _, h, _ in results}
        assert len(used) >= 2, used

    _run(body())


def _normalize(stream: bytes) -> bytes:
    stream = re.sub(rb'"id":"[^"]*"', b'"id":"X"', stream)
    return re.sub(rb'"created":\d+', b'"created":0', stream)


def test_streamed_content_is_byte_identical_to_a_direct_call(cluster: Cluster) -> None:
    async def body() -> None:
        req = _chat("Tell me about item 14.", max_tokens=12, stream=True)
        async with aiohttp.ClientSession() as s:
            _, _, direct = await _post(s, cluster.engines[0] + "/v1/chat/completions", req)
            st, h, via = await _post(s, cluster.gateway + "/v1/chat/completions", req)
        assert st == 200 and h["Content-Type"].startswith("text/event-stream")
        assert b'"usage"' not in via and via.count(b"data: ") == direct.count(b"data: ")
        assert _normalize(via) == _normalize(direct)

    _run(body())


def test_bad_input_over_http(cluster: Cluster) -> None:
    async def body() -> None:
        url = cluster.gateway + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            # (payload, status, error code, error param)
            cases: list[tuple[bytes | dict[str, Any], int, str | None, str | None]] = [
                (b"{oops", 400, "invalid_json", None),
                ({"model": 5, "messages": [{"role": "user", "content": "x"}]}, 400, None, "model"),
                (
                    {"model": "tiny", "messages": [{"role": 1}]},
                    400,
                    "invalid_field",
                    "messages[0].role",
                ),
                (_chat("x", model="nope"), 404, "model_not_found", "model"),
                (_chat("x" * 70_000), 413, "request_too_large", None),
                (
                    _chat("x", max_tokens=10**7),
                    400,
                    None,
                    None,
                ),  # the engine's own 400 passes through
            ]
            for payload, status, code, param in cases:
                st, _, raw = await _post(s, url, payload)
                err = orjson.loads(raw)["error"]
                assert st == status, (
                    payload if isinstance(payload, bytes) else payload.get("model"),
                    raw,
                )
                assert {"message", "type", "code"} <= set(err)
                if code is not None:
                    assert err["code"] == code
                if param is not None:
                    assert err["param"] == param and param in err["message"]

    _run(body())


def test_tenant_isolation(cluster: Cluster) -> None:
    async def body() -> None:
        url = cluster.gateway + "/v1/chat/completions"
        req = _chat(DOC + " Isolation question.")
        async with aiohttp.ClientSession() as s:
            a1 = await _post(s, url, req, {"Authorization": "Bearer k-acme"})
            a2 = await _post(s, url, req, {"Authorization": "Bearer k-acme"})
            g1 = await _post(s, url, req, {"Authorization": "Bearer k-globex"})
            g2 = await _post(s, url, req, {"Authorization": "Bearer k-globex"})
        cached = [
            orjson.loads(b)["usage"]["prompt_tokens_details"]["cached_tokens"]
            for _, _, b in (a1, a2, g1, g2)
        ]
        recs = _log_records(cluster, {r[1]["X-Request-Id"] for r in (a1, a2, g1, g2)})
        seen = [  # what each request met, should this ever fail again
            {k: recs[r[1]["X-Request-Id"]][k] for k in ("selected_worker", "tier", "retried_from")}
            for r in (a1, a2, g1, g2)
        ]
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] > 0, seen
        first_globex = recs[g1[1]["X-Request-Id"]]
        assert first_globex["predicted_cached_tokens"] == 0 and first_globex["tenant"] == "globex"
        assert first_globex["decision"]["tier"] not in ("exact", "partial")

    _run(body())


def test_drain_and_remove(cluster: Cluster) -> None:
    async def body() -> None:
        url = cluster.gateway + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            st, h, _ = await _post(s, url, _chat(DOC + " drain"))
            victim = h["X-Prefixrouter-Worker"]
            slow = asyncio.ensure_future(_post(s, url, _chat(DOC + " drain", max_tokens=200)))
            await asyncio.sleep(0.15)
            async with s.delete(
                f"{cluster.gateway}/admin/workers/{victim}?timeout=20", headers=ADMIN_HEADERS
            ) as r:
                result = await r.json()
            assert r.status == 200 and result["drained"] and result["in_flight_left"] == 0
            st, h, _ = await slow
            assert st == 200 and h["X-Prefixrouter-Worker"] == victim
            for _ in range(3):
                st, h, _ = await _post(s, url, _chat(DOC + " drain"))
                assert st == 200 and h["X-Prefixrouter-Worker"] != victim
            async with s.get(cluster.gateway + "/admin/workers", headers=ADMIN_HEADERS) as r:
                ids = [w["id"] for w in (await r.json())["workers"]]
            assert victim not in ids and len(ids) == 2
            url_of = cluster.engines[int(victim[1])]
            async with s.post(
                cluster.gateway + "/admin/workers",
                json={"url": url_of, "id": victim},
                headers=ADMIN_HEADERS,
            ) as r:
                assert r.status == 201

    _run(body())


def test_worker_killed_mid_run(cluster: Cluster) -> None:
    async def body() -> None:
        url = cluster.gateway + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            reqs = [
                asyncio.ensure_future(
                    _post(s, url, _chat(DOC + f" kill {i}", max_tokens=32, stream=i % 2 == 0))
                )
                for i in range(18)
            ]
            await asyncio.sleep(0.1)
            os.kill(cluster.procs["e2"].pid, signal.SIGKILL)
            results = await asyncio.gather(*reqs)
            # afterwards everything is served by the survivors
            after = [await _post(s, url, _chat(f"after {i}")) for i in range(4)]
        ok = 0
        for st, _, raw in results:
            if st == 200 and b'"error"' not in raw:
                ok += 1
            else:
                # a clear error, never a silent loss: a 5xx in OpenAI's shape, or a
                # stream cut after its first bytes that ends with an error event
                text = raw.decode()
                assert "error" in text and ("e2" in text or "upstream" in text), (st, text[-300:])
        assert ok >= 9
        assert all(st == 200 and h["X-Prefixrouter-Worker"] != "e2" for st, h, _ in after)
        ids = {h["X-Request-Id"] for _, h, _ in results if "X-Request-Id" in h}
        assert len(_log_records(cluster, ids)) == len(ids) == 18

    _run(body())
