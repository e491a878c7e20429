"""Engine faults in front of the gateway: a frozen engine, and a restarted one.

Starts three simulated engines (``python -m prefixrouter.simulated_engine``, the
``prefixrouter engine`` command) and a gateway (``python -m
prefixrouter.gateway``) on loopback, all with their default timeouts and
health settings, and drives a steady stream of streaming chat requests
(new documents, 16 at a time) through the gateway while it:

1. **freezes** engine e0 with ``SIGSTOP`` for ``--freeze-s`` seconds, then
   ``SIGCONT``. Figures: the latency of the requests whose first attempt went
   to e0 after it froze (the decision log's ``retried_from`` names the
   abandoned worker), and what became of the streams that were running on e0
   when it froze (finished, or ended with an SSE error event), and the
   blocks the index holds for e0 before the freeze and at its end;
2. **restarts** engine e1: ``SIGKILL``, ``--down-s`` seconds down, then a new
   process on the same port. Figures: seconds from the new engine answering
   ``/health`` (probed here every 50 ms) until the gateway routes it a request.

Run it once per code version (the figures are wall-clock seconds on an idle
loopback, not CPU-bound, so shared load barely moves them)::

    PYTHONPATH=<checkout>/src python benchmarks/engine_faults.py [--json]

Every process is stopped by its PID at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prefixrouter.harness.health import http_status, wait_healthy
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Server, kill_process, stop_process
from prefixrouter.stats import percentile

PY = sys.executable
ADMIN = {"Authorization": "Bearer engine-faults-admin"}  # the decision log is admin-only


def start_engine(port: int, engine_id: str) -> subprocess.Popen[bytes]:
    cmd = [PY, "-m", "prefixrouter.simulated_engine", "--port", str(port), "--profile", "tiny-cpu",
           "--model", "tiny", "--engine-id", engine_id]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def healthy(url: str) -> bool:
    return http_status(url + "/health", 0.5) == 200


@dataclass
class Result:
    """One request as the client saw it."""

    start: float
    end: float
    request_id: str = ""
    worker: str = ""
    status: int = 0
    error_event: bool = False


@dataclass
class Load:
    """A steady stream of streaming requests, ``concurrency`` at a time."""

    gateway: str
    concurrency: int = 16
    max_tokens: int = 100
    results: list[Result] = field(default_factory=list)
    stop: bool = False
    n: int = 0

    async def one(self, s: aiohttp.ClientSession) -> None:
        self.n += 1
        doc = f"Document {self.n}: " + " ".join(f"item {self.n * 13 + i}" for i in range(150))
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": doc}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        res = Result(time.monotonic(), 0.0)
        try:
            async with s.post(
                self.gateway + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=60),
            ) as r:
                res.status = r.status
                res.request_id = r.headers.get("X-Request-Id", "")
                res.worker = r.headers.get("X-Prefixrouter-Worker", "")
                text = await r.text()
                res.error_event = '"error"' in text
        except (aiohttp.ClientError, TimeoutError):
            res.status, res.error_event = -1, True
        res.end = time.monotonic()
        self.results.append(res)

    async def run(self) -> None:
        async with aiohttp.ClientSession() as s:

            async def lane() -> None:
                while not self.stop:
                    await self.one(s)
                    await asyncio.sleep(0.05)

            await asyncio.gather(*(lane() for _ in range(self.concurrency)))


async def decisions(gateway: str) -> dict[str, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(gateway + "/admin/decisions?limit=100000", headers=ADMIN) as r,
    ):
        data = await r.json()
    return {d["request_id"]: d for d in data["decisions"]}


async def index_blocks(gateway: str, worker: str) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.get(gateway + "/admin/workers", headers=ADMIN) as r,
    ):
        data = await r.json()
    return int(next(w["index_blocks"] for w in data["workers"] if w["id"] == worker) or 0)


def first_worker(rec: dict[str, Any] | None, res: Result) -> str:
    if rec is None:
        return res.worker
    tried = rec.get("retried_from") or []
    return str(tried[0]) if tried else str(rec.get("selected_worker") or res.worker)


async def freeze(gateway: str, victim: subprocess.Popen[bytes], freeze_s: float) -> dict[str, Any]:
    load = Load(gateway)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(2.0)  # warm: every engine serving
    blocks_before = await index_blocks(gateway, "e0")
    t_stop = time.monotonic()
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(freeze_s - 0.5)
        blocks_frozen = await index_blocks(gateway, "e0")  # marked down by now
        await asyncio.sleep(0.5)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    t_cont = time.monotonic()
    await asyncio.sleep(1.0)
    load.stop = True
    await asyncio.wait_for(task, 70)
    recs = await decisions(gateway)
    routed, running = [], []
    for res in load.results:
        first = first_worker(recs.get(res.request_id), res)
        if first != "e0":
            continue
        if t_stop <= res.start < t_cont:
            routed.append(res)
        elif res.start < t_stop < res.end:
            running.append(res)
    lat = sorted(r.end - r.start for r in routed)
    return {
        "freeze_s": freeze_s,
        "index_blocks_before": blocks_before,
        "index_blocks_frozen": blocks_frozen,
        "requests": len(load.results),
        "routed_to_frozen": len(routed),
        "routed_latency_median_s": round(percentile(lat, 0.5), 2) if lat else None,
        "routed_latency_max_s": round(max(lat), 2) if lat else None,
        "routed_ok": sum(1 for r in routed if r.status == 200 and not r.error_event),
        "running_at_freeze": len(running),
        "running_ended_with_error_event": sum(1 for r in running if r.error_event),
        "running_latency_max_s": round(max(r.end - r.start for r in running), 2)
        if running
        else None,
        "running_held_past_freeze_start_max_s": round(max(r.end - t_stop for r in running), 2)
        if running
        else None,
    }


async def restart(
    gateway: str, procs: dict[str, subprocess.Popen[bytes]], url: str, port: int, down_s: float
) -> dict[str, Any]:
    load = Load(gateway)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(1.0)
    kill_process(procs["e1"])
    await asyncio.sleep(down_s)
    procs["e1"] = start_engine(port, "e1")
    end = time.monotonic() + 30
    while not healthy(url) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    t_ready = time.monotonic()
    first: float | None = None
    end = t_ready + 45
    while first is None and time.monotonic() < end:
        await asyncio.sleep(0.05)
        mine = [r.start for r in load.results if r.worker == "e1" and r.start >= t_ready]
        first = min(mine) if mine else None
    load.stop = True
    await asyncio.wait_for(task, 70)
    return {
        "down_s": down_s,
        "traffic_after_ready_s": round(first - t_ready, 2) if first is not None else None,
        "waited_up_to_s": 45,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="engine-faults-"))
    try:
        ports = [free_port() for _ in range(3)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for i, p in enumerate(ports):
            procs[f"e{i}"] = start_engine(p, f"e{i}")
        wait_healthy([Server(f"e{i}", p, procs[f"e{i}"]) for i, p in enumerate(ports)], 30.0)
        cfg = tmp / "gateway.yaml"
        workers = [{"url": u, "id": f"e{i}"} for i, u in enumerate(urls)]
        cfg.write_bytes(
            orjson.dumps(
                {
                    "workers": workers,
                    "server": {"admin_api_key": ADMIN["Authorization"].split()[1]},
                    "decision_log": {"ring_size": 100000},
                }
            )
        )
        gw = subprocess.Popen(
            [PY, "-m", "prefixrouter.gateway", "--config", str(cfg), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs["gateway"] = gw
        assert gw.stdout is not None
        line = gw.stdout.readline().decode()
        match = re.search(r"listening on (http://\S+)", line)
        if not match:
            raise RuntimeError(f"gateway did not start: {line!r}")
        gateway = match.group(1)
        frozen = await freeze(gateway, procs["e0"], args.freeze_s)
        await asyncio.sleep(3.0)  # let e0 come back into routing
        restarted = await restart(gateway, procs, urls[1], ports[1], args.down_s)
        return {"freeze": frozen, "restart": restarted}
    finally:
        for proc in procs.values():
            stop_process(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--freeze-s", type=float, default=10.0)
    ap.add_argument("--down-s", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(asyncio.wait_for(main_async(args), 240))
    if args.json:
        print(orjson.dumps(out).decode())
        return
    f, r = out["freeze"], out["restart"]
    print(f"SIGSTOP e0 for {f['freeze_s']:g} s ({f['requests']} requests in all):")
    print(
        f"  routed to e0 while frozen: {f['routed_to_frozen']} requests, "
        f"latency median {f['routed_latency_median_s']} s, max {f['routed_latency_max_s']} s, "
        f"{f['routed_ok']} answered in full"
    )
    print(
        f"  streams running on e0 when it froze: {f['running_at_freeze']}, "
        f"{f['running_ended_with_error_event']} ended with an SSE error event, "
        f"held up to {f['running_held_past_freeze_start_max_s']} s after the freeze"
    )
    print(
        f"  e0's index: {f['index_blocks_before']} blocks before the freeze, "
        f"{f['index_blocks_frozen']} at its end (marked down)"
    )
    print(f"SIGKILL e1, {r['down_s']:g} s down, restarted on its port:")
    print(f"  first request routed to it {r['traffic_after_ready_s']} s after it answered /health")


if __name__ == "__main__":
    main()
