"""``benchmarks/seed_verdict.py``: the verdict over seeds, its table, a saved run, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "seed_verdict.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import seed_verdict  # noqa: E402
from sim_results import PROFILE  # noqa: E402

from prefixrouter.core.policy import policy_names  # noqa: E402


def _cell(**per_policy: tuple[float, ...]) -> dict[str, dict[int, dict[str, float]]]:
    """Each policy's mean TTFT per seed (the p99 twice the mean)."""
    return {
        policy: {seed: {"mean": m, "p99": 2 * m} for seed, m in enumerate(means)}
        for policy, means in per_policy.items()
    }


def test_the_best_baseline_is_the_lowest_over_the_seeds_not_on_one() -> None:
    # round_robin is lowest on seed 0, preble_e2 over the seeds.
    cell = _cell(
        prefix_aware=(80.0, 82.0, 81.0),
        round_robin=(70.0, 200.0, 190.0),
        preble_e2=(100.0, 101.0, 99.0),
    )
    v = seed_verdict.judge(cell, "mean")
    assert v.baseline == "preble_e2"
    assert v.change.before == pytest.approx(100.0) and v.change.after == pytest.approx(81.0)
    assert v.word == "ahead" and v.seeds_lower == 3 and v.seeds == 3


def test_a_change_within_two_standard_errors_is_level_and_a_clear_loss_is_behind() -> None:
    noisy = _cell(prefix_aware=(90.0, 120.0, 95.0, 125.0), round_robin=(110.0, 100.0, 115.0, 105.0))
    v = seed_verdict.judge(noisy, "mean")
    assert v.word == "level" and v.seeds_lower == 2
    worse = _cell(prefix_aware=(105.0, 106.0, 104.0), round_robin=(100.0, 100.0, 100.0))
    assert seed_verdict.judge(worse, "p99").word == "behind"
    assert seed_verdict.judge(worse, "p99").seeds_lower == 0


