"""One scan of the prompts serves the prefill bound, the TTFT floor and the capacity."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import replace

import pytest

from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.types import BlockHash, PrefixClass, RequestId, SpeedProfile
from prefixrouter.sim import report
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import (
    first_seen,
    first_seen_prefill,
    lower_bound_prefill_tokens,
    reusable_tokens,
    ttft_floor,
)
from prefixrouter.sim.runner import capacity_rps, plan
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.sim.workload import SIM_NAMESPACE, SimRequest, Workload

SPEED = get_profile("llama3-8b-h100").speed


def _old_first_seen(
    workload: Workload,
) -> Iterator[tuple[SimRequest, tuple[BlockHash, ...], int, dict[BlockHash, tuple[float, int]]]]:
    """The generator the report had before the scan was shared (the reference)."""
    hasher = BlockHasher(block_size=workload.block_size)
    bs = workload.block_size
    first: dict[BlockHash, tuple[float, int]] = {}
    for req in workload.requests:
        hashes = hasher.token_blocks(req.namespace.seed, req.tokens()).hashes
        held = 0
        for h in hashes:
            if h not in first:
                break
            held += 1
        yield req, hashes, held, first
        origin = (req.arrival, reusable_tokens(req.prompt_tokens, held, bs) // bs)
        for h in hashes[held:]:
            first[h] = origin


def _old_floor(workload: Workload, speed: SpeedProfile) -> list[float]:
    bs = workload.block_size
    out = []
    for req, hashes, held, first in _old_first_seen(workload):
        prompt, t_r = req.prompt_tokens, req.arrival
        reused = reusable_tokens(prompt, held, bs) // bs
        best = speed.prefill_time(prompt, 0)
        for depth in range(1, reused + 1):
            run = first[hashes[depth - 1]]
            if depth == reused or first[hashes[depth]] != run:
                best = min(
                    best,
                    report._reuse_floor(
                        speed.prefill_time, speed.prefill_overhead_s, prompt, t_r, run, depth, bs
                    ),
                )
        out.append(best)
    return out


def _old_prefill(workload: Workload) -> list[int]:
    bs = workload.block_size
    return [
        r.prompt_tokens - reusable_tokens(r.prompt_tokens, held, bs)
        for r, _, held, _ in _old_first_seen(workload)
    ]


@pytest.mark.parametrize("scenario", ["doc-qa", "multi-turn", "gsp", "templates", "rag"])
def test_the_shared_scan_gives_the_figures_of_the_old_one(scenario: str) -> None:
    wl = get_scenario(scenario).build(1, 60).scaled(3.0)
    seen = first_seen(wl)
    assert first_seen_prefill(wl, seen) == first_seen_prefill(wl) == _old_prefill(wl)
    assert ttft_floor(wl, SPEED, seen) == ttft_floor(wl, SPEED) == _old_floor(wl, SPEED)


def _request(i: int, arrival: float, *segments: array[int]) -> SimRequest:
    return SimRequest(
        RequestId(f"r{i}"), arrival, SIM_NAMESPACE, segments, 1, PrefixClass.SESSION, "g"
    )


def test_a_prompt_reuses_runs_of_blocks_each_brought_by_one_request() -> None:
    a, b, c = (array("I", range(k, k + 64)) for k in (0, 1000, 2000))  # 4 blocks each
    reqs = [
        _request(0, 0.0, a),
        _request(1, 0.0, a, b),  # brings b's blocks, at the time r0 brought a's
        _request(2, 0.0, array("I", range(5000, 5064))),  # unrelated
        _request(3, 0.5, a, b, c),
    ]
    wl = Workload("w", "", reqs, fixed_times=True)
    assert ttft_floor(wl, SPEED) == _old_floor(wl, SPEED)
    seen = first_seen(wl)
    assert seen.held == (0, 4, 0, 8) and seen.runs[3] == ((4, 0), (8, 1))


def test_a_scan_serves_the_rescaled_copies_and_no_other_workload() -> None:
    wl = get_scenario("gsp").build(0, 40)
    seen = first_seen(wl)
    fast = wl.scaled(5.0)
    assert ttft_floor(fast, SPEED, seen) == _old_floor(fast, SPEED)
    prof = get_profile("llama3-8b-h100")
    assert capacity_rps(wl, prof, 4, seen) == capacity_rps(wl, prof, 4)
    other = get_scenario("gsp").build(1, 39)
    with pytest.raises(ValueError, match="scan is of other requests"):
        lower_bound_prefill_tokens(other, seen)
    renamed = replace(wl, requests=[replace(r, request_id=RequestId("x")) for r in wl.requests])
    with pytest.raises(ValueError, match="scan is of other requests"):
        ttft_floor(renamed, SPEED, seen)


def test_plan_scans_once_for_a_load_and_keeps_the_scan() -> None:
    calls: list[int] = []

    def scan(workload: Workload) -> report.FirstSeen:
        calls.append(len(workload.requests))
        return first_seen(workload)

    wl = get_scenario("gsp").build(0, 30)
    prof = get_profile("llama3-8b-h100")
    p = plan(wl, prof, ["round_robin"], workers=2, load=0.5, scan=scan)
    assert calls == [30] and p.first_seen is not None
    assert lower_bound_prefill_tokens(p.workload, p.first_seen) == sum(_old_prefill(p.workload))
    assert plan(wl, prof, ["round_robin"], workers=2, rate=1.0, scan=scan).first_seen is None
    assert calls == [30]  # a rate needs no capacity, so no scan


def test_the_scan_reports_progress_per_request() -> None:
    wl = get_scenario("gsp").build(0, 7)
    done: list[int] = []
    first_seen(wl, on_progress=done.append)
    assert done == [1, 2, 3, 4, 5, 6, 7]
