"""``prefix_aware`` on every scenario, this tree against another checkout, side by side.

Issue 15 keeps a routing change only if the full table does not get worse
elsewhere. This runs the simulator's ``prefix_aware`` on every scenario (the
bundled Mooncake trace's first ``--mooncake-limit`` requests included) at
each load, mode and seed, on the same requests and fleet
(:func:`prefixrouter.sim.runner.plan`), with this tree's code and, with
``--against OTHER/src``, with another checkout's (a subprocess with that
``PYTHONPATH``, as ``benchmarks/index_gc.py`` does), and prints, per cell,
the mean over the seeds of the mean TTFT, the p99 and the prefill tokens,
before -> after. Cells with more KV than the scenario's default (goal 3 of
the issue) are added with ``--kv-cells``::

    python benchmarks/policy_diff.py --against OLD/src --seeds 0,1
    python benchmarks/policy_diff.py --against OLD/src --scenarios doc-qa,multi-turn \\
        --params '{"proactive_copy": true}'

Without ``--against`` it prints this tree's figures alone. The summary
counts the cells whose mean or p99 moved by more than ``--threshold``
percent either way.

**Seeds are paired.** Both trees run the same seeds, so each seed gives a
difference of one cell's mean TTFT, after minus before, on the same
requests. With two seeds or more the table prints that difference's
standard error beside the change (``±``, in percent of the before mean),
and the summary counts the moves larger than two standard errors: a
routing rule's effect on a chaotic cell (a placement that tips one way or
the other) moves single seeds by tens of percent both ways, so a change
whose mean gain is within two standard errors is not yet a gain. The
standard error is over seeds only.

**The bundled trace's seeds are windows.** A trace has one request order
whatever the seed, and its cell at load 0.9 is chaotic: the same code's mean
TTFT on its first 3,000 requests is 926, 985 and 1,734 ms at loads 0.88, 0.9
and 0.92, so a rule change moves that one cell by tens of percent either way
(-21 to +45 % over nearby loads, for a change neutral on average). Seed
``k`` of the trace is therefore its ``k``-th window of ``--mooncake-limit``
requests, times counted from the window's first (seed 0: the requests
``sim_results.py`` runs, as before); seeds past the trace's last whole
window are left out of its cells.

**Shaped cells.** ``--scale``, ``--workers`` and ``--requests`` run every
cell on a cut workload, as ``prefixrouter simulate`` does; the live
bench's doc-qa fleet, for example::

    python benchmarks/policy_diff.py --against OLD/src --scenarios doc-qa --loads 0.8 \\
        --scale 0.5 --workers 4 --requests 160 --kv-cells '' --seeds 0,1,2,3,4,5,6,7

Asserts nothing; about two minutes a seed for each tree on two cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sim_results import MODES, MOONCAKE_LIMIT, PROFILE, build

from prefixrouter.core.policy import create_policy
from prefixrouter.sim.cluster import ClusterConfig, Simulation
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import summarize, total_prefill_tokens
from prefixrouter.sim.runner import plan
from prefixrouter.sim.scenarios import SCENARIOS
from prefixrouter.sim.traces import bundled_mooncake_path, count_requests, load_mooncake
from prefixrouter.sim.workload import Workload, arrival_cv

if TYPE_CHECKING:  # an annotation only: --against runs checkouts that may lack it
    from prefixrouter.core.dispatch import RoutingMode

TRACES = {"mooncake-conversation"}  # one request order whatever the seed: seeds are windows

# scenario, load, mode, KV blocks (None: default)
Cell = tuple[str, float, "RoutingMode", int | None]
Figures = dict[str, float]  # mean and p99 TTFT (ms), prefill tokens


@dataclass(frozen=True)
class Shape:
    """What every cell's workload and fleet are cut to (``--scale``, ``--workers``,
    ``--requests``; 1, 0 and 0 keep the scenario's own), and the scenarios' arrival
    process (``--arrival``: poisson, gamma or gamma:CV; a trace keeps its own times)."""

    scale: float = 1.0
    workers: int = 0
    requests: int = 0
    arrival: str = "poisson"


@dataclass(frozen=True)
class Job:
    """One simulated run: a cell at one seed, with the ``prefix_aware`` parameters, the
    bundled trace's request limit and the clients' ``max_tokens`` (0: each answer's length)."""

    cell: Cell
    seed: int
    params: dict[str, Any]
    mooncake_limit: int
    client_max_tokens: int
    shape: Shape


@functools.cache
def trace_windows(limit: int) -> int:
    """How many whole windows of ``limit`` requests the bundled trace holds."""
    return count_requests(bundled_mooncake_path()) // limit


def trace_window(name: str, seed: int, limit: int) -> Workload:
    """Window ``seed`` of the bundled trace: ``limit`` requests from the ``seed *
    limit``-th, their times counted from the first of them. Window 0 is ``build``'s
    workload, request ids included, so its cell is the table's."""
    if seed == 0:
        return build(name, seed, limit)
    return load_mooncake(
        bundled_mooncake_path(), start=seed * limit, limit=limit, seed=seed, name=f"{name}-w{seed}"
    )


def workload(job: Job) -> Workload:
    """The job's requests: the scenario at its seed (a trace's window), cut to the job's shape."""
    name, shape = job.cell[0], job.shape
    if name in TRACES:
        w = trace_window(name, job.seed, shape.requests or job.mooncake_limit)
    else:
        w = SCENARIOS[name].build(job.seed, shape.requests or None, shape.arrival)
    return w.lengths_scaled(shape.scale)


def run_job(job: Job) -> tuple[Job, Figures]:
    """One simulated run of ``prefix_aware``."""
    _, load, mode, kv = job.cell
    params, cap = job.params, job.client_max_tokens
    p = plan(workload(job), get_profile(PROFILE), ["prefix_aware"], load=load, mode=mode,
             kv_blocks=kv, workers=job.shape.workers or None)  # fmt: skip
    # Only when set: a checkout from before the option runs the default (--against).
    capped: dict[str, Any] = {"client_max_tokens": cap} if cap else {}
    config = ClusterConfig(p.workers, p.profile, p.kv_blocks, mode=p.mode, **capped)
    s = summarize(Simulation(p.workload, config, create_policy("prefix_aware", params)).run())
    return job, {"mean": s["ttft_ms"]["mean"], "p99": s["ttft_ms"]["p99"],
                 "prefill": total_prefill_tokens(s)}  # fmt: skip


def jobs(args: argparse.Namespace) -> list[Job]:
    """Every run the arguments ask for, the long scenarios first (two cores stay busy)."""
    params = json.loads(args.params)
    seeds = [int(s) for s in args.seeds.split(",")]
    shape = Shape(args.scale, args.workers, args.requests, args.arrival)
    kv_cells: dict[str, list[int]] = {}
    for item in filter(None, args.kv_cells.split(",")):
        scenario, _, blocks = item.partition(":")
        kv_cells.setdefault(scenario, []).append(int(blocks))
    names = list(dict.fromkeys(args.scenarios.split(",")))  # each once, however often named
    trace_seeds = seeds
    if TRACES.intersection(names):
        windows = trace_windows(shape.requests or args.mooncake_limit)
        trace_seeds = [s for s in seeds if s < windows]
    out: list[Job] = []
    for name in names:
        for load in (float(x) for x in args.loads.split(",")):
            for mode in (cast("RoutingMode", m) for m in args.modes.split(",")):
                for kv in [None, *kv_cells.get(name, [])]:
                    for seed in trace_seeds if name in TRACES else seeds:
                        out.append(Job((name, load, mode, kv), seed, params, args.mooncake_limit,
                                       args.client_max_tokens, shape))  # fmt: skip
    slow = {"llmd-customers", "mooncake-conversation"}
    return sorted(out, key=lambda j: j.cell[0] not in slow)


PerSeed = dict[Cell, dict[int, Figures]]


def measure(args: argparse.Namespace, label: str, quiet: bool) -> PerSeed:
    """This tree's figures per cell and seed."""
    todo = jobs(args)
    runs: PerSeed = {}
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet) as progress:
        task = progress.add_task(label, total=len(todo))
        with ProcessPoolExecutor(args.processes) as pool:
            for job, figures in pool.map(run_job, todo):
                runs.setdefault(job.cell, {})[job.seed] = figures
                progress.advance(task)
    return runs


