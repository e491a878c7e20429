"""Clients that send no ``max_tokens``: prefix_aware's TTFT with the router's two ways of
reading such a request, against clients that send each answer's length.

Usage::

    python benchmarks/no_max_tokens.py [--mode token|text] [--seeds 0,1]

Every scenario at loads 0.6 and 0.9 (the bundled Mooncake trace on its first
seed only), three runs per cell on the same requests and fleet:

* ``exact``: clients send each answer's length (every other benchmark here);
* ``default 256``: clients send nothing and the gateway takes
  ``routing.default_max_tokens: 256`` (its default before), so the router sees
  a cap of 256 while the engine decodes the whole answer (a subclass of the
  simulation that hands the router 256; answers are not cut);
* ``none``: clients send nothing and the router sees no cap (the default now,
  ``default_max_tokens: 0``; ``prefixrouter simulate --client-max-tokens -1``):
  it expects what earlier uncapped answers decoded (``prefixrouter.core.output``).

Prints the mean and p99 TTFT per cell, the last two as changes against
``exact``, means over the seeds, and writes the figures to ``--json``. About
four minutes per seed and mode on two cores. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sim_results import PROFILE, build

from prefixrouter.core.dispatch import RoutingMode
from prefixrouter.core.policy import create_policy
from prefixrouter.sim.cluster import NO_MAX_TOKENS, ClusterConfig, Simulation
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.runner import plan
from prefixrouter.sim.scenarios import SCENARIOS
from prefixrouter.sim.workload import SimRequest
from prefixrouter.stats import nearest_rank

VARIANTS = ("exact", "default 256", "none")
TRACE = "mooncake-conversation"
Job = tuple[str, float, RoutingMode, int, str]


class DefaultCapSimulation(Simulation):
    """Clients send no ``max_tokens`` and the gateway takes 256 for it: the router sees
    256 while the engine decodes each answer to its end."""

    def _cap(self, sreq: SimRequest) -> int:
        return 256


def run_job(job: Job) -> tuple[Job, tuple[float, float]]:
    """One run of ``prefix_aware``: its mean and p99 TTFT, ms."""
    name, load, mode, seed, variant = job
    p = plan(build(name, seed, 3000), get_profile(PROFILE), ["prefix_aware"], load=load, mode=mode)
    cap = 0 if variant == "exact" else NO_MAX_TOKENS
    config = ClusterConfig(p.workers, p.profile, p.kv_blocks, mode=p.mode, client_max_tokens=cap)
    sim = DefaultCapSimulation if variant == "default 256" else Simulation
    records = sim(p.workload, config, create_policy("prefix_aware")).run().records
    ttft = sorted(r.ttft_s * 1e3 for r in records)
    return job, (statistics.fmean(ttft), nearest_rank(ttft, 0.99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("token", "text"), default="token")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in SCENARIOS if n != "templates-bad"]  # the trace included
    jobs: list[Job] = [
        (n, load, args.mode, s, v)
        for n in names
        for load in (0.6, 0.9)
        for s in (seeds[:1] if n == TRACE else seeds)
        for v in VARIANTS
    ]
    runs: dict[tuple[str, float, str], list[tuple[float, float]]] = {}
    columns = (TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("runs", total=len(jobs))
        with ProcessPoolExecutor(2) as pool:
            for (n, load, _, _, v), figures in pool.map(run_job, jobs):
                runs.setdefault((n, load, v), []).append(figures)
                progress.advance(task)
    cells = {k: [statistics.fmean(f[i] for f in v) for i in (0, 1)] for k, v in runs.items()}
    print(f"{args.mode} mode, seeds {args.seeds}: mean TTFT | p99 (default 256 and none: change)")
    for n in names:
        for load in (0.6, 0.9):
            e, d, u = (cells[(n, load, v)] for v in VARIANTS)
            pct = [f"{100 * (x[i] / e[i] - 1):+.1f}%" for i in (0, 1) for x in (d, u)]
            print(f"{n:22} {load} | {e[0]:8.1f} ms {pct[0]:>7} {pct[1]:>7} "
                  f"| {e[1]:8.0f} ms {pct[2]:>7} {pct[3]:>7}")  # fmt: skip
    if args.json is not None:
        rows = [{"scenario": n, "load": load, "variant": v, "mean_ms": m, "p99_ms": p99}
                for (n, load, v), (m, p99) in sorted(cells.items())]  # fmt: skip
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
