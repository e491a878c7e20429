"""What each router adds over a direct call: latency, throughput and CPU per request.

Router-agnostic version of ``benchmarks/gateway_overhead.py`` (which measures our
gateway alone), for every router of the comparison:

* **engines**: one :mod:`prefixrouter.bench.instant` process listening on
  ``workers`` ports, answering every completion at once and every probe the
  peers make (vllm-router's cache-aware policy calls a render endpoint on every
  engine for every request: the instant engines answer those at once too);
* **requests**: 8 KB chat bodies, a shared 6 KB system prompt and a 2 KB user
  message, one of 64 variants, not streamed;
* **per router**: start it in front of the engines, then ``rounds`` interleaved
  pairs of open-loop phases at ``rate`` requests per second: direct to one
  engine, then through the router (latency from the scheduled send time, see
  :mod:`prefixrouter.bench.loadgen`); the added p50 and p99 are the differences
  of the latency percentiles over all rounds. The router's CPU time (its
  process and every descendant, utime + stime from ``/proc/PID/stat``) over the
  through-router phases divided by their requests is its CPU per request; the
  engines' CPU per request is measured the same way (the work a router pushes
  onto engines). Then a closed loop of ``connections`` back-to-back clients
  through the router for ``saturation_s``: completed requests per second.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prefixrouter.bench.loadgen import Latencies, build_requests, closed_loop, open_loop
from prefixrouter.bench.routers import RouterSpec, router_command, skip_reason
from prefixrouter.harness.health import wait_routable
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet

SYSTEM = ("You are the assistant of a law firm. Follow the style guide. " * 100)[:6144]
VARIANTS = 64
WARMUP = 50  # sequential requests before each open-loop phase (counted in CPU)


@dataclass(frozen=True, slots=True)
class OverheadConfig:
    """Knobs of the overhead comparison (module doc)."""

    workers: int = 4
    rate: float = 300.0
    seconds: float = 4.0
    rounds: int = 4
    connections: int = 32
    saturation_s: float = 3.0


def overhead_bodies(model: str = "tiny") -> list[bytes]:
    """The 64 request bodies (8 KB each)."""
    out = []
    for i in range(VARIANTS):
        user = (f"Question {i}: summarize clause {i} of the contract. " * 60)[:2048]
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": user},
            ],
            "max_tokens": 16,
        }
        out.append(orjson.dumps(body))
    return out


# Per-thread schedstat counts nanoseconds; /proc/PID/stat counts 10 ms ticks,
# about a tenth of the per-request CPU this compares at the default round
# length. Decided once, so one measurement never mixes the two clocks.
_SCHEDSTAT = os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")


def _own_cpu_s(pid: int, stat: list[str]) -> float:
    """CPU seconds of one process: its live threads' schedstat, else its stat ticks."""
    if _SCHEDSTAT:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            # A thread that ended meanwhile is skipped.
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and all its live descendants.

    Descendants count because some routers run behind a launcher process.
    """
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        stat = stats.get(p)
        if stat is not None:
            with contextlib.suppress(OSError):  # the process ended meanwhile
                total += _own_cpu_s(p, stat)
        todo += children.get(p, [])
    return total


async def measure(
    port: int,
    router_pid: int,
    engines_pid: int,
    direct_port: int,
    cfg: OverheadConfig,
    bodies: Sequence[bytes],
) -> dict[str, Any]:
    """Interleaved direct / through-router open-loop rounds, then the closed loop."""
    path = "/v1/chat/completions"
    direct_reqs = build_requests(direct_port, path, bodies)
    via_reqs = build_requests(port, path, bodies)
    direct, via = Latencies(), Latencies()
    router_cpu = engines_cpu = 0.0
    sent = 0
    seconds = cfg.seconds / cfg.rounds
    for _ in range(cfg.rounds):
        direct.extend(await open_loop(direct_port, direct_reqs, cfg.rate, seconds, WARMUP))
        r0, e0 = process_cpu_s(router_pid), process_cpu_s(engines_pid)
        v = await open_loop(port, via_reqs, cfg.rate, seconds, WARMUP)
        router_cpu += process_cpu_s(router_pid) - r0
        engines_cpu += process_cpu_s(engines_pid) - e0
        via.extend(v)
        sent += len(v.values) + WARMUP
    sat = await closed_loop(port, via_reqs, cfg.connections, cfg.saturation_s)
    ds, vs = direct.summary(), via.summary()
    return {
        "added_p50_ms": round(vs["p50_ms"] - ds["p50_ms"], 3),
        "added_p99_ms": round(vs["p99_ms"] - ds["p99_ms"], 3),
        "rps_max": round(sat["rps"], 1),
        "cpu_ms_per_request": round(1e3 * router_cpu / max(1, sent), 4),
        "engine_cpu_ms_per_request": round(1e3 * engines_cpu / max(1, sent), 4),
        "errors": vs["errors"] + int(sat["errors"]),
        "direct": ds,
        "via": vs,
        "saturation": sat,
    }


async def run_overhead(
    routers: Sequence[RouterSpec],
    cfg: OverheadConfig,
    fleet: Fleet,
    *,
    peers_dir: Path,
    tokenizer_dir: Path,
    on_start: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """The overhead figures of every router (skipped peers say why)."""
    ports = [free_port() for _ in range(cfg.workers)]
    cmd = [sys.executable, "-m", "prefixrouter.bench.instant",
           "--ports", ",".join(map(str, ports)), "--model-path", str(tokenizer_dir)]  # fmt: skip
    # Registered on the last port it binds: once that answers, all do.
    engines = fleet.start_command("instant engines", cmd, ports[-1])
    bodies = overhead_bodies()
    out: list[dict[str, Any]] = []
    try:
        await fleet.wait_healthy([engines], timeout_s=30)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for spec in routers:
            row: dict[str, Any] = {"router": spec.name, "label": spec.label}
            reason = skip_reason(spec, peers_dir)
            if reason is not None:
                out.append({**row, "skipped": reason})
                continue
            if on_start is not None:
                on_start(spec.name)
            port = free_port()
            cmd = router_command(
                spec, port=port, workers=urls, peers_dir=peers_dir,
                prometheus_port=free_port(), tokenizer_dir=tokenizer_dir,
            )  # fmt: skip
            router = fleet.start_command(spec.label, cmd, port)
            try:
                await fleet.wait_healthy([router])
                await wait_routable(router.url)
                figures = await measure(
                    port, router.process.pid, engines.process.pid, ports[0], cfg, bodies
                )
                out.append({**row, **figures})
            except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as exc:
                out.append({**row, "error": f"{exc}".strip() or type(exc).__name__})
            finally:
                fleet.stop(router)
    finally:
        fleet.stop(engines)
    return out