def measure_with(src: str, args: argparse.Namespace) -> PerSeed:
    """The same cells with another checkout's code (a subprocess on its ``src``)."""
    argv = [sys.executable, os.path.abspath(__file__), "--json"]
    for flag in ("seeds", "scenarios", "loads", "modes", "kv_cells", "params",
                 "mooncake_limit", "processes", "client_max_tokens", "scale", "workers",
                 "requests"):  # fmt: skip
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.arrival != "poisson":  # only when asked: a checkout from before the option
        argv += ["--arrival", args.arrival]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return {
        (row["scenario"], row["load"], row["mode"], row["kv"]): {
            int(seed): figures for seed, figures in row["seeds"].items()
        }
        for row in json.loads(done.stdout)
    }


def seed_mean(runs: dict[int, Figures], key: str) -> float:
    """One figure's mean over a cell's seeds."""
    return statistics.fmean(f[key] for f in runs.values())


@dataclass(frozen=True)
class Change:
    """One figure of one cell, before and after, over the seeds both trees ran.

    ``se_pct`` is the standard error of the per-seed differences (after minus
    before, the same requests), in percent of the before mean; ``None`` with
    fewer than two seeds.
    """

    before: float
    after: float
    se_pct: float | None

    @property
    def pct(self) -> float:
        return 100.0 * (self.after / self.before - 1.0) if self.before else 0.0

    @property
    def clear(self) -> bool:
        """Moved by more than two standard errors (``False`` without one)."""
        return self.se_pct is not None and abs(self.pct) > 2.0 * self.se_pct

    def label(self) -> str:
        text = f"{self.pct:+.1f}%"
        return text if self.se_pct is None else f"{text} ±{self.se_pct:.1f}"


