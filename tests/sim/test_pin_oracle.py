"""``benchmarks/pin_oracle.py``: groups pinned longest-first, never copied, in a real simulation."""

from __future__ import annotations

import sys
from array import array
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pin_oracle  # noqa: E402

from prefixrouter.sim.cluster import ClusterConfig, Simulation  # noqa: E402
from prefixrouter.sim.profiles import get_profile  # noqa: E402
from prefixrouter.sim.runner import plan  # noqa: E402
from prefixrouter.sim.scenarios import SCENARIOS  # noqa: E402
from prefixrouter.sim.workload import SimRequest  # noqa: E402


def _requests(weights: dict[str, list[int]]) -> list[SimRequest]:
    """A real scenario's requests, regrouped and cut to the given prompt lengths."""
    base = list(SCENARIOS["multi-turn"].build(0, 40).requests)
    out = []
    for group, sizes in weights.items():
        for size in sizes:
            r = base.pop(0)
            out.append(replace(r, group=group, segments=(array("I", r.tokens()[:size]),)))
    return out


def test_groups_go_heaviest_first_to_the_least_pinned_worker() -> None:
    # Weights 10, 7, 5, 3 on two workers: 10 -> 0, 7 -> 1, 5 -> 1 (7 < 10), 3 -> 0.
    w = _requests({"c": [5], "a": [6, 4], "d": [3], "b": [7]})
    assert pin_oracle.pin_groups(w, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    # Equal weights: by name, each to the lowest index among the least pinned.
    even = _requests({"y": [4], "x": [4], "z": [4]})
    assert pin_oracle.pin_groups(even, 2) == {"x": 0, "y": 1, "z": 0}


def test_the_oracle_keeps_every_group_on_its_pinned_worker() -> None:
    workload = SCENARIOS["llmd-customers"].build(0, 120)
    p = plan(workload, get_profile("llama3-8b-h100"), [], load=0.6)
    pins = pin_oracle.pin_groups(p.workload.requests, p.workers)
    policy = pin_oracle.PinOracle({r.request_id: pins[r.group] for r in p.workload.requests})
    sim = Simulation(p.workload, ClusterConfig(p.workers, p.profile, p.kv_blocks), policy)
    run = sim.run()
    served: dict[str, set[str]] = defaultdict(set)
    for rec in run.records:
        served[rec.group].add(rec.worker)
    assert len(run.records) == len(p.workload.requests)
    assert served == {g: {sim.engines[i].worker_id} for g, i in pins.items()}
    assert len(set(pins.values())) == p.workers  # the customers spread over every worker


def test_a_pin_past_the_fleet_is_refused_not_moved() -> None:
    workload = SCENARIOS["llmd-customers"].build(0, 20)
    p = plan(workload, get_profile("llama3-8b-h100"), [], load=0.6)
    policy = pin_oracle.PinOracle({r.request_id: p.workers for r in p.workload.requests})
    with pytest.raises(ValueError, match="not among"):
        Simulation(p.workload, ClusterConfig(p.workers, p.profile, p.kv_blocks), policy).run()
