"""Fault scenarios on a live loopback fleet: one owner for the suite, the table and the soak.

A :class:`FaultFleet` is real processes, started by command line and stopped
by PID (:class:`~prefixrouter.harness.processes.Fleet`): simulated engines
(``python -m prefixrouter.simulated_engine`` with ``--served-log``,
``--fault-injection`` and, for the single gateway, KV events with a replay
socket) and either one gateway (``python -m prefixrouter.gateway``, its
timeouts and health settings at their defaults) or replicas on a real
``nats-server`` (:mod:`prefixrouter.harness.replicas`).

Each scenario is an async function ``(fleet, load) -> FaultTimes`` that drives
one fault while an :class:`~prefixrouter.harness.faults.OpenLoad` runs;
:func:`run_scenario` wraps it: warm-up traffic, the fault, traffic after it,
then the engines' served logs and the gateway's decision records give a
:class:`FaultReport` (:func:`~prefixrouter.harness.faults.account`,
:func:`~prefixrouter.harness.faults.leave_s`, :func:`~prefixrouter.harness.faults.return_s`).
Every wait is for traffic or a condition, bounded; the only fixed waits are
a fault's own length (a 10 s freeze lasts 10 s).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prefixrouter.harness.faults import (
    LoadMix,
    OpenLoad,
    Outcome,
    Tally,
    account,
    leave_s,
    read_served,
    return_s,
    until,
)
from prefixrouter.harness.nats import NatsServer
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet, Server, kill_process
from prefixrouter.harness.replicas import GATEWAY_MODULE, start_replica, wait_ready_async

ENGINE_MODULE = "prefixrouter.simulated_engine"
BOUND_S = 30.0
"""Far above what any awaited condition takes on a loaded machine."""


@dataclass
class FaultFleet:
    """Engines and gateways of a fault run (module doc).

    Attributes:
        fleet: Owns every process.
        tmp: Where configs and served logs go.
        engines: Engine servers by name (``e0``...).
        gateways: Gateway servers by name (``gw``, or replicas ``r0``...).
        served: Each engine's served log.
        admin_key: The gateways' admin API key.
        nats: The NATS server of replicas (None: one gateway).
    """

    fleet: Fleet
    tmp: Path
    engines: dict[str, Server] = field(default_factory=dict)
    gateways: dict[str, Server] = field(default_factory=dict)
    served: dict[str, Path] = field(default_factory=dict)
    admin_key: str = field(default_factory=lambda: secrets.token_hex(16))
    nats: NatsServer | None = None
    config: Path | None = None
    _engine_args: dict[str, list[str]] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways.values()]

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    # ------------------------------------------------------------- engines

    def _start_engine(self, name: str) -> Server:
        port = self.engines[name].port if name in self.engines else free_port()
        server = self.fleet.start(name, ENGINE_MODULE, self._engine_args[name], port=port)
        self.engines[name] = server
        return server

    def kill_engine(self, name: str) -> None:
        """``SIGKILL`` an engine (a crash), then reap it."""
        server = self.engines[name]
        kill_process(server.process)
        self.fleet.stop(server)

    async def restart_engine(self, name: str) -> float:
        """Start an engine again on its port, its served log appended to; when it was ready."""
        server = self._start_engine(name)
        await self.fleet.wait_healthy([server], BOUND_S)
        return time.monotonic()

    def signal_engine(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.engines[name].pid, sig)

    async def set_faults(self, name: str, **faults: Any) -> None:
        """``POST /admin/faults`` on an engine (no arguments: healed)."""
        url = self.engines[name].url + "/admin/faults"
        async with aiohttp.ClientSession() as s, s.post(url, json=faults) as r:
            if r.status != 200:
                raise RuntimeError(f"{url} answered {r.status}: {await r.text()}")

    def in_stream(self, name: str) -> int:
        """Requests the engine has written a first byte of and not ended (from its log)."""
        first: set[str] = set()
        ended: set[str] = set()
        path = self.served[name]
        for line in path.read_bytes().splitlines() if path.exists() else ():
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if ev.get("ev") == "first":
                first.add(ev["rid"])
            elif ev.get("ev") == "end":
                ended.add(ev["rid"])
        return len(first - ended)

    # ------------------------------------------------------------- gateways

    def _start_gateway(self, name: str) -> Server:
        """Start gateway ``name`` (again: on its port); not yet healthy."""
        assert self.config is not None
        port = self.gateways[name].port if name in self.gateways else free_port()
        if self.nats is not None:
            server = start_replica(self.fleet, self.config, self.nats.url, name, port=port)
        else:
            server = self.fleet.start(name, GATEWAY_MODULE, ["--config", str(self.config)], port)
        self.gateways[name] = server
        return server

    def kill_gateway(self, name: str) -> None:
        server = self.gateways[name]
        kill_process(server.process)
        self.fleet.stop(server)

    async def restart_gateway(self, name: str) -> float:
        """Start a gateway again on its port; when it was healthy (replicas: ready)."""
        server = self._start_gateway(name)
        if self.nats is not None:
            await wait_ready_async([server], BOUND_S)
        else:
            await self.fleet.wait_healthy([server], BOUND_S)
        return time.monotonic()

    async def admin(self, name: str, path: str) -> Any:
        url = self.gateways[name].url + path
        async with aiohttp.ClientSession(headers=self.admin_headers) as s, s.get(url) as r:
            if r.status != 200:
                raise RuntimeError(f"{url} answered {r.status}")
            return await r.json()

    async def decisions(self) -> list[dict[str, Any]]:
        """Every gateway's decision records (a restarted one's since its restart)."""
        out: list[dict[str, Any]] = []
        for name in self.gateways:
            out.extend((await self.admin(name, "/admin/decisions?limit=20000"))["decisions"])
        return out

    async def worker_state(self, gateway: str, worker: str) -> dict[str, Any]:
        data = await self.admin(gateway, "/admin/workers")
        return next(w for w in data["workers"] if w["id"] == worker)

    async def settled_in_flight(self, timeout_s: float = 10.0) -> int:
        """Requests the gateways still count in flight once the load ended, after they
        have had ``timeout_s`` to settle (0: none stuck; a stuck one is a leak)."""

        async def count() -> int:
            total = 0
            for name in self.gateways:
                data = await self.admin(name, "/admin/workers")
                total += sum(int(w["in_flight"]) for w in data["workers"])
            return total

        async def settled() -> bool:
            return await count() == 0

        try:
            await until(settled, "the gateways' in-flight counts to settle", timeout_s, 0.1)
        except TimeoutError:
            return await count()
        return 0

    def tracebacks(self) -> int:
        """Tracebacks in the running gateways' logs (a gateway must never print one)."""
        return sum(g.log_tail(10_000_000).count("Traceback") for g in self.gateways.values())


