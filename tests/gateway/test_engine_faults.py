"""Engine faults with real processes: a frozen engine (SIGSTOP) and a restarted one.

Two ``python -m prefixrouter.simulated_engine`` processes (the ``prefixrouter
engine`` command) and ``python -m prefixrouter.gateway`` with its default
timeouts and health settings, on loopback. Every process is stopped by its
PID at the end (the harness's :func:`~prefixrouter.harness.processes.stop_process`,
which wakes a frozen one first); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import stop_process
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS
from tests.gateway.test_integration import PY, wait_up

DOC = " ".join(f"Clause {i}: the parties agree to term {i * 11}." for i in range(80))


@dataclass
class Fleet:
    gateway: str
    urls: list[str]
    ports: list[int]
    procs: dict[str, subprocess.Popen[bytes]]


def _engine(port: int) -> subprocess.Popen[bytes]:
    cmd = [PY, "-m", "prefixrouter.simulated_engine", "--port", str(port), "--profile", "tiny-cpu",
           "--model", "tiny"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("faults")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        ports = [free_port() for _ in range(2)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for i, p in enumerate(ports):
            procs[f"e{i}"] = _engine(p)
        for i, u in enumerate(urls):
            wait_up(f"e{i}", u, procs[f"e{i}"])
        cfg = tmp / "gateway.yaml"
        workers = [{"url": u, "id": f"e{i}"} for i, u in enumerate(urls)]
        # Every timeout and health setting at its default.
        cfg.write_bytes(orjson.dumps({"workers": workers, "server": ADMIN_CONFIG}))
        gw = subprocess.Popen(
            [PY, "-m", "prefixrouter.gateway", "--config", str(cfg), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs["gateway"] = gw
        assert gw.stdout is not None
        match = re.search(r"listening on (http://\S+)", gw.stdout.readline().decode())
        assert match
        wait_up("gateway", match.group(1), gw)
        yield Fleet(match.group(1), urls, ports, procs)
    finally:
        for proc in procs.values():
            stop_process(proc)


def _chat(content: str, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": stream,
    }


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, str, str]:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        text = await r.text()
        return r.status, r.headers.get("X-Prefixrouter-Worker", ""), r.headers["X-Request-Id"], text


async def _workers(s: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with s.get(url + "/admin/workers", headers=ADMIN_HEADERS) as r:
        data = await r.json()
    return {w["id"]: w for w in data["workers"]}


async def _decision(s: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    for _ in range(50):
        async with s.get(url + "/admin/decisions?limit=1000", headers=ADMIN_HEADERS) as r:
            recs = [d for d in (await r.json())["decisions"] if d["request_id"] == rid]
        if recs:
            return dict(recs[0])
        await asyncio.sleep(0.1)
    raise AssertionError(f"no decision record for {rid}")


async def _until_worker(
    s: aiohttp.ClientSession, url: str, wid: str, key: str, value: Any, timeout_s: float
) -> None:
    end = time.monotonic() + timeout_s
    while (await _workers(s, url))[wid][key] != value:
        assert time.monotonic() < end, f"{wid}.{key} never became {value!r}"
        await asyncio.sleep(0.1)


def _run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 90)

    return asyncio.run(bounded())


def test_a_frozen_engine_is_retried_elsewhere_and_keeps_its_index(fleet: Fleet) -> None:
    async def body() -> None:
        gw = fleet.gateway
        async with aiohttp.ClientSession() as s:
            status, warm, _, _ = await _post(s, gw, _chat(DOC + " First?"))
            assert status == 200
            held = (await _workers(s, gw))[warm]["index_blocks"]
            assert held > 0
            proc = fleet.procs[warm]
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                # The warm prefix sends it to the frozen engine first.
                status, served, rid, text = await _post(s, gw, _chat(DOC + " Again?"))
                took = time.monotonic() - t0
                assert status == 200 and served != warm and '"error"' not in text
                # The 2 s first-byte floor (the prediction is milliseconds), far from the freeze.
                assert took < 8.0
                rec = await _decision(s, gw, rid)
                assert rec["retried_from"] == [warm]
                state = (await _workers(s, gw))[warm]
                assert state["suspect"] or not state["healthy"]
                # Its health check times out: down, its index kept (as speculative entries).
                await _until_worker(s, gw, warm, "healthy", False, 10)
                state = (await _workers(s, gw))[warm]
                assert state["index_blocks"] == held and state["last_error"]
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await _until_worker(s, gw, warm, "healthy", True, 10)
            state = (await _workers(s, gw))[warm]
            assert state["index_blocks"] == held and state["restarts"] == 0  # same process
            assert state["last_error"] is None  # the outage's error is not shown beside healthy

    _run(body())


def test_a_restarted_engine_gets_traffic_within_5_s_and_starts_cold(fleet: Fleet) -> None:
    async def body() -> None:
        gw = fleet.gateway
        async with aiohttp.ClientSession() as s:
            # A document that e1 holds.
            for i in range(10):
                status, served, _, _ = await _post(s, gw, _chat(f"{i} {DOC} Which one?"))
                if served == "e1":
                    break
            assert served == "e1"
            held = (await _workers(s, gw))["e1"]["index_blocks"]
            assert held > 0
            fleet.procs["e1"].kill()
            fleet.procs["e1"].wait(timeout=5)
            # Down for a while: the health backoff grows (to 8 s and more, before the fix).
            deadline = time.monotonic() + 8.0
            while time.monotonic() < deadline:
                status, served, _, _ = await _post(s, gw, _chat(f"down {time.monotonic()}"))
                assert status == 200 and served == "e0"
                await asyncio.sleep(0.3)
            state = (await _workers(s, gw))["e1"]
            assert not state["healthy"] and state["index_blocks"] == held  # kept while down
            fleet.procs["e1"] = _engine(fleet.ports[1])  # a new process on the same port
            wait_up("e1", fleet.urls[1], fleet.procs["e1"])
            ready = time.monotonic()
            got: float | None = None
            n = 0
            while got is None and time.monotonic() - ready < 10.0:
                # A few at a time: an idle cold engine takes its share of a burst.
                n += 1
                bodies = [_chat(f"new {n}.{k} {DOC[: 200 + k]}") for k in range(4)]
                out = await asyncio.gather(*(_post(s, gw, b) for b in bodies))
                if any(w == "e1" for _, w, _, _ in out):
                    got = time.monotonic() - ready
                await asyncio.sleep(0.1)
            assert got is not None and got < 5.0, got
            state = (await _workers(s, gw))["e1"]
            assert state["restarts"] == 1  # a new process_start_time_seconds: index cleared
            assert state["index_blocks"] < held

    _run(body())