def change(before: dict[int, Figures], after: dict[int, Figures], key: str) -> Change:
    """``key``'s change over the seeds both sides ran (paired by seed)."""
    seeds = sorted(before.keys() & after.keys())
    b = statistics.fmean(before[s][key] for s in seeds)
    a = statistics.fmean(after[s][key] for s in seeds)
    se = None
    if len(seeds) > 1 and b:
        diffs = [after[s][key] - before[s][key] for s in seeds]
        se = 100.0 * statistics.stdev(diffs) / math.sqrt(len(seeds)) / b
    return Change(b, a, se)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (a bad argument exits with its name, status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", metavar="SRC", help="another checkout's src, run side by side")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    # The registry holds the bundled trace's scenario already (TRACES names it).
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--loads", default="0.6,0.9")
    ap.add_argument("--modes", default="token,text")
    ap.add_argument("--kv-cells", default="doc-qa:30000",
                    help="extra cells scenario:blocks, comma-separated ('' for none)")  # fmt: skip
    ap.add_argument("--params", default="{}", help="prefix_aware parameters, JSON, both sides")
    ap.add_argument("--mooncake-limit", type=int, default=MOONCAKE_LIMIT)
    ap.add_argument("--client-max-tokens", type=int, default=0,
                    help="max_tokens clients send, a cap (0: each answer's length)")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0,
                    help="token lengths and the scenario's KV size times this (0, 1]")  # fmt: skip
    ap.add_argument("--workers", type=int, default=0, help="workers (0: the scenario's own)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per cell (0: the scenario's own; the trace's: "
                         "--mooncake-limit)")  # fmt: skip
    ap.add_argument("--arrival", default="poisson",
                    help="the scenarios' arrival process: poisson, gamma or gamma:CV")  # fmt: skip
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.5, help="percent that counts as moved")
    ap.add_argument("--all", action="store_true", help="print every cell, moved or not")
    ap.add_argument("--json", action="store_true", help="print this tree's figures as JSON only")
    args = ap.parse_args(argv)
    try:
        create_policy("prefix_aware", json.loads(args.params))
    except json.JSONDecodeError as exc:
        ap.error(f"--params: not JSON ({exc.msg} at column {exc.colno})")
    except (ValueError, TypeError) as exc:
        ap.error(f"--params: {exc}")
    for mode in args.modes.split(","):
        if mode not in MODES:
            ap.error(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
    if not 0 < args.scale <= 1:
        ap.error(f"--scale: must be in (0, 1], got {args.scale:g}")
    try:
        arrival_cv(args.arrival)
    except ValueError as exc:
        ap.error(f"--arrival: {exc}")
    if args.workers < 0 or args.requests < 0:
        ap.error("--workers and --requests: 0 (the scenario's own) or more")
    known = {*SCENARIOS, *TRACES}
    for name in [*args.scenarios.split(","), *(c.split(":")[0] for c in args.kv_cells.split(","))]:
        if name and name not in known:
            ap.error(f"unknown scenario {name!r}; known: {', '.join(sorted(known))}")
    return args


def main() -> None:
    args = parse_args()
    if args.json:
        rows = [
            {"scenario": c[0], "load": c[1], "mode": c[2], "kv": c[3], "seeds": f}
            for c, f in measure(args, "", quiet=True).items()
        ]
        print(json.dumps(rows))
        return
    after = measure(args, "this tree", quiet=False)
    before: PerSeed | None = None
    if args.against:
        Console(stderr=True).print(f"running the same cells with {args.against} ...")
        before = measure_with(args.against, args)
    table = Table(title="prefix_aware" + (" (before -> after)" if before else ""))
    heads = ["scenario", "load", "mode", "KV"]
    heads += ["mean ms", "p99 ms"] if before is None else [
        "mean before", "after", "Δ", "p99 before", "after", "Δ", "prefill Δ"
    ]  # fmt: skip
    for col in heads:
        table.add_column(col, justify="left" if col in ("scenario", "mode") else "right")
    t = args.threshold
    tally = {"lower": 0, "higher": 0, "mixed": 0}
    clear = {"lower": 0, "higher": 0}
    for cell in sorted(after, key=lambda c: (c[0], c[1], c[2], c[3] or 0)):
        a = after[cell]
        row = [cell[0], f"{cell[1]:.1f}", cell[2], "-" if cell[3] is None else str(cell[3])]
        if before is None:
            table.add_row(*row, f"{seed_mean(a, 'mean'):.1f}", f"{seed_mean(a, 'p99'):.1f}")
            continue
        mean, p99, prefill = (change(before[cell], a, k) for k in ("mean", "p99", "prefill"))
        up = mean.pct > t or p99.pct > t
        down = mean.pct < -t or p99.pct < -t
        if up or down:
            tally["mixed" if up and down else "higher" if up else "lower"] += 1
        for c in (mean, p99):
            if c.clear:
                clear["higher" if c.pct > 0 else "lower"] += 1
        if up or down or args.all:
            table.add_row(
                *row,
                f"{mean.before:.1f}", f"{mean.after:.1f}", mean.label(),
                f"{p99.before:.1f}", f"{p99.after:.1f}", p99.label(),
                f"{prefill.pct:+.1f}%",
            )  # fmt: skip
    console = Console(width=max(Console().width, 120))
    console.print(table)
    if before is not None:
        console.print(
            f"{len(after)} cells; moved by more than {t}% (mean or p99): "
            f"{tally['lower']} only lower, {tally['higher']} only higher, "
            f"{tally['mixed']} both ways. Beyond two standard errors of the seeds' "
            f"differences: {clear['lower']} figures lower, {clear['higher']} higher."
        )


if __name__ == "__main__":
    main()
