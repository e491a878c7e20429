"""What every fault test asserts on a scenario's report (lost, duplicated, tracebacks)."""

from __future__ import annotations

import asyncio
from typing import Any

from prefixrouter.harness.fault_scenarios import FaultFleet, FaultReport, Scenario, run_scenario

RUN_BOUND_S = 120.0
"""One scenario, fault and traffic included, ends well within this."""


def run(coro: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, RUN_BOUND_S)

    return asyncio.run(bounded())


def run_one(ff: FaultFleet, scenarios: dict[str, tuple[str, Scenario]], key: str) -> FaultReport:
    """Run scenario ``key`` of ``scenarios`` on ``ff`` under the load; its report."""
    _, fn = scenarios[key]
    rep: FaultReport = run(run_scenario(ff, key, fn))
    return rep


def assert_sound(rep: FaultReport, *, gateway_down: bool = False) -> None:
    """Nothing lost, nothing duplicated, no traceback, no request stuck in flight;
    every request ended complete or with a clean error (or, while a gateway was
    down, refused or cut by its death)."""
    t = rep.tally
    assert t.requests > 0
    assert t.lost == 0, t.examples
    assert t.duplicated == 0, (t.examples, rep.times)
    assert rep.times.extra["tracebacks"] == 0
    assert rep.times.extra["stuck_in_flight"] == 0
    if not gateway_down:
        assert t.refused == 0 and t.cut == 0, [o.error for o in rep.outcomes if o.error][:3]
    assert t.complete + t.clean_errors + t.refused + t.cut == t.requests


def after_heal_complete(rep: FaultReport) -> None:
    """Every request sent once the fault was healed completed."""
    after = [o for o in rep.outcomes if o.t_send >= rep.times.t_ready]
    assert after, "no traffic after the fault"
    bad = [(o.tag, o.kind, o.error) for o in after if o.kind != "complete"]
    assert not bad, bad[:3]


def touches(ff: FaultFleet, rep: FaultReport) -> list[tuple[float, str, list[str], str]]:
    """The requests sent after the fault that went to its target or were retried away
    from it, until traffic had to have left: seconds after the fault, the worker that
    served, the workers retried from, the decision's reason (a failing test prints them)."""
    t = rep.times
    decisions = {str(d["request_id"]): d for d in run(ff.decisions())}
    out = []
    for o in rep.outcomes:
        d = decisions.get(o.request_id or "")
        if d is None or not t.t_fault <= o.t_send < t.t_ready:
            continue
        tried = [str(w) for w in d.get("retried_from") or ()]
        if d.get("selected_worker") == t.target or t.target in tried:
            out.append((round(o.t_send - t.t_fault, 3), str(d.get("selected_worker")), tried,
                        str(d.get("reason", ""))[:80]))  # fmt: skip
    return sorted(out)
