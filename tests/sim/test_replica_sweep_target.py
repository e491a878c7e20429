"""``benchmarks/replica_sweep.py``: the replicas target judged over seeds, not on one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import replica_sweep as sweep  # noqa: E402


def _run(
    routers: int, mean: float, seed: int, sync: bool = True, lag: float = 10.0
) -> dict[str, Any]:
    return {
        "routers": routers,
        "sync": sync,
        "lag_ms": 0.0 if routers == 1 else lag,
        "seed": seed,
        "ttft_ms": {"mean": mean},
        "cached_share": 0.9,
    }


def test_the_change_is_pooled_over_the_seeds_with_both_runs() -> None:
    runs = [
        _run(1, 100.0, 0), _run(16, 106.0, 0),  # +6 %
        _run(1, 200.0, 1), _run(16, 204.0, 1),  # +2 %
        _run(1, 100.0, 2),  # no 16-replica run: not paired
        _run(16, 500.0, 3, lag=50.0),  # another lag: not the target's
        _run(16, 900.0, 1, sync=False, lag=0.0),  # no sync: not the target's
    ]  # fmt: skip
    seeds = sweep.over_seeds(runs)
    assert seeds is not None and seeds.seeds == 2
    assert seeds.pooled_pct == pytest.approx((310 / 300 - 1) * 100)
    assert seeds.low_pct == pytest.approx(2.0) and seeds.high_pct == pytest.approx(6.0)
    assert seeds.se_pct == pytest.approx(2.0)
    assert sweep.over_seeds([_run(1, 100.0, 0)]) is None


def test_the_target_judges_the_pooled_change_and_shows_the_seed_s_own() -> None:
    # Seed 0 misses (+6 %); over the seeds the change is +3.3 %: met.
    rows = [_run(1, 100.0, 0), _run(16, 106.0, 0)]
    runs = [*rows, _run(1, 200.0, 1), _run(16, 202.0, 1)]
    lines, met = sweep.target_lines({"system-prompt": rows}, {"system-prompt": runs})
    assert met
    row = lines[-1]
    assert "+6.0 %" in row and "+2.7 % over 2 (+1.0 to +6.0, ± 2.5)" in row and "| yes |" in row
    # Without the seeds' runs (a report from before them), the seed alone decides.
    lines, met = sweep.target_lines({"system-prompt": rows})
    assert not met and "| n/a | **no** |" in lines[-1]


def test_the_target_runs_are_made_at_every_other_seed() -> None:
    jobs = sweep.jobs(["system-prompt"], [1, 16], [10.0], seed=0, target_seeds=3)
    extra = {j for j in jobs if j[4] != 0}
    assert extra == {("system-prompt", 1, True, 0.0, s) for s in (1, 2)} | {
        ("system-prompt", 16, True, 10.0, s) for s in (1, 2)
    }
    assert len([j for j in jobs if j[4] == 0]) == 3  # 1 router, 16 at 10 ms, 16 without sync