def _engine_args(
    name: str, served: Path, kv_port: int | None, replay_port: int | None
) -> list[str]:
    args = ["--profile", "tiny-cpu", "--time-scale", "4", "--model", "tiny",
            "--kv-blocks", "4096", "--engine-id", name,
            "--served-log", str(served), "--fault-injection"]  # fmt: skip
    if kv_port is not None and replay_port is not None:
        args += ["--kv-events-endpoint", f"tcp://{HOST}:{kv_port}", "--kv-events-topic", name,
                 "--kv-replay-endpoint", f"tcp://{HOST}:{replay_port}"]  # fmt: skip
    return args


async def start_fault_fleet(
    fleet: Fleet, tmp: Path, *, engines: int = 3, replicas: int = 0
) -> FaultFleet:
    """Start the engines and one gateway (``replicas=0``, with KV events and replay) or
    ``replicas`` gateway replicas on a new NATS server; wait until all serve."""
    ff = FaultFleet(fleet, tmp)
    kv_port = free_port() if not replicas else None
    workers: list[dict[str, Any]] = []
    for i in range(engines):
        name = f"e{i}"
        ff.served[name] = tmp / f"{name}.served.jsonl"
        replay = free_port() if kv_port is not None else None
        ff._engine_args[name] = _engine_args(name, ff.served[name], kv_port, replay)
        worker: dict[str, Any] = {"url": "", "id": name}
        if replay is not None:
            worker |= {"kv_events_topic": name, "kv_replay_endpoint": f"tcp://{HOST}:{replay}"}
        workers.append(worker)
        ff._start_engine(name)
    for worker in workers:
        worker["url"] = ff.engines[worker["id"]].url
    cfg: dict[str, Any] = {
        "workers": workers,
        "server": {"admin_api_key": ff.admin_key},
        "decision_log": {"ring_size": 20000},
    }
    if kv_port is not None:
        cfg["kv_events"] = {"endpoint": f"tcp://{HOST}:{kv_port}"}
    if replicas:
        cfg["cluster"] = {"heartbeat_s": 0.2, "peer_ttl_s": 1.0}
    ff.config = tmp / "gateway.yaml"
    ff.config.write_bytes(orjson.dumps(cfg))  # JSON is YAML
    await fleet.wait_healthy(list(ff.engines.values()), BOUND_S)
    if not replicas:
        ff._start_gateway("gw")
        await fleet.wait_healthy(list(ff.gateways.values()), BOUND_S)
        return ff
    ff.nats = NatsServer().start()
    try:
        for i in range(replicas):
            ff._start_gateway(f"r{i}")
        await wait_ready_async(list(ff.gateways.values()), BOUND_S)
    except BaseException:
        ff.nats.close()  # the fleet stops the rest
        raise
    return ff


