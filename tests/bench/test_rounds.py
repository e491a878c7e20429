"""`prefixrouter bench --rounds`: each router's spread and paired ratio, from the summaries."""

from __future__ import annotations

from typing import Any

import pytest

from prefixrouter.bench.report import markdown
from prefixrouter.bench.rounds import by_round, rounds_summary


def run(
    router: str, k: int, mean: float, p99: float = 1000.0, cached: float = 0.9
) -> dict[str, Any]:
    """A completed run's summary, as RouterRun.summary() gives it (the fields read here)."""
    return {"router": router, "round": k, "ok": 10, "requests": 10,
            "ttft_ms": {"mean": mean, "p50": mean, "p90": p99, "p99": p99},
            "e2e_ms": {"mean": mean, "p50": mean, "p90": p99, "p99": p99},
            "throughput_rps": 1.0, "cached_token_share": cached,
            "per_worker_requests": [5, 5]}  # fmt: skip


def test_the_ratio_is_taken_within_each_round_against_the_first_router() -> None:
    # Round 2 is slow for everyone: the means spread, the paired ratio does not.
    results = [run("a", 1, 1000.0), run("b", 1, 800.0), run("a", 2, 2000.0), run("b", 2, 1600.0)]
    a, b = rounds_summary(results)
    assert a["router"] == "a" and a["vs_first"] is None  # the reference itself
    assert a["ttft_mean_ms"] == {"mean": 1500.0, "min": 1000.0, "max": 2000.0}
    assert b["rounds"] == 2 and b["ttft_mean_ms"]["min"] == 800.0
    assert b["vs_first"] == {"router": "a", "mean": pytest.approx(0.8), "min": pytest.approx(0.8),
                             "max": pytest.approx(0.8), "rounds": 2}  # fmt: skip


def test_a_round_whose_first_router_failed_is_compared_with_the_next_that_completed() -> None:
    failed = {"router": "a", "round": 2, "error": "engines did not start"}
    results = [run("a", 1, 1000.0), run("b", 1, 500.0), run("c", 1, 2000.0),
               failed, run("b", 2, 400.0), run("c", 2, 1200.0)]  # fmt: skip
    a, b, c = rounds_summary(results)
    assert a["rounds"] == 1
    # Round 2's reference is b: b has one ratio (round 1), c has both rounds'.
    assert b["vs_first"]["rounds"] == 1 and b["vs_first"]["mean"] == pytest.approx(0.5)
    assert c["vs_first"]["router"] == "a / b"
    assert c["vs_first"]["min"] == pytest.approx(2.0) and c["vs_first"]["max"] == pytest.approx(3.0)


def test_a_router_that_never_completed_has_no_figures() -> None:
    skipped = [{"router": "peer", "round": k, "skipped": "not installed"} for k in (1, 2)]
    results = [run("a", 1, 100.0), skipped[0], run("a", 2, 120.0), skipped[1]]
    a, peer = rounds_summary(results)
    assert peer == {"router": "peer", "rounds": 0, "ttft_mean_ms": None, "ttft_p99_ms": None,
                    "cached_share": None, "vs_first": None}  # fmt: skip
    assert [len(g) for g in by_round(results)] == [2, 2]
    assert a["cached_share"]["mean"] == pytest.approx(0.9)


def test_markdown_names_each_round_and_adds_the_rounds_table() -> None:
    results = [
        run("round_robin", 1, 1000.0),
        run("prefix_aware", 1, 700.0, cached=0.95),
        run("round_robin", 2, 1100.0),
        run("prefix_aware", 2, 990.0, cached=0.93),
    ]
    rep = {"scenario": "doc-qa", "requests": 10, "rate_rps": 8.0, "workers": 2, "load": 0.8,
           "time_scale": 0.4, "kv_blocks": None, "results": results,
           "rounds": rounds_summary(results)}  # fmt: skip
    text = markdown(rep)
    assert "| **prefix_aware · round 2** | 10/10 | 990 ms |" in text
    assert "| round_robin · round 1 | 10/10 | 1,000 ms |" in text
    row = next(line for line in text.splitlines() if line.startswith("| prefix_aware | 2 |"))
    # mean of 700 and 990; paired ratios 0.70 and 0.90
    assert "845 ms (700 ms to 990 ms)" in row and "0.80x (0.70x to 0.90x) of round_robin" in row
    assert "94.0% (93.0% to 95.0%)" in row