def test_the_table_counts_each_verdict_and_the_twenty_percent_cells() -> None:
    runs = {
        ("doc-qa", 0.6): _cell(prefix_aware=(70.0, 72.0), round_robin=(100.0, 101.0)),
        ("unique", 0.6): _cell(prefix_aware=(50.0, 40.0), round_robin=(100.0, 101.0)),
        ("rag", 0.9): _cell(prefix_aware=(99.0, 103.0), round_robin=(100.0, 101.0)),
    }
    text = seed_verdict.markdown(runs, "python benchmarks/seed_verdict.py --seeds 0,1", 0.0)
    assert "### Over seeds 0-1: the verdict with its spread" in text
    assert "| doc-qa | 0.6 | 71 ms | 100 ms (round_robin) | -29.4% ±0.5 | **ahead** | 2/2 |" in text
    assert "- mean: ahead on 2 cells, level on 1, behind on 0 (of 3)." in text
    # unique is a negative control: not counted among the shared-prefix cells.
    assert "20 % lower mean than the best baseline: 1 of 2 shared-prefix cells" in text
    # Cells in the summary's order whatever order they ran in; bursts named.
    assert text.index("| doc-qa |") < text.index("| rag |") < text.index("| unique |")
    bursty = seed_verdict.markdown(runs, "python benchmarks/seed_verdict.py", 0.0, "gamma:2")
    assert "### Over seeds 0-1, gamma:2 arrivals" in bursty and "Arrivals: `gamma:2`" in bursty
    assert "its windows of 3,000 requests" in text
    windows = seed_verdict.markdown(
        runs, "python benchmarks/seed_verdict.py", 0.0, trace_requests=1000
    )
    assert "its windows of 1,000 requests" in windows


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_run_and_its_saved_figures_give_the_same_table(tmp_path: Path) -> None:
    saved, table, again = tmp_path / "v.json", tmp_path / "v.md", tmp_path / "again.md"
    done = _run(
        "--scenarios", "system-prompt", "--loads", "0.6", "--seeds", "0,1", "--processes", "1",
        "--json", str(saved), "--markdown", str(table), "--plot", str(tmp_path / "v.png"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = table.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| system-prompt | 0.6 |"))
    # Two seeds, every policy: each figure is judged over both.
    assert row.count("/2 |") == 2
    assert (tmp_path / "v.png").stat().st_size > 0
    assert "plot: `results/v.png`" in text
    replay = _run(
        "--from-json", str(saved), "--markdown", str(again), "--plot", str(tmp_path / "v.png")
    )
    assert replay.returncode == 0, replay.stderr
    assert again.read_text(encoding="utf-8") == text
    # Ours simulated again, the peers' runs taken from the saved one: the same verdict.
    ours_only = tmp_path / "ours.md"
    cell = ("--scenarios", "system-prompt", "--loads", "0.6", "--processes", "1")
    redone = _run(*cell, "--seeds", "0,1", "--peers-from", str(saved), "--markdown", str(ours_only))
    assert redone.returncode == 0, redone.stderr
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line for line in ours_only.read_text().splitlines() if line.startswith("| ")] == rows
    assert "--peers-from v.json" in ours_only.read_text()
    # A seed, or arrivals, the saved run does not have: refused by name.
    refusals = [
        (("--seeds", "0,1,2"), "run of system-prompt at 0.6, seed 2"),
        (("--seeds", "0,1", "--arrival", "gamma:2"), "its arrivals are 'poisson'"),
        (("--seeds", "0,1", "--profile", "llama3-70b-8xh100"),
         "its engine profile is 'llama3-8b-h100'"),
        (("--seeds", "0,1", "--workers", "4"), "its fleet is each scenario's own"),
    ]  # fmt: skip
    for extra, message in refusals:
        refused = _run(*cell, *extra, "--peers-from", str(saved))
        assert refused.returncode == 1, refused.stderr
        assert f"--peers-from: {saved}: " in refused.stderr and message in refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenarios", "doc-qb"], "--scenarios: unknown scenario 'doc-qb'"),
        (["--arrival", "gamma:x"], "--arrival: unknown arrival process 'gamma:x'"),
        (["--arrival", "gamma:-1"], "--arrival: arrival process 'gamma:-1': cv must be between"),
        (["--seeds", "a"], "--seeds / --loads"),
        (["--from-json", "/nonexistent/v.json"], "--from-json: no file"),
        (["--peers-from", "/nonexistent/v.json"], "--peers-from: no file"),
        (["--profile", "h200"], "--profile: unknown engine profile 'h200'"),
        (["--workers", "-1"], "--workers: 0 (each scenario's own) or more"),
    ],
)
def test_bad_arguments_are_refused_by_name(args: list[str], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_the_profile_and_the_fleet_reach_the_simulation() -> None:
    """``--profile`` and ``--workers`` run the same requests on another engine and fleet."""

    def figures(profile: str = PROFILE, workers: int = 0) -> dict[str, float]:
        task = seed_verdict.Task(
            "system-prompt", 0.6, "round_robin", 0, 3000, profile=profile, workers=workers
        )
        got: dict[str, float] = seed_verdict.run_task(task)[1]
        return got

    default = figures()
    assert figures(profile="llama3-8b-h100", workers=0) == default
    # Slower engines at the same share of their capacity: a later first token.
    assert figures(profile="llama3-70b-8xh100")["mean"] > default["mean"]
    # Round robin over 2 workers instead of the scenario's 8: the same load, other figures.
    assert figures(workers=2) != default


def test_the_plot_names_what_differs_from_the_default_runs() -> None:
    assert seed_verdict.setting(PROFILE, 0, "poisson") == ""
    assert (
        seed_verdict.setting("llama3-70b-8xh100", 8, "gamma:2")
        == "profile llama3-70b-8xh100, 8 workers per scenario, gamma:2 arrivals"
    )


def test_every_run_is_asked_for_once() -> None:
    todo = seed_verdict.tasks(seed_verdict.parse_args(["--seeds", "0,1"]))
    assert len(todo) == len(set(todo))
    assert {t.scenario for t in todo} >= {"mooncake-conversation", "templates"}
    # Every policy on every cell and seed: the verdict compares them all.
    assert {t.policy for t in todo} == set(policy_names())


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"cells": []}', '{"cells": 3, "command": 1, "elapsed_s": 0}',
     '{"cells": [], "command": "x", "elapsed_s": 0}'],
)  # fmt: skip
def test_a_file_that_is_not_a_saved_run_is_refused_by_name(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content, encoding="utf-8")
    done = _run("--from-json", str(bad))
    assert done.returncode == 1
    assert f"--from-json: {bad} is not a saved run" in done.stderr
    assert "Traceback" not in done.stderr
