"""Benchmark scripts with no test of their own, run on a small input as a user would.

Both had broken against the code they measure without anyone noticing (a
dispatcher call that gained an argument, a handler that reads more of its
request): each is run here end to end, and its figures are checked for what
they must satisfy. CI's ``mypy src/ benchmarks/`` reads every script against
the package's types as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _run_json(script: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_index_memory_routes_unique_prompts_and_the_router_stays_within_its_bounds() -> None:
    workers, capacity = 2, 50
    out = _run_json(
        "index_memory.py",
        *("--prompts", "600", "--every", "200", "--workers", str(workers)),
        *("--capacity-blocks", str(capacity), "--service-s", "0.05", "--json"),
    )
    records = out["records"]
    assert [r["prompts"] for r in records] == [200, 400, 600]
    for r in records:
        # The index holds at most its capacity per worker, however many
        # prompts came (each of these fills a worker's capacity many times).
        assert 0 < r["speculative"] <= r["entries"] <= workers * capacity
        assert r["rss_mb"] > 0
    # The demand table is swept once it doubles past what the index holds.
    assert records[-1]["demand"] < records[-2]["demand"]


def test_gateway_overhead_hot_loop_times_the_handler_with_and_without_the_routing_core() -> None:
    out = _run_json("gateway_overhead.py", "--hot-loop", "50")
    assert out["handler_us"] > out["gateway_own_us"] > 0
    # Each figure is rounded to 0.01 us on its own.
    assert abs(out["routing_core_us"] - (out["handler_us"] - out["gateway_own_us"])) <= 0.011
    calls = out["routing_core_calls"]
    assert set(calls) == {"route_us", "text_hashing_us", "on_routed_us", "on_completed_us"}
    assert all(v > 0 for v in calls.values())
