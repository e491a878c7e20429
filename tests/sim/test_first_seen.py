"""One scan of the prompts serves the prefill bound, the TTFT floor and the capacity."""

from __future__ import annotations

from array import array
from dataclasses import replace

import pytest

from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.types import RequestId, SpeedProfile
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
from prefixrouter.sim.workload import Workload
from tests.sim.helpers import sim_request

SPEED = get_profile("llama3-8b-h100").speed


def _oracle(workload: Workload, speed: SpeedProfile) -> tuple[list[int], list[float]]:
    """Prefill and TTFT floor by brute force, sharing none of the scan's run logic.

    A block is reusable when some earlier prompt holds it and so does every block
    before it; it was brought by the earliest request that holds it, whose origin
    is (its arrival, its own reused blocks). The floor is the least, over *every*
    reused depth (not only each run's deepest), of :func:`report._reuse_floor`.
    """
    hasher = BlockHasher(block_size=workload.block_size)
    bs = workload.block_size
    blocks = [hasher.token_blocks(r.namespace.seed, r.tokens()).hashes for r in workload.requests]
    reused: list[int] = []
    prefill: list[int] = []
    floor: list[float] = []
    for i, req in enumerate(workload.requests):
        earlier = [set(b) for b in blocks[:i]]
        held = 0
        while held < len(blocks[i]) and any(blocks[i][held] in e for e in earlier):
            held += 1
        mine = reusable_tokens(req.prompt_tokens, held, bs) // bs
        reused.append(mine)
        prefill.append(req.prompt_tokens - mine * bs)
        best = speed.prefill_time(req.prompt_tokens, 0)
        for depth in range(1, mine + 1):
            q = next(j for j, e in enumerate(earlier) if blocks[i][depth - 1] in e)
            origin = (workload.requests[q].arrival, reused[q])
            best = min(
                best,
                report._reuse_floor(
                    speed.prefill_time, speed.prefill_overhead_s, req.prompt_tokens,
                    req.arrival, origin, depth, bs,
                ),
            )  # fmt: skip
        floor.append(best)
    return prefill, floor


@pytest.mark.parametrize("scenario", ["doc-qa", "multi-turn", "gsp", "templates", "rag"])
def test_the_scan_gives_the_figures_of_a_brute_force_oracle(scenario: str) -> None:
    wl = get_scenario(scenario).build(1, 60).scaled(3.0)
    seen = first_seen(wl)
    prefill, floor = _oracle(wl, SPEED)
    assert first_seen_prefill(wl, seen) == first_seen_prefill(wl) == prefill
    assert ttft_floor(wl, SPEED, seen) == ttft_floor(wl, SPEED) == pytest.approx(floor)


def test_a_prompt_reuses_runs_of_blocks_each_brought_by_one_request() -> None:
    a, b, c = (array("I", range(k, k + 64)) for k in (0, 1000, 2000))  # 4 blocks each
    reqs = [
        sim_request(0, 0.0, a),
        sim_request(1, 0.0, a, b),  # brings b's blocks, at the time r0 brought a's
        sim_request(2, 0.0, array("I", range(5000, 5064))),  # unrelated
        sim_request(3, 0.5, a, b, c),
    ]
    wl = Workload("w", "", reqs, fixed_times=True)
    assert ttft_floor(wl, SPEED) == pytest.approx(_oracle(wl, SPEED)[1])
    seen = first_seen(wl)
    assert seen.reused == (0, 4, 0, 8) and seen.runs[3] == ((4, 0), (8, 1))


def test_a_scan_serves_the_rescaled_copies_and_no_other_workload() -> None:
    wl = get_scenario("gsp").build(0, 40)
    seen = first_seen(wl)
    fast = wl.scaled(5.0)
    assert ttft_floor(fast, SPEED, seen) == pytest.approx(_oracle(fast, SPEED)[1])
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
    assert lower_bound_prefill_tokens(p.workload, p.first_seen) == sum(
        _oracle(p.workload, SPEED)[0]
    )
    assert plan(wl, prof, ["round_robin"], workers=2, rate=1.0, scan=scan).first_seen is None
    assert calls == [30]  # a rate needs no capacity, so no scan


def test_the_scan_reports_progress_per_request() -> None:
    wl = get_scenario("gsp").build(0, 7)
    done: list[int] = []
    first_seen(wl, on_progress=done.append)
    assert done == [1, 2, 3, 4, 5, 6, 7]
