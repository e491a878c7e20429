"""Faults of gateway replicas on a real NATS JetStream, under an open-loop streamed load.

Two engines and two replicas (``--cluster``) on a real ``nats-server``,
shared by the module; the load goes round-robin over both replicas and skips
one that refuses the connection (a load balancer's retry: nothing was sent).
Lost and duplicated requests are counted from the engines' served logs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefixrouter.harness.fault_scenarios import (
    REPLICATED,
    FaultFleet,
    first_complete_after,
    start_fault_fleet,
)
from prefixrouter.harness.processes import Fleet
from tests.faults.checks import after_heal_complete, assert_sound, run, run_one


@pytest.fixture(scope="module")
def ff(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFleet]:
    with Fleet() as fleet:
        cluster = run(
            start_fault_fleet(fleet, tmp_path_factory.mktemp("replicas"), engines=2, replicas=2)
        )
        try:
            yield cluster
        finally:
            assert cluster.nats is not None
            cluster.nats.close()


def test_nats_stopped_routing_goes_on_without_a_lost_request(ff: FaultFleet) -> None:
    rep = run_one(ff, REPLICATED, "nats_stopped")
    assert_sound(rep)
    assert rep.tally.complete == rep.tally.requests
    after_heal_complete(rep)


def test_a_replica_sigkilled_the_other_serves_and_it_rejoins(ff: FaultFleet) -> None:
    rep = run_one(ff, REPLICATED, "replica_sigkill")
    assert_sound(rep, gateway_down=True)
    assert rep.tally.refused == 0  # the other replica took every new request
    assert rep.tally.cut <= 15  # only what was in flight on the killed one
    # Kill to the first request completed through the restarted replica
    # (measured 4.3-8.5 s: the restart, then /ready once it replayed the stream).
    back = first_complete_after(rep.outcomes, ff.gateways["r1"].url, rep.times.t_fault)
    assert back is not None and back < 25.0
