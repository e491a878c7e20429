"""Simulator speed: 100,000 requests on 16 workers, wall-clock seconds.

Usage::

    python benchmarks/sim_speed.py [--requests N] [--workers N] [--scenario NAME]
        [--policy NAME] [--json]

Builds the scenario (not timed separately from its generation: both are
reported), runs it through one policy at load 0.7 and prints the wall time of
generation and simulation and the simulated requests per wall second.
Target (issue 3): 100,000 requests on 16 workers in under 120 s.
"""

from __future__ import annotations

import argparse
import time

import orjson

from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.runner import plan, run_plan
from prefixrouter.sim.scenarios import get_scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--scenario", default="system-prompt")
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    workload = get_scenario(args.scenario).build(0, args.requests)
    p = plan(workload, get_profile("llama3-8b-h100"), [args.policy], workers=args.workers, load=0.7)
    t1 = time.perf_counter()
    (result,), _ = run_plan(p)
    t2 = time.perf_counter()
    out = {
        "scenario": args.scenario,
        "policy": args.policy,
        "requests": result["completed"],
        "workers": args.workers,
        "generate_s": round(t1 - t0, 2),
        "simulate_s": round(t2 - t1, 2),
        "requests_per_wall_s": round(result["completed"] / (t2 - t1), 1),
    }
    print(
        orjson.dumps(out).decode() if args.json else "\n".join(f"{k}: {v}" for k, v in out.items())
    )


if __name__ == "__main__":
    main()