# ---------------------------------------------------------------- scenarios


@dataclass
class FaultTimes:
    """What a scenario did, when.

    Attributes:
        target: The engine or gateway the fault hit.
        t_fault: When it started.
        t_ready: When the target was back (restarted, thawed, healed).
        t_end: When the scenario's traffic ended (set by :func:`run_scenario`).
        restarted: The target was restarted or thawed: time the return to it.
        frozen: The target was stopped (``SIGSTOP``) from ``t_fault`` to ``t_ready``.
        extra: Scenario-specific figures.
    """

    target: str
    t_fault: float
    t_ready: float
    t_end: float = 0.0
    restarted: bool = False
    frozen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class FaultReport:
    """One scenario's figures (the suite asserts on them, the table prints them)."""

    name: str
    tally: Tally
    times: FaultTimes
    leave_s: float | None
    return_s: float | None
    outcomes: list[Outcome]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **self.tally.to_dict(),
            "target": self.times.target,
            "fault_s": round(self.times.t_ready - self.times.t_fault, 2),
            "leave_s": None if self.leave_s is None else round(self.leave_s, 3),
            "return_s": None if self.return_s is None else round(self.return_s, 3),
            **self.times.extra,
        }


Scenario = Callable[[FaultFleet, OpenLoad], Awaitable[FaultTimes]]


async def traffic(load: OpenLoad, since: float, n: int) -> None:
    """Until ``n`` requests sent since ``since`` have ended (bounded)."""

    async def probe() -> bool:
        return load.sent_since(since) >= n

    await until(probe, f"{n} requests after the fault", BOUND_S + n / load.mix.rate)


def busiest(load: OpenLoad, engines: Sequence[str]) -> str:
    """The engine that served the most requests so far (it holds documents)."""
    counts = {e: 0 for e in engines}
    for o in load.outcomes:
        if o.worker in counts:
            counts[o.worker] += 1
    return max(counts, key=lambda e: counts[e])


