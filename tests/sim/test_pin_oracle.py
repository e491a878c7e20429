"""``benchmarks/pin_oracle.py``: groups pinned longest-first, never copied, in a real simulation."""

from __future__ import annotations

import sys
from array import array
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pin_oracle  # noqa: E402

from prefixrouter.sim.cluster import ClusterConfig, Simulation  # noqa: E402
from prefixrouter.sim.profiles import get_profile  # noqa: E402
from prefixrouter.sim.report import lower_bound_prefill_tokens  # noqa: E402
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


def test_the_oracle_keeps_every_group_on_one_worker_and_never_beats_the_bound() -> None:
    workload = SCENARIOS["llmd-customers"].build(0, 120)
    p = plan(workload, get_profile("llama3-8b-h100"), [], load=0.6)
    pins = pin_oracle.pin_groups(p.workload.requests, p.workers)
    policy = pin_oracle.PinOracle({r.request_id: pins[r.group] for r in p.workload.requests})
    run = Simulation(p.workload, ClusterConfig(p.workers, p.profile, p.kv_blocks), policy).run()
    workers: dict[str, set[str]] = defaultdict(set)
    for rec in run.records:
        workers[rec.group].add(rec.worker)
    assert len(run.records) == len(p.workload.requests)
    assert all(len(w) == 1 for w in workers.values())
    assert {next(iter(w)) for w in workers.values()} == {f"w{i:02d}" for i in set(pins.values())}
    assert all(workers[g] == {f"w{pins[g]:02d}"} for g in workers)
    prefill = sum(r.prompt_tokens - r.cached_tokens for r in run.records)
    assert prefill >= lower_bound_prefill_tokens(p.workload)
