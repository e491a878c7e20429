"""``benchmarks/policy_diff.py``: seeds paired into a standard error, shaped cells, bad input."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "policy_diff.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import policy_diff  # noqa: E402
from sim_results import build  # noqa: E402

from prefixrouter.sim.traces import bundled_mooncake_path, load_mooncake  # noqa: E402


def _figures(*means: float) -> dict[int, dict[str, float]]:
    return {seed: {"mean": m, "p99": m, "prefill": m} for seed, m in enumerate(means)}


def test_a_change_is_paired_by_seed() -> None:
    # Seeds that differ a lot from each other but move alike: a clear change.
    before = _figures(100.0, 300.0, 200.0)
    after = _figures(90.0, 290.0, 188.0)
    c = policy_diff.change(before, after, "mean")
    assert c.before == pytest.approx(200.0) and c.after == pytest.approx(189.3333, rel=1e-4)
    diffs = [-10.0, -10.0, -12.0]
    se = 100 * math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2) / math.sqrt(3) / 200
    assert c.se_pct == pytest.approx(se)
    assert c.clear and c.label() == f"{c.pct:+.1f}% ±{se:.1f}"
    # The same means, moving both ways by seed: no clear change.
    noisy = policy_diff.change(before, _figures(150.0, 230.0, 188.0), "mean")
    assert noisy.pct == pytest.approx(c.pct) and not noisy.clear


def test_one_seed_has_no_standard_error() -> None:
    c = policy_diff.change(_figures(100.0), _figures(50.0), "mean")
    assert c.se_pct is None and not c.clear and c.label() == "-50.0%"
    # Only the seeds both sides ran are paired.
    both = policy_diff.change(_figures(100.0, 400.0), _figures(50.0), "mean")
    assert both.before == 100.0 and both.se_pct is None


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_shaped_cell_against_the_same_code_moves_nothing() -> None:
    done = _run(
        "--against", str(ROOT / "src"), "--scenarios", "doc-qa", "--loads", "0.8",
        "--modes", "token", "--scale", "0.5", "--workers", "4", "--requests", "40",
        "--kv-cells", "", "--seeds", "0,1", "--all", "--processes", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if "doc-qa" in line)
    assert row.count("+0.0% ±0.0") == 2
    assert "0 figures lower, 0 higher" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scale", "1.5"], "--scale: must be in (0, 1], got 1.5"),
        (["--workers", "-1"], "--workers and --requests"),
        (["--scenarios", "doc-qb"], "unknown scenario 'doc-qb'"),
        (["--arrival", "burst"], "--arrival: unknown arrival process 'burst'"),
    ],
)
def test_bad_arguments_are_refused_by_name(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_the_trace_s_seeds_are_its_windows() -> None:
    data = gzip.decompress(bundled_mooncake_path().read_bytes())
    lines = [line for line in data.split(b"\n") if line.strip()]
    assert policy_diff.trace_windows(3_000) == len(lines) // 3_000 >= 4
    # Window 0 is the requests sim_results.py runs, and the windows' own path cuts it alike.
    built = build("mooncake-conversation", 0, 500)
    assert policy_diff.trace_window("mooncake-conversation", 0, 500).requests == built.requests
    cut = load_mooncake(bundled_mooncake_path(), start=0, limit=500)
    assert [r.arrival for r in cut.requests] == [r.arrival for r in built.requests]
    assert [r.segments for r in cut.requests] == [r.segments for r in built.requests]
    # Window 2: the next requests of the file, their times from the first of them.
    w2 = policy_diff.trace_window("mooncake-conversation", 2, 500)
    assert len(w2.requests) == 500 and w2.requests[0].arrival == 0.0
    rows = [json.loads(line) for line in lines[1_000:1_500]]
    expected = [(r["timestamp"] - rows[0]["timestamp"]) / 1000 for r in rows]
    assert [r.arrival for r in w2.requests] == pytest.approx(sorted(expected))
    assert [r.prompt_tokens for r in w2.requests] == [r["input_length"] for r in rows]


def test_seeds_past_the_trace_s_last_window_are_left_out_of_its_cells() -> None:
    windows = policy_diff.trace_windows(3_000)
    args = policy_diff.parse_args(
        ["--scenarios", "mooncake-conversation,doc-qa", "--loads", "0.9", "--modes", "token",
         "--kv-cells", "", "--seeds", ",".join(str(s) for s in range(windows + 2))]
    )  # fmt: skip
    seeds: dict[str, list[int]] = {}
    for job in policy_diff.jobs(args):
        seeds.setdefault(job.cell[0], []).append(job.seed)
    assert sorted(seeds["mooncake-conversation"]) == list(range(windows))
    assert sorted(seeds["doc-qa"]) == list(range(windows + 2))


def test_a_bursty_arrival_process_changes_the_times_not_the_requests() -> None:
    def job(arrival: str) -> policy_diff.Job:
        shape = policy_diff.Shape(requests=50, arrival=arrival)
        return policy_diff.Job(("templates", 0.6, "token", None), 0, {}, 3000, 0, shape)

    poisson = policy_diff.workload(job("poisson")).requests
    bursty = policy_diff.workload(job("gamma:3")).requests
    assert [[list(s) for s in r.segments] for r in poisson] == [
        [list(s) for s in r.segments] for r in bursty
    ]
    assert [r.arrival for r in poisson] != [r.arrival for r in bursty]


def test_every_cell_runs_once_with_the_trace_among_the_defaults() -> None:
    # The registry holds the bundled trace's scenario: naming it again ran its
    # cells (the slowest) twice.
    args = policy_diff.parse_args(
        ["--seeds", "0,1", "--scenarios", "gsp,mooncake-conversation,gsp"]
    )
    runs = [(job.cell, job.seed) for job in policy_diff.jobs(args)]
    assert len(runs) == len(set(runs)) == 2 * 2 * 2 * 2  # scenarios x loads x modes x seeds
    defaults = [(job.cell, job.seed) for job in policy_diff.jobs(policy_diff.parse_args([]))]
    assert len(defaults) == len(set(defaults))
    assert {cell[0] for cell, _ in defaults} >= {"mooncake-conversation", "doc-qa"}