async def run_scenario(
    ff: FaultFleet,
    name: str,
    scenario: Scenario,
    mix: LoadMix | None = None,
    *,
    warm: int = 20,
    after: int = 30,
) -> FaultReport:
    """Warm-up traffic (``warm`` requests ended), the fault, ``after`` requests once the
    target is back; then the report."""
    load = OpenLoad(ff.urls, mix or LoadMix(), name=name)
    tracebacks = ff.tracebacks()
    await load.start()
    try:
        t0 = time.monotonic()
        await traffic(load, t0, warm)
        times = await scenario(ff, load)
        await traffic(load, times.t_ready, after)
        if times.restarted and times.target in ff.engines:
            # Traffic comes back by itself: wait for it (bounded), do not guess a time.
            async def back() -> bool:
                outs = load.outcomes
                got = return_s(outs, read_served(ff.served), times.target, times.t_ready)
                return got is not None

            await until(back, f"traffic to return to {times.target}", BOUND_S)
    finally:
        outcomes = await load.stop()
    times.t_end = time.monotonic()
    times.extra["tracebacks"] = max(0, ff.tracebacks() - tracebacks)
    times.extra["stuck_in_flight"] = await ff.settled_in_flight()
    served = read_served(ff.served)
    frozen = {times.target: [(times.t_fault, times.t_ready)]} if times.frozen else None
    tally = account(outcomes, served, frozen)
    left: float | None = None
    back_s: float | None = None
    if times.target in ff.engines:
        left = leave_s(outcomes, await ff.decisions(), times.target, times.t_fault, times.t_ready)
        if times.restarted:
            back_s = return_s(outcomes, served, times.target, times.t_ready)
    return FaultReport(name, tally, times, left, back_s, outcomes)


async def engine_sigkill(ff: FaultFleet, load: OpenLoad) -> FaultTimes:
    """SIGKILL the busiest engine while it streams; restart it once traffic has moved on."""
    target = busiest(load, list(ff.engines))

    async def streaming() -> bool:
        return ff.in_stream(target) > 0

    await until(streaming, f"{target} to be mid-stream", BOUND_S, interval_s=0.01)
    t_fault = time.monotonic()
    ff.kill_engine(target)
    await traffic(load, t_fault, 20)
    t_ready = await ff.restart_engine(target)
    return FaultTimes(target, t_fault, t_ready, restarted=True)


def freeze(seconds: float = 10.0) -> Scenario:
    """SIGSTOP the busiest engine for ``seconds``, then SIGCONT."""

    async def run(ff: FaultFleet, load: OpenLoad) -> FaultTimes:
        target = busiest(load, list(ff.engines))
        t_fault = time.monotonic()
        ff.signal_engine(target, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)  # the fault's own length
        finally:
            ff.signal_engine(target, signal.SIGCONT)
        return FaultTimes(target, t_fault, time.monotonic(), restarted=True, frozen=True)

    return run


def injected(faults: dict[str, Any], after: int = 25, ejected: bool = False) -> Scenario:
    """Switch ``faults`` on the busiest engine (``POST /admin/faults``) for ``after``
    requests' worth of traffic, then heal it.

    ``ejected``: the fault makes the gateway eject the engine (failing answers,
    :mod:`prefixrouter.core.outlier`), so traffic leaves it during the fault and
    returns after the heal: the report times both, as for a restart.
    """

    async def run(ff: FaultFleet, load: OpenLoad) -> FaultTimes:
        target = busiest(load, list(ff.engines))
        t_fault = time.monotonic()
        await ff.set_faults(target, **faults)
        try:
            await traffic(load, t_fault, after)
        finally:
            await ff.set_faults(target)
        t_ready = time.monotonic()
        during = [o for o in load.outcomes if t_fault <= o.t_send < t_ready]
        share = sum(o.worker == target for o in during) / max(1, len(during))
        extra = {"target_share": round(share, 3)}
        return FaultTimes(target, t_fault, t_ready, restarted=ejected, extra=extra)

    return run


