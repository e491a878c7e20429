"""The simulator's text mode decides as the live gateway does, on the same chat bodies.

One small scenario (three 8,000-token documents asked about in turn, and
unique 8,000-token prompts between them) becomes chat bodies
(:class:`prefixrouter.sim.text.TextRenderer`). The same bodies go

* to the live gateway (``python -m prefixrouter.gateway``, text mode, its
  default policy) in front of four ``prefixrouter.simulated_engine``
  processes on loopback, one request at a time: each is sent once the
  gateway has routed the one before (its ``/admin/workers`` in-flight count
  says so), and the worker it chose is the one whose count rose;
* to the simulator in text mode (:class:`~prefixrouter.sim.cluster.Simulation`).

What must match for a fair comparison, and how it is made to:

* **the request path and hashes**: the same bodies, the gateway's text-mode
  defaults in both (chunk size, 4.0 characters per token to start, the hashed
  prompt bound), the same namespace (model ``sim-model``, no tenant);
* **the fleet as the router sees it**: worker ids ``w00..w03``, block size 16,
  KV capacity and sequence slots configured on the gateway equal to the
  simulated profile's, and the same speed profile in the cost model (the
  gateway's default :class:`~prefixrouter.core.types.SpeedProfile`; the
  simulated profile is built on it);
* **load and feedback**: no request has its first token or completes while
  the decisions are made, in either driver, so both see the in-flight ledger
  of the admissions alone, with no TTFT calibration, no characters-per-token
  observation and no confirmation yet (the engine's token count of a new
  prefix, ``routing.token_count``, is off in both: live it comes back while
  the next request is sent, in the simulator a millisecond after these
  decisions). Live, the engines run 1,000 times
  slower than real time (an 8,000-token prefill takes minutes); in the
  simulator the requests arrive a microsecond apart, before the first engine
  step ends (checked). ``prefix_aware``'s prefill-in-progress rule reads
  the time since a worker's prefill started: milliseconds live,
  microseconds here, against predicted prefills of about 0.4 s, so it
  gives the same verdicts. Its ``first_prefill_rule`` is off in both
  (``earliest_prefill``): it orders holders that are all still on their
  first prefill by that time since each started, and the live requests go
  out over a second of wall time (one at a time, each after the gateway's
  admin view shows it routed) against the simulator's microseconds, so a
  holder that started first has run its whole predicted prefill live and
  almost none of it here. The KV room the engines report differs (a live
  engine's poll vs the model), but 20,000 blocks per worker leave it far from
  binding in both.

Every wait is bounded by a count of polls; nothing compares times.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from prefixrouter.core import PrefixClass, RequestId, WorkerId
from prefixrouter.core.policy import create_policy
from prefixrouter.core.types import SpeedProfile
from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Server, stop_process
from prefixrouter.sim.cluster import ClusterConfig, Simulation
from prefixrouter.sim.profiles import EngineProfile
from prefixrouter.sim.text import TextRenderer
from prefixrouter.sim.workload import SIM_NAMESPACE, SimRequest, Workload, random_tokens
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS

PY = sys.executable
WORKERS = 4
KV_BLOCKS = 20_000
BLOCK = 16
SLOTS = 256
# Which prompt each request carries: a document (0, 1, 2) or a unique prompt (-1).
PATTERN = [0, 1, 0, -1, -1, 0, 2, 1, -1, 0, 2, -1, 1, 0]
POLICY = "prefix_aware"  # the gateway's default policy
# Its defaults but the rule that reads wall time since a prefill started (docstring).
POLICY_PARAMS: dict[str, Any] = {"earliest_prefill": False}


def _workload() -> Workload:
    rng = np.random.default_rng(13)
    system = random_tokens(rng, 40)
    docs = [random_tokens(rng, 8_000) for _ in range(3)]
    reqs = []
    for i, d in enumerate(PATTERN):
        body = (docs[d], random_tokens(rng, 30)) if d >= 0 else (random_tokens(rng, 8_000),)
        reqs.append(
            SimRequest(
                RequestId(f"r{i:02d}"),
                i * 1e-6,  # all arrive before the first engine step ends
                SIM_NAMESPACE,
                (system, *body),
                64,
                PrefixClass.DOCUMENT if d >= 0 else PrefixClass.UNKNOWN,
                f"doc{d}",
                len(system),
            )
        )
    return Workload("parity", "gateway parity", reqs, default_workers=WORKERS, block_size=BLOCK)


PROFILE = EngineProfile(
    "parity",
    "the gateway's default speed profile",
    SpeedProfile(),
    kv_blocks=KV_BLOCKS,
    block_size=BLOCK,
    max_num_seqs=SLOTS,
)


def _simulated(wl: Workload) -> tuple[list[str], dict[str, int]]:
    sim = Simulation(
        wl,
        ClusterConfig(WORKERS, PROFILE, mode="text", decision_log=len(PATTERN), token_count=False),
        create_policy(POLICY, POLICY_PARAMS),
    )
    run = sim.run()
    last_arrival = wl.requests[-1].arrival
    # the simulator's state at every decision: nothing past its first token yet
    assert min(r.first_token for r in run.records) > last_arrival
    workers = [str(d["selected_worker"]) for d in run.decisions_logged]
    # index blocks per worker right after the last admission (the first
    # completion comes later and changes them): the admissions' entries only
    return workers, _index_after_admissions(wl)


def _index_after_admissions(wl: Workload) -> dict[str, int]:
    sim = Simulation(
        wl,
        ClusterConfig(WORKERS, PROFILE, mode="text", token_count=False),
        create_policy(POLICY, POLICY_PARAMS),
    )
    for req in wl.requests:  # the arrivals alone, as the loop would run them first
        sim._arrive(req, req.arrival)
    return {f"w{i:02d}": sim.dispatch.index_blocks(WorkerId(f"w{i:02d}")) for i in range(WORKERS)}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("parity")
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        servers = []
        for i in range(WORKERS):
            port = free_port()
            cmd = [PY, "-m", "prefixrouter.simulated_engine", "--port", str(port),
                   "--profile", "tiny-cpu", "--time-scale", "0.001", "--model", "sim-model",
                   "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK)]  # fmt: skip
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
            procs.append(proc)
            servers.append(Server(f"w{i:02d}", port, proc))
        wait_healthy(servers, timeout_s=30.0)
        cfg = tmp / "gateway.yaml"
        workers = [
            {"url": f"http://127.0.0.1:{s.port}", "id": s.name, "block_size": BLOCK,
             "kv_capacity_blocks": KV_BLOCKS, "max_slots": SLOTS}
            for s in servers
        ]  # fmt: skip
        cfg.write_bytes(
            orjson.dumps(
                {
                    "workers": workers,
                    "server": {**ADMIN_CONFIG},
                    "proxy": {"first_byte_timeout_floor_s": None, "stall_timeout_s": None},
                    "routing": {"token_count": False},  # no observation (module docstring)
                    "policy": {"name": POLICY, "params": POLICY_PARAMS},
                }
            )
        )
        gw = subprocess.Popen(
            [PY, "-m", "prefixrouter.gateway", "--config", str(cfg), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        procs.append(gw)
        assert gw.stdout is not None
        match = re.search(r"listening on (http://\S+)", gw.stdout.readline().decode())
        assert match
        url = match.group(1)
        wait_healthy([Server("gateway", int(url.rsplit(":", 1)[1]), gw)], timeout_s=30.0)
        yield url
    finally:
        for proc in procs:
            stop_process(proc)


async def _workers(s: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with s.get(f"{url}/admin/workers", headers=ADMIN_HEADERS) as r:
        assert r.status == 200
        return {w["id"]: w for w in (await r.json())["workers"]}


async def _until(s: aiohttp.ClientSession, url: str, ok: Any) -> dict[str, dict[str, Any]]:
    """Poll ``/admin/workers`` until ``ok(workers)`` (at most 600 polls)."""
    for _ in range(600):
        ws = await _workers(s, url)
        if ok(ws):
            return ws
        await asyncio.sleep(0.02)
    raise AssertionError(f"gateway state never reached: {ws}")


async def _live(url: str, bodies: list[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    chosen: list[str] = []
    async with aiohttp.ClientSession() as s:
        # every worker healthy and serving the model before the first request
        await _until(
            s, url, lambda ws: all(w["healthy"] and "sim-model" in w["models"] for w in ws.values())
        )
        before = {k: 0 for k in await _workers(s, url)}
        tasks = []
        for i, body in enumerate(bodies):
            tasks.append(
                asyncio.create_task(s.post(f"{url}/v1/chat/completions", data=orjson.dumps(body)))
            )
            ws = await _until(
                s, url, lambda ws, n=i + 1: sum(w["in_flight"] for w in ws.values()) == n
            )
            now = {k: w["in_flight"] for k, w in ws.items()}
            (rose,) = [k for k in now if now[k] == before[k] + 1]
            assert all(now[k] == before[k] for k in now if k != rose)  # nothing finished
            chosen.append(rose)
            before = now
        index = {k: w["index_blocks"] for k, w in (await _workers(s, url)).items()}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return chosen, index


def test_simulator_and_gateway_make_the_same_first_decisions(gateway: str) -> None:
    wl = _workload()
    renderer = TextRenderer(wl.requests)
    bodies = [renderer.chat_body(r) for r in wl.requests]
    sim_workers, sim_index = _simulated(wl)
    live_workers, live_index = asyncio.run(asyncio.wait_for(_live(gateway, bodies), 120))
    assert live_workers == sim_workers
    assert live_index == sim_index
    # the decisions are not trivial: documents follow their workers, load spreads.
    # (A document's second request may take an idle worker while its first
    # prefill has only just started: prefix_aware's prefill-in-progress rule.)
    for d in (0, 1, 2):
        seq = [w for w, p in zip(sim_workers, PATTERN, strict=True) if p == d]
        assert len(set(seq)) <= 2
        assert all(w in seq[:k] for k, w in enumerate(seq) if k >= 2)
    assert len(set(sim_workers)) == WORKERS


def test_parity_workload_is_deterministic(tmp_path: Path) -> None:
    a, b = _workload(), _workload()
    ra, rb = TextRenderer(a.requests), TextRenderer(b.requests)
    assert [ra.chat_body(r) for r in a.requests] == [rb.chat_body(r) for r in b.requests]
