"""`prefixrouter demo` when something goes wrong: it shows what it measured, and refuses early.

The runs are the bench's (tested live in ``tests/bench``); here they are
given to the command as a live run would return them, so each case is exact:
a router whose requests all failed, one whose run failed as a whole, an
engine not read after a run. Requests too long for ``--kv-blocks`` are
refused before any engine starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prefixrouter.bench.engine_metrics import EngineCounters
from prefixrouter.bench.live import RouterRun, ScenarioRun
from prefixrouter.bench.routers import ROUTERS
from prefixrouter.cli import app
from prefixrouter.demo.run import DemoConfig, demo_workload
from prefixrouter.harness.replay import ReplayResult

REQUESTS = 10
REFUSED = "This model's maximum context length is 1024 tokens. However, your request has 3013"


def _served(n: int) -> list[ReplayResult]:
    return [
        ReplayResult("doc-qa", "doc1", ok=True, status=200, ttft_s=0.05 + 0.01 * i,
                     e2e_s=0.5, prompt_tokens=3000, cached_tokens=2400)
        for i in range(n)
    ]  # fmt: skip


def _run_demo_returning(monkeypatch: pytest.MonkeyPatch, runs: list[RouterRun]) -> None:
    """Make the demo's live part return ``runs`` (no engine or gateway process)."""

    async def scenario(*args: Any, **kwargs: Any) -> ScenarioRun:
        workload = demo_workload(DemoConfig(requests=REQUESTS))
        return ScenarioRun(workload, 4, "llama3-8b-h100", runs, concurrency=64)

    monkeypatch.setattr("prefixrouter.demo.run.start_engines", lambda *a, **k: [])
    monkeypatch.setattr("prefixrouter.demo.run.run_scenario", scenario)


def _invoke(tmp_path: Path) -> Any:
    plot = tmp_path / "demo.png"
    return CliRunner().invoke(
        app, ["demo", "--requests", str(REQUESTS), "--plot", str(plot)], terminal_width=250
    )


def test_the_table_shows_what_was_measured_when_a_router_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    refused = [
        ReplayResult("doc-qa", "doc1", ok=False, status=400, error=REFUSED) for _ in range(REQUESTS)
    ]
    runs = [
        RouterRun(ROUTERS["round_robin"], results=refused, elapsed_s=2.0,
                  engines=[EngineCounters()] * 4),
        RouterRun(ROUTERS["prefix_aware"], error="the router did not become healthy"),
    ]  # fmt: skip
    _run_demo_returning(monkeypatch, runs)
    out = _invoke(tmp_path)
    assert out.exit_code == 1, (out.output, out.exception)
    lines = out.output.splitlines()
    (rr,) = [ln for ln in lines if "│ round_robin" in ln]
    # All failed: not measured, so '-', never '0 ms' or '0.0%' or 0 prefill tokens.
    assert f"0/{REQUESTS}" in rr and "ms" not in rr and "%" not in rr and rr.count(" - ") == 5
    notes = " ".join(out.output.split())  # the notes wrap at the console's width
    assert f"round_robin: {REQUESTS} of {REQUESTS} requests failed; the first: {REFUSED}" in notes
    (pa,) = [ln for ln in lines if "│ prefix_aware" in ln]
    assert "failed" in pa and "the router did not become healthy" in pa
    assert lines[-1] == "error: gateway prefix_aware: the router did not become healthy"
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"  # the plot too


def test_an_engine_not_read_after_a_run_is_named_under_the_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unread = "engine 2 (http://127.0.0.1:9): Cannot connect to host 127.0.0.1:9"
    counters: list[EngineCounters | None] = [EngineCounters(10, 20, 3)] * 3 + [None]
    runs = [
        RouterRun(ROUTERS["round_robin"], results=_served(REQUESTS), elapsed_s=2.0,
                  engines=[EngineCounters(10, 20, 3)] * 4),
        RouterRun(ROUTERS["prefix_aware"], results=_served(REQUESTS), elapsed_s=2.0,
                  engines=counters, unread=[unread]),
    ]  # fmt: skip
    _run_demo_returning(monkeypatch, runs)
    out = _invoke(tmp_path)
    assert out.exit_code == 0, (out.output, out.exception)
    (pa,) = [ln for ln in out.output.splitlines() if "│ prefix_aware" in ln]
    assert f"{REQUESTS}/{REQUESTS}" in pa and "80.0%" in pa  # the client's figures stand
    notes = " ".join(out.output.split())  # the notes wrap at the console's width
    assert f"prefix_aware: not read after the run, its figures shown as -: {unread}" in notes


def test_requests_too_long_for_kv_blocks_are_refused_before_any_engine_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_engines(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("engines started for requests every engine refuses")

    monkeypatch.setattr("prefixrouter.demo.run.start_engines", no_engines)
    out = CliRunner().invoke(
        app, ["demo", "--kv-blocks", "64", "--plot", str(tmp_path / "demo.png")]
    )
    assert out.exit_code == 2, (out.output, out.exception)
    last = out.output.strip().splitlines()[-1]
    assert last.startswith("error: demo: --kv-blocks 64: request 0 needs ")
    assert last.endswith("more than an engine's KV cache holds (1,024: 64 blocks of 16)")
    assert not (tmp_path / "demo.png").exists()
