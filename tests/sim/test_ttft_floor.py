"""The TTFT floor: no policy's request gets its first token sooner, and its arithmetic."""

from __future__ import annotations

from array import array

import pytest

from prefixrouter.core import PrefixClass, RequestId
from prefixrouter.sim.cluster import ClusterConfig, Simulation
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import ttft_floor
from prefixrouter.sim.runner import plan
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.sim.workload import SimRequest, Workload
from tests.sim.helpers import sim_request

PROFILE = get_profile("llama3-8b-h100")
SPEED = PROFILE.speed


def _request(i: int, arrival: float, *segments: array[int]) -> SimRequest:
    return sim_request(i, arrival, *segments, output_tokens=8, prefix_class=PrefixClass.DOCUMENT)


def test_a_request_behind_a_prefix_being_computed_waits_for_it_or_computes_it() -> None:
    doc = array("I", range(8_000))
    q1, q2 = array("I", range(100_000, 100_040)), array("I", range(200_000, 200_040))
    # The second question arrives 50 ms into the document's prefill (about 330 ms).
    wl = Workload("t", "", [_request(0, 0.0, doc, q1), _request(1, 0.05, doc, q2)])
    first, second = ttft_floor(wl, SPEED)
    assert first == pytest.approx(SPEED.prefill_time(8_040, 0))
    ready = SPEED.prefill_time(8_000, 0) - SPEED.prefill_overhead_s  # the document's blocks
    wait = ready - 0.05 + SPEED.prefill_time(40, 8_000)
    assert second == pytest.approx(min(wait, SPEED.prefill_time(8_040, 0)))
    assert second == pytest.approx(wait)  # waiting beats a second prefill here
    # Long after, the document is ready: only the question's prefill is left.
    later = Workload("t", "", [_request(0, 0.0, doc, q1), _request(1, 10.0, doc, q2)])
    assert ttft_floor(later, SPEED)[1] == pytest.approx(SPEED.prefill_time(40, 8_000))


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    doc = array("I", range(1_600))  # 100 whole blocks
    wl = Workload("t", "", [_request(0, 0.0, doc), _request(1, 10.0, doc)])
    assert ttft_floor(wl, SPEED)[1] == pytest.approx(SPEED.prefill_time(16, 1_584))


@pytest.mark.parametrize("scenario", ["doc-qa", "multi-turn", "hot-prefix"])
def test_no_policy_beats_the_floor_on_any_request(scenario: str) -> None:
    policies = ["prefix_aware", "round_robin", "preble_e2"]
    p = plan(get_scenario(scenario).build(1), PROFILE, policies, load=0.9)
    ids = [r.request_id for r in p.workload.requests]
    floor = dict(zip(ids, ttft_floor(p.workload, SPEED), strict=True))
    for policy in policies:
        run = Simulation(p.workload, ClusterConfig(p.workers, PROFILE, p.kv_blocks), policy).run()
        slack = [r.ttft_s - floor[RequestId(r.request_id)] for r in run.records]
        assert len(slack) == len(floor) and min(slack) >= -1e-9, (policy, min(slack))


def test_an_idle_engine_meets_the_floor() -> None:
    """A floor, not a guess far below: with nothing else running, it is the TTFT."""
    doc = array("I", range(8_000))
    qs = [array("I", range(100_000 * i, 100_000 * i + 40)) for i in range(1, 4)]
    wl = Workload("t", "", [_request(i, 10.0 * i, doc, q) for i, q in enumerate(qs)])
    run = Simulation(wl, ClusterConfig(1, PROFILE), "prefix_aware").run()
    assert [r.ttft_s for r in run.records] == pytest.approx(ttft_floor(wl, SPEED), abs=1e-9)
