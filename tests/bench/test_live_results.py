"""What a live run's figures say when something went wrong, and what its tables show.

* An engine that stops during a run costs its own counters, not the run:
  the client's per-request results are kept (real engines and our gateway
  on loopback, one engine killed mid-run by its PID).
* A router whose requests all failed has no TTFT, cached share or prefill
  (JSON null, ``-`` in the tables), and the tables name the first error.
* Requests that waited in the client for a concurrency slot are counted,
  their wait summed up, and the table says so under it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console
from rich.table import Table

from prefixrouter.bench.engine_metrics import EngineCounters
from prefixrouter.bench.live import LiveConfig, RouterRun, ScenarioRun, run_router, start_engines
from prefixrouter.bench.report import markdown, scenario_table
from prefixrouter.bench.rounds import rounds_summary
from prefixrouter.bench.routers import ROUTERS
from prefixrouter.bench.workload import BenchWorkload, build_bench_workload
from prefixrouter.harness.processes import Fleet, kill_process
from prefixrouter.harness.replay import ReplayResult
from prefixrouter.sim.profiles import get_profile
from prefixrouter.tokenization import load_tokenizer

PROFILE = get_profile("llama3-8b-h100")
TOO_LONG = (
    "This model's maximum context length is 16000 tokens. However, your request has "
    "20337 input tokens. Please reduce the length of the input messages."
)


def _workload(requests: int = 16, rate: float = 16.0) -> BenchWorkload:
    return build_bench_workload(
        "doc-qa", requests=requests, rate=rate, scale=0.1, workers=2, profile=PROFILE,
        tokenizer=load_tokenizer(), time_scale=1.0,
    )  # fmt: skip


def _text(table: Table) -> str:
    console = Console(record=True, width=250)
    console.print(table)
    return console.export_text()


def _ok(ttft_s: float, *, wait_s: float = 0.0, queued: bool = False) -> ReplayResult:
    return ReplayResult(
        "doc-qa", "doc1", ok=True, status=200, ttft_s=ttft_s, e2e_s=ttft_s + 0.5,
        wait_s=wait_s, queued=queued, prompt_tokens=1000, cached_tokens=600,
    )  # fmt: skip


def _report(*runs: RouterRun, concurrency: int | None = 64) -> dict[str, Any]:
    scenario = ScenarioRun(_workload(4), 2, PROFILE.name, list(runs), concurrency)
    return scenario.report()


@pytest.mark.timeout(120)
def test_an_engine_that_stops_during_the_run_loses_its_counters_not_the_run(
    tmp_path: Path,
) -> None:
    workload = _workload()
    cfg = LiveConfig(workers=2, profile=PROFILE.name, peers_dir=tmp_path, timeout_s=30.0)
    done: list[ReplayResult] = []
    engine_urls: list[str] = []

    async def body() -> RouterRun:
        with Fleet() as fleet:
            engines = start_engines(cfg, workload, fleet)
            engine_urls.extend(e.url for e in engines)
            await fleet.wait_healthy(engines)

            def on_done(res: ReplayResult) -> None:
                done.append(res)
                if len(done) == 4:  # a quarter in: engine 1 dies, as a crash would
                    kill_process(engines[1].process)

            return await run_router(
                ROUTERS["round_robin"], cfg, workload, fleet, engines, on_done=on_done
            )

    run = asyncio.run(asyncio.wait_for(body(), 100))
    assert run.error is None
    s = run.summary()
    # Every request the client measured is still there, successes and failures alike.
    assert s["requests"] == len(workload.requests) == len(done)
    assert s["ok"] + s["errors"] == s["requests"] and s["ok"] >= 4
    assert s["ttft_ms"] is not None and s["ttft_ms"]["mean"] > 0
    # Engine 0's counters were read; engine 1's are unavailable, and said to be.
    assert isinstance(s["per_worker_requests"][0], int) and s["per_worker_requests"][1] is None
    assert s["cached_token_share"] is None  # the fleet's share needs every engine
    (line,) = s["unread"]
    assert line.startswith(f"engine 1 ({engine_urls[1]}): ")
    report = _report(run)
    table = _text(scenario_table(report))
    assert "engine 1 (" in table and "not read after the run" in table
    assert f"{s['ok']}/{s['requests']}" in table


def test_a_router_whose_requests_all_failed_shows_nothing_measured() -> None:
    failed = [
        ReplayResult("doc-qa", "doc1", ok=False, status=400, error=TOO_LONG) for _ in range(10)
    ]
    run = RouterRun(
        ROUTERS["round_robin"], results=failed, elapsed_s=2.0,
        engines=[EngineCounters(), EngineCounters()],  # nothing looked up: all refused
    )  # fmt: skip
    s = run.summary()
    assert (s["requests"], s["ok"], s["errors"]) == (10, 0, 10)
    for key in ("ttft_ms", "e2e_ms", "cached_token_share", "client_cached_share"):
        assert s[key] is None, key
    assert s["prefill_tokens"] is None and s["first_error"] == TOO_LONG
    # The JSON says null, never a 0 that reads as a measured 0 ms.
    doc = orjson.loads(orjson.dumps(_report(run)))
    assert doc["results"][0]["ttft_ms"] is None
    table = _text(scenario_table(_report(run)))
    (row,) = [ln for ln in table.splitlines() if "│ round_robin" in ln]
    assert "0/10" in row and "0 ms" not in row and "0.0%" not in row and " - " in row
    assert "10 of 10 requests failed; the first: This model's maximum context length" in table
    md = markdown(_report(run))
    (md_row,) = [ln for ln in md.splitlines() if ln.startswith("| round_robin")]
    assert "0 ms" not in md_row and "| - |" in md_row
    assert "- round_robin: 10 of 10 requests failed; the first: This model's" in md
    # Rounds leave such a run out rather than average its nothing in.
    assert rounds_summary([{**s, "round": 1}])[0]["rounds"] == 0


def test_requests_that_waited_for_a_client_slot_are_counted_and_named() -> None:
    results = [
        _ok(0.2), _ok(0.3), _ok(1.4, wait_s=1.1, queued=True), _ok(2.0, wait_s=1.6, queued=True)
    ]  # fmt: skip
    engines: list[EngineCounters | None] = [
        EngineCounters(600, 1000, 2), EngineCounters(1800, 3000, 2)
    ]  # fmt: skip
    run = RouterRun(ROUTERS["round_robin"], results=results, elapsed_s=3.0, engines=engines)
    s = run.summary()
    assert s["client_queued"] == 2
    assert s["client_wait_ms"] == {"mean": 675.0, "max": 1600.0}
    assert s["ttft_ms"]["p99"] == 2000.0  # the wait is in the TTFT (open loop)
    assert s["cached_token_share"] == 0.6 and s["per_worker_requests"] == [2, 2]
    table = _text(scenario_table(_report(run, concurrency=2)))
    assert "round_robin: 2 of 4 requests found all 2 client slots taken and waited" in table
    assert "up to 1600 ms" in table and "the client limited these figures too" in table
    calm = RouterRun(ROUTERS["round_robin"], results=results[:2], elapsed_s=3.0, engines=engines)
    assert "client slot" not in _text(scenario_table(_report(calm)))


def test_rounds_average_the_cached_share_over_the_rounds_that_read_every_engine() -> None:
    base = RouterRun(
        ROUTERS["round_robin"], results=[_ok(0.2)], elapsed_s=1.0,
        engines=[EngineCounters(500, 1000, 1)],
    ).summary()  # fmt: skip
    rows = [{**base, "round": 1}, {**base, "round": 2, "cached_token_share": None}]
    (row,) = rounds_summary(rows)
    assert row["rounds"] == 2 and row["cached_share"] == {"mean": 0.5, "min": 0.5, "max": 0.5}