async def kv_drop(ff: FaultFleet, load: OpenLoad) -> FaultTimes:
    """Drop the next KV-event batches of the busiest engine: a gap, then the gateway replays."""
    target = busiest(load, list(ff.engines))
    gw = next(iter(ff.gateways))
    before = (await ff.worker_state(gw, target)).get("kv_events") or {}
    t_fault = time.monotonic()
    await ff.set_faults(target, drop_kv_events=5)

    async def replayed() -> dict[str, Any] | None:
        feed = (await ff.worker_state(gw, target)).get("kv_events") or {}
        gaps = feed.get("gaps", 0) - before.get("gaps", 0)
        got = feed.get("replayed_messages", 0) - before.get("replayed_messages", 0)
        return {"gaps": gaps, "replayed": got} if gaps > 0 and got > 0 else None

    seen = await until(replayed, f"a KV gap and a replay on {target}", BOUND_S, interval_s=0.1)
    await ff.set_faults(target)
    return FaultTimes(target, t_fault, time.monotonic(), extra=seen)


def gateway_sigkill(name: str = "gw") -> Scenario:
    """SIGKILL a gateway (replicas: one of them) and restart it on its port."""

    async def run(ff: FaultFleet, load: OpenLoad) -> FaultTimes:
        t_fault = time.monotonic()
        ff.kill_gateway(name)
        await traffic(load, t_fault, 10)
        t_ready = await ff.restart_gateway(name)
        return FaultTimes(name, t_fault, t_ready, restarted=True)

    return run


def nats_outage(seconds: float = 4.0) -> Scenario:
    """Stop the replicas' NATS server for ``seconds``, then start it again."""

    async def run(ff: FaultFleet, load: OpenLoad) -> FaultTimes:
        assert ff.nats is not None
        t_fault = time.monotonic()
        await asyncio.to_thread(ff.nats.stop)
        try:
            await asyncio.sleep(seconds)  # the outage's own length
        finally:
            await asyncio.to_thread(ff.nats.start)
        return FaultTimes("nats", t_fault, time.monotonic())

    return run


def first_complete_after(outcomes: Sequence[Outcome], url: str | None, t: float) -> float | None:
    """Seconds from ``t`` to the end of the first request sent after it that completed
    (through ``url`` when given): how long the client saw an outage."""
    ends = [
        o.t_end
        for o in outcomes
        if o.t_send >= t and o.kind == "complete" and (url is None or o.url == url)
    ]
    return min(ends) - t if ends else None


SINGLE: dict[str, tuple[str, Scenario]] = {
    "engine_sigkill": ("engine SIGKILLed mid-stream, restarted", engine_sigkill),
    "engine_sigstop": ("engine SIGSTOPped 10 s, SIGCONT", freeze(10.0)),
    "engine_slow": ("engine 10x slow", injected({"slow": 10.0})),
    # Failing answers eject the engine: 60 requests' worth of fault (4 s at
    # 15 a second) show traffic leaving it, and the heal its return.
    "engine_500": ("engine answers 500", injected({"status": 500}, 60, ejected=True)),
    "engine_malformed": (
        "engine sends malformed JSON",
        injected({"malformed": True}, 60, ejected=True),
    ),
    "engine_truncated": (
        "engine truncates its SSE stream",
        injected({"truncate": True}, 60, ejected=True),
    ),
    "engine_bad_usage": ("engine sends wrong usage fields", injected({"bad_usage": True})),
    "kv_events_dropped": ("KV-event batches dropped (gap, replay)", kv_drop),
    "gateway_sigkill": ("gateway SIGKILLed, restarted", gateway_sigkill("gw")),
}
"""The scenarios of one gateway, in the order the suite runs them: ``key: (title, scenario)``."""

REPLICATED: dict[str, tuple[str, Scenario]] = {
    "nats_stopped": ("NATS stopped 4 s (2 replicas)", nats_outage(4.0)),
    "replica_sigkill": ("replica SIGKILLed, restarted (2 replicas)", gateway_sigkill("r1")),
}
"""The scenarios of gateway replicas on NATS."""
