"""One scenario through every router, live, on one fleet of simulated engines.

Steps for a scenario (:func:`run_scenario`):

1. start ``workers`` engine processes (``prefixrouter engine``: vLLM's API, real
   tokenizer, the engine model run at the scenario's time scale, the scenario's
   KV size) on free loopback ports;
2. for each router in turn: start it in front of the engines, wait for
   ``/health`` and for one request to pass through it, send the same warm-up
   traffic through it (unique prompts: a router that learns from traffic is
   measured in its steady state), let the engines finish anything left and
   empty their prefix caches (:func:`prefixrouter.harness.engines.reset_prefix_caches`),
   read their counters, replay the scenario at its offsets with the harness's
   streaming client (:func:`prefixrouter.harness.replay.replay`), read the
   counters again, stop the router;
3. the oracle (:mod:`prefixrouter.bench.oracle`) gets its pin file, computed
   from the workload (documents measured with the project's tokenizer, the
   engines' KV as the capacity), and our gateway in token mode a configuration
   file that says so, both in a temporary folder removed after the run;
4. a peer that is not installed is recorded as skipped (with the command that
   installs it); a router that fails to start is recorded with its error, and
   the others still run.

The engines can also be started first (:func:`start_engines`) and handed to
:func:`run_scenario`, which then leaves them running (``prefixrouter demo
--serve`` keeps them for a gateway of its own).

Figures per router (:meth:`RouterRun.summary`): client-side TTFT and end-to-end
latency (mean, p50, p90, p99: :func:`prefixrouter.stats.percentiles`,
successful requests only, each timed from its scheduled send time, see
:mod:`prefixrouter.harness.replay`), the client-side wait before the send
(mean and max over every request, and how many waited for a concurrency
slot: any such request means the client, not only the router, shaped the
figures), the prefill tokens the engines reported (prompt minus cached
tokens in the answers' ``usage``), throughput (successful requests over the
time from the first send to the last answer), the engines' cached-token
share and requests per engine (from their counters, see
:mod:`prefixrouter.bench.engine_metrics`).

A figure nothing measured is None (JSON null), never 0: TTFT and latency
when no request succeeded, the shares and prefill tokens when no prompt
token was reported or looked up. The engines are read again after the run,
apart from the run itself: an engine that stopped during the run loses only
its own counters (its ``per_worker_requests`` entry and the fleet's
``cached_token_share`` become None and ``unread`` says which engine and
why), not the client's per-request results.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from prefixrouter.bench.engine_metrics import EngineCounters, cached_share, scrape, scrape_each
from prefixrouter.bench.oracle import PIN_FILL, oracle_pins, write_pins
from prefixrouter.bench.overhead import process_cpu_s
from prefixrouter.bench.ratios import ttft_ratios
from prefixrouter.bench.rounds import by_round, round_label, rounds_summary
from prefixrouter.bench.routers import RouterSpec, router_command, skip_reason, token_config
from prefixrouter.bench.workload import BenchWorkload
from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.harness.health import wait_routable
from prefixrouter.harness.nats import NatsServer
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.harness.replay import ReplayRequest, ReplayResult, replay
from prefixrouter.harness.replicas import wait_ready_async
from prefixrouter.prometheus import histogram, histogram_quantile, totals
from prefixrouter.stats import percentiles

SYNC_CPU = "prefixrouter_cluster_sync_cpu_seconds_total"
LAG = "prefixrouter_cluster_propagation_lag_seconds"


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """How the fleet and the client run.

    Attributes:
        workers: Engine processes.
        profile: Engine profile (speed, KV size).
        peers_dir: Where the peers' venvs are.
        tokenizer_dir: Local tokenizer folder (sglang-router's ``--model-path``;
            None when no sglang-router runs).
        concurrency: Most requests the client keeps in flight.
        timeout_s: Per-request client timeout.
        log_dir: Keep router logs and our gateway's decision logs here.
        warmup: Requests sent through each router before its measured run.
        warmup_concurrency: Warm-up requests in flight at once.
    """

    workers: int
    profile: str
    peers_dir: Path
    tokenizer_dir: Path | None = None
    concurrency: int = 512
    timeout_s: float = 600.0
    log_dir: Path | None = None
    warmup: tuple[ReplayRequest, ...] = ()
    warmup_concurrency: int = 8


@dataclass(slots=True)
class RouterRun:
    """One router's run of one scenario.

    Attributes:
        spec: The router.
        results: Every measured request's result, in workload order.
        elapsed_s: First send to last answer.
        engines: Each engine's counter deltas over the run; None for an
            engine that could not be read after it.
        skipped: Why the router did not run (not installed).
        error: Why the run failed before it measured anything.
        replicas: Each gateway replica's figures (several replicas only).
        round: Its round, from 1, under ``--rounds``.
        unread: What could not be read after the run, and why (one line each).
    """

    spec: RouterSpec
    results: list[ReplayResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    engines: list[EngineCounters | None] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    replicas: list[ReplicaFigures] = field(default_factory=list)
    round: int | None = None  # its round, from 1, under --rounds (prefixrouter.bench.rounds)
    unread: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The router's name, and its round when there are several."""
        return round_label(self.spec.name, self.round)

    def summary(self) -> dict[str, Any]:
        """The JSON figures of this run (module doc); None where nothing was measured."""
        out: dict[str, Any] = {"router": self.spec.name, "label": self.spec.label}
        if self.round is not None:
            out["round"] = self.round
        if self.skipped is not None:
            return {**out, "skipped": self.skipped}
        if self.error is not None:
            return {**out, "error": self.error}
        ok = [r for r in self.results if r.ok]
        ttft = sorted(r.ttft_s * 1e3 for r in ok if r.ttft_s >= 0)
        e2e = sorted(r.e2e_s * 1e3 for r in ok)
        errors = [r for r in self.results if not r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        read = [c for c in self.engines if c is not None]
        # The fleet's share needs every engine: a share of the engines left
        # would pass for the fleet's. No token looked up: nothing measured.
        whole = bool(read) and len(read) == len(self.engines)
        looked_up = sum(c.queries for c in read)
        waits = [r.wait_s * 1e3 for r in self.results]
        return {
            **out,
            "requests": len(self.results),
            "ok": len(ok),
            "errors": len(errors),
            "first_error": (errors[0].error or f"HTTP {errors[0].status}") if errors else None,
            "ttft_ms": percentiles(ttft) if ttft else None,
            "e2e_ms": percentiles(e2e) if e2e else None,
            "throughput_rps": len(ok) / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "cached_token_share": cached_share(read) if whole and looked_up else None,
            "per_worker_requests": [
                round(c.requests) if c is not None else None for c in self.engines
            ],
            "client_cached_share": cached / prompt if prompt else None,
            "prefill_tokens": prompt - cached if prompt else None,
            "client_wait_ms": {
                "mean": round(math.fsum(waits) / len(waits), 3) if waits else 0.0,
                "max": round(max(waits, default=0.0), 3),
            },
            "client_queued": sum(1 for r in self.results if r.queued),
            "elapsed_s": self.elapsed_s,
            **({"unread": list(self.unread)} if self.unread else {}),
            **(_replica_summary(self.replicas) if len(self.replicas) > 1 else {}),
        }


@dataclass(slots=True)
class ReplicaFigures:
    """One gateway replica's share of a run (several replicas only).

    Attributes:
        requests: Requests the client sent to it.
        cpu_s: CPU its process used during the measured run.
        sync_cpu_s: Of that, CPU spent encoding, publishing, decoding and
            applying routing facts (its ``prefixrouter_cluster_sync_cpu_seconds_total``).
        lag_buckets: Its fact-propagation-lag histogram over the run (cumulative,
            seconds; empty when not synced).
    """

    requests: int
    cpu_s: float
    sync_cpu_s: float
    lag_buckets: dict[float, float]


def _replica_summary(replicas: Sequence[ReplicaFigures]) -> dict[str, Any]:
    total = sum(r.requests for r in replicas)
    lag: dict[float, float] = {}
    for r in replicas:
        for le, n in r.lag_buckets.items():
            lag[le] = lag.get(le, 0.0) + n
    return {
        "replicas": len(replicas),
        "per_replica_requests": [r.requests for r in replicas],
        "cpu_ms_per_request": [
            round(1e3 * r.cpu_s / r.requests, 3) if r.requests else 0.0 for r in replicas
        ],
        # Every request's facts reach every replica: its sync work scales with
        # the cluster's requests, not with the ones it was sent.
        "sync_cpu_ms_per_request": [
            round(1e3 * r.sync_cpu_s / total, 4) if total else 0.0 for r in replicas
        ],
        "propagation_lag_ms": {
            "p50": 1e3 * histogram_quantile(lag, 0.5),
            "p99": 1e3 * histogram_quantile(lag, 0.99),
            "facts_messages": lag.get(float("inf"), 0.0),
        },
    }


@dataclass(slots=True)
class ScenarioRun:
    """A scenario's workload and every router's run."""

    workload: BenchWorkload
    workers: int
    profile: str
    runs: list[RouterRun] = field(default_factory=list)
    concurrency: int | None = None  # the client's most requests in flight

    def report(self) -> dict[str, Any]:
        """``{"scenario", ..., "results": [...]}`` for the JSON file."""
        w = self.workload
        results = [r.summary() for r in self.runs]
        # The oracle and peer ratios compare runs of one round with each other.
        ratios = [row for group in by_round(results) for row in ttft_ratios(group)]
        rounds = {"rounds": rounds_summary(results)} if any("round" in r for r in results) else {}
        return {
            "scenario": w.scenario,
            "description": w.description,
            "shared_prefix": w.shared_prefix,
            "workers": self.workers,
            "profile": self.profile,
            "requests": len(w.requests),
            "rate_rps": w.rate,
            "load": round(w.load, 4),
            "time_scale": round(w.time_scale, 6),
            "kv_blocks": w.kv_blocks,
            "client_concurrency": self.concurrency,
            "results": results,
            "ratios": ratios,
            **rounds,
        }


def engine_args(cfg: LiveConfig, workload: BenchWorkload, index: int) -> list[str]:
    """``prefixrouter engine`` options for engine ``index`` of a scenario's fleet."""
    args = ["--profile", cfg.profile, "--time-scale", repr(workload.time_scale)]
    if workload.kv_blocks is not None:
        args += ["--kv-blocks", str(workload.kv_blocks)]
    return [*args, "--model", "tiny", "--engine-id", str(index)]


async def run_router(
    spec: RouterSpec,
    cfg: LiveConfig,
    workload: BenchWorkload,
    fleet: Fleet,
    engines: Sequence[Server],
    *,
    on_start: Callable[[str, int], None] | None = None,
    on_done: Callable[[ReplayResult], None] | None = None,
    round_number: int | None = None,
) -> RouterRun:
    """One router's run of the scenario on the running ``engines`` (module doc).

    A router of several replicas (``spec.replicas``) is that many gateway
    processes, on one nats-server of their own when synced; the client
    sends them the requests round robin, and each replica's CPU, sync CPU
    and propagation lag over the measured run are kept.
    """
    run = RouterRun(spec, round=round_number)
    run.skipped = skip_reason(spec, cfg.peers_dir)
    if run.skipped is not None:
        return run
    urls = [e.url for e in engines]
    stem = f"{workload.scenario}-{spec.name}"
    if round_number is not None:  # each round's logs of their own
        stem += f"-round{round_number}"
    nats = NatsServer().start() if spec.clustered else None
    routers: list[Server] = []
    work = Path(tempfile.mkdtemp(prefix="prefixrouter-bench-"))
    try:
        routers = _start_routers(
            spec, cfg, fleet, urls, stem, nats, _files(spec, workload, work, len(urls))
        )
        await fleet.wait_healthy(routers)
        if nats is not None:
            await wait_ready_async(routers)
        for router in routers:
            await wait_routable(router.url)
        bases = [r.url for r in routers]
        if cfg.warmup:
            warm = await replay(bases, cfg.warmup, concurrency=cfg.warmup_concurrency)
            failed = [r for r in warm if not r.ok]
            if len(failed) > len(warm) // 2:
                raise RuntimeError(f"warm-up failed: {failed[0].error or failed[0].status}")
        await reset_prefix_caches(urls)
        before = await scrape(urls)
        replicas_before = await _replica_state(routers) if len(routers) > 1 else []
        if on_start is not None:
            on_start(run.label, len(workload.requests))
        t0 = time.perf_counter()
        run.results = await replay(
            bases, workload.requests, concurrency=cfg.concurrency,
            timeout_s=cfg.timeout_s, on_done=on_done,
        )  # fmt: skip
        run.elapsed_s = time.perf_counter() - t0
    except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as exc:
        run.error = f"{exc}".strip() or type(exc).__name__
    else:
        # Outside the run's handler: a process that stopped during the run
        # costs its own figures, not every request the client measured.
        await _read_after(run, urls, before, routers, replicas_before, len(workload.requests))
    finally:
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            for i, router in enumerate(routers):
                suffix = f"-r{i}" if len(routers) > 1 else ""
                (cfg.log_dir / f"{stem}{suffix}.log").write_text(router.log_tail(200_000))
        for router in routers:
            fleet.stop(router)
        if nats is not None:
            nats.close()
        shutil.rmtree(work, ignore_errors=True)
    return run


async def _read_after(
    run: RouterRun,
    urls: Sequence[str],
    before: Sequence[EngineCounters],
    routers: Sequence[Server],
    replicas_before: Sequence[_ReplicaState],
    requests: int,
) -> None:
    """Read the engines' (and replicas') counters after ``run`` into it, never raising.

    An engine that does not answer (it stopped during the run) gets None and
    a line in ``run.unread``; so do the replicas' figures, all or none.
    """
    after, problems = await scrape_each(urls)
    run.engines = [a - b if a is not None else None for a, b in zip(after, before, strict=True)]
    run.unread += problems
    if not replicas_before:
        return
    sent = [len(range(i, requests, len(routers))) for i in range(len(routers))]
    try:
        now = await _replica_state(routers)
    except (OSError, aiohttp.ClientError, TimeoutError) as exc:
        why = f"{exc}".strip() or type(exc).__name__
        run.unread.append(f"gateway replicas: {why}")
        return
    run.replicas = list(map(_figures, sent, replicas_before, now))


def _files(
    spec: RouterSpec, workload: BenchWorkload, folder: Path, engines: int
) -> dict[str, Path]:
    """The files ``spec`` is started with: the oracle's pins, token mode's configuration."""
    if spec.kind == "oracle":
        from prefixrouter.tokenization import load_tokenizer

        tok = load_tokenizer()
        capacity = None
        if workload.kv_blocks is not None:
            capacity = int(PIN_FILL * workload.kv_blocks * workload.block_size)
        keys, pins = oracle_pins(workload.requests, engines, lambda t: len(tok.encode(t)), capacity)
        write_pins(folder / "pins.json", keys, pins)
        return {"pins": folder / "pins.json"}
    if spec.ours and spec.mode == "token" and spec.config is None:
        return {"config": token_config(folder)}
    return {}


def _start_routers(
    spec: RouterSpec,
    cfg: LiveConfig,
    fleet: Fleet,
    urls: Sequence[str],
    stem: str,
    nats: NatsServer | None,
    files: dict[str, Path],
) -> list[Server]:
    """Start ``spec``'s process (or its replicas) in front of ``urls`` (not yet healthy)."""
    routers = []
    for i in range(spec.replicas):
        replica = f"r{i}"
        suffix = f"-{replica}" if spec.replicas > 1 else ""
        decisions = (
            cfg.log_dir / f"{stem}{suffix}.decisions.jsonl" if cfg.log_dir and spec.ours else None
        )
        if decisions is not None:
            decisions.unlink(missing_ok=True)
        port = free_port()
        cmd = router_command(
            spec, port=port, workers=urls, peers_dir=cfg.peers_dir, prometheus_port=free_port(),
            tokenizer_dir=cfg.tokenizer_dir, decision_log=decisions,
            cluster=(nats.url, replica) if nats is not None else None,
            config=files.get("config"), pins=files.get("pins"),
        )  # fmt: skip
        label = f"{spec.label} {replica}" if spec.replicas > 1 else spec.label
        routers.append(fleet.start_command(label, cmd, port))
    return routers


@dataclass(frozen=True, slots=True)
class _ReplicaState:
    cpu_s: float
    sync_cpu_s: float
    lag: dict[float, float]


async def _replica_state(routers: Sequence[Server]) -> list[_ReplicaState]:
    """Each replica's process CPU and its cluster counters now."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for router in routers:
            async with session.get(router.url + "/metrics") as resp:
                page = await resp.text()
            sync = totals(page, [SYNC_CPU]).get(SYNC_CPU, 0.0)
            out.append(_ReplicaState(process_cpu_s(router.pid), sync, histogram(page, LAG)))
    return out


def _figures(requests: int, before: _ReplicaState, after: _ReplicaState) -> ReplicaFigures:
    lag = {le: n - before.lag.get(le, 0.0) for le, n in after.lag.items()}
    return ReplicaFigures(
        requests, after.cpu_s - before.cpu_s, after.sync_cpu_s - before.sync_cpu_s, lag
    )


def start_engines(cfg: LiveConfig, workload: BenchWorkload, fleet: Fleet) -> list[Server]:
    """Start the scenario's engine processes in ``fleet`` (not yet healthy)."""
    return [
        fleet.start(f"engine {i}", "prefixrouter.simulated_engine", engine_args(cfg, workload, i))
        for i in range(cfg.workers)
    ]


async def run_scenario(
    workload: BenchWorkload,
    routers: Sequence[RouterSpec],
    cfg: LiveConfig,
    fleet: Fleet,
    *,
    engines: Sequence[Server] | None = None,
    on_start: Callable[[str, int], None] | None = None,
    on_done: Callable[[ReplayResult], None] | None = None,
    rounds: int = 1,
) -> ScenarioRun:
    """Run every router in turn on the scenario's fleet, ``rounds`` times.

    With several rounds, round 1 runs each router once in the given order,
    then round 2, ...: interleaved, so that a slow spell of the machine
    falls on every router alike (:mod:`prefixrouter.bench.rounds`). Without
    ``engines``, a fleet is started for ``workload`` and stopped at the end;
    given ``engines`` (from :func:`start_engines`), they are used and left
    running.
    """
    owned = engines is None
    fleet_engines = start_engines(cfg, workload, fleet) if engines is None else list(engines)
    out = ScenarioRun(workload, cfg.workers, cfg.profile, concurrency=cfg.concurrency)
    try:
        await fleet.wait_healthy(fleet_engines)
        for k in range(rounds):
            number = k + 1 if rounds > 1 else None
            for spec in routers:
                run = await run_router(
                    spec, cfg, workload, fleet, fleet_engines, on_start=on_start,
                    on_done=on_done, round_number=number,
                )  # fmt: skip
                out.runs.append(run)
    finally:
        if owned:
            for e in fleet_engines:
                fleet.stop(e)
    return out
