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
percent either way. Asserts nothing; about two minutes a seed for each tree on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sim_results import PROFILE, build

from prefixrouter.core.policy import create_policy
from prefixrouter.sim.cluster import ClusterConfig, Simulation
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import summarize, total_prefill_tokens
from prefixrouter.sim.runner import plan
from prefixrouter.sim.scenarios import SCENARIOS

TRACES = {"mooncake-conversation"}  # one request order whatever the seed: its first seed only

# scenario, load, mode, kv blocks (None: the scenario's default), seed, params, mooncake
# limit, the clients' max_tokens (0: each answer's length)
Job = tuple[str, float, str, int | None, int, dict[str, Any], int, int]
Cell = tuple[str, float, str, int | None]


def run_job(job: Job) -> tuple[Job, dict[str, float]]:
    """One simulated run of ``prefix_aware``."""
    name, load, mode, kv, seed, params, limit, cap = job
    p = plan(build(name, seed, limit), get_profile(PROFILE), ["prefix_aware"], load=load,
             mode=mode, kv_blocks=kv)  # fmt: skip
    # Only when set: a checkout from before the option runs the default (--against).
    capped = {"client_max_tokens": cap} if cap else {}
    config = ClusterConfig(p.workers, p.profile, p.kv_blocks, mode=p.mode, **capped)
    s = summarize(Simulation(p.workload, config, create_policy("prefix_aware", params)).run())
    return job, {"mean": s["ttft_ms"]["mean"], "p99": s["ttft_ms"]["p99"],
                 "prefill": total_prefill_tokens(s)}  # fmt: skip


def jobs(args: argparse.Namespace) -> list[Job]:
    """Every run the arguments ask for, the long scenarios first (two cores stay busy)."""
    params = json.loads(args.params)
    seeds = [int(s) for s in args.seeds.split(",")]
    kv_cells: dict[str, list[int]] = {}
    for item in filter(None, args.kv_cells.split(",")):
        scenario, _, blocks = item.partition(":")
        kv_cells.setdefault(scenario, []).append(int(blocks))
    out: list[Job] = []
    for name in args.scenarios.split(","):
        for load in (float(x) for x in args.loads.split(",")):
            for mode in args.modes.split(","):
                for kv in [None, *kv_cells.get(name, [])]:
                    for seed in seeds[:1] if name in TRACES else seeds:
                        out.append((name, load, mode, kv, seed, params, args.mooncake_limit,
                                    args.client_max_tokens))  # fmt: skip
    slow = {"llmd-customers", "mooncake-conversation"}
    return sorted(out, key=lambda j: j[0] not in slow)


def measure(args: argparse.Namespace, label: str, quiet: bool) -> dict[Cell, dict[str, float]]:
    """This tree's figures per cell, means over the seeds."""
    todo = jobs(args)
    runs: dict[Cell, list[dict[str, float]]] = {}
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet) as progress:
        task = progress.add_task(label, total=len(todo))
        with ProcessPoolExecutor(args.processes) as pool:
            for job, figures in pool.map(run_job, todo):
                runs.setdefault((job[0], job[1], job[2], job[3]), []).append(figures)
                progress.advance(task)
    return {
        cell: {k: statistics.fmean(r[k] for r in rs) for k in ("mean", "p99", "prefill")}
        for cell, rs in runs.items()
    }


def measure_with(src: str, args: argparse.Namespace) -> dict[Cell, dict[str, float]]:
    """The same cells with another checkout's code (a subprocess on its ``src``)."""
    argv = [sys.executable, os.path.abspath(__file__), "--json"]
    for flag in ("seeds", "scenarios", "loads", "modes", "kv_cells", "params",
                 "mooncake_limit", "processes", "client_max_tokens"):  # fmt: skip
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return {
        (row["scenario"], row["load"], row["mode"], row["kv"]): row["figures"]
        for row in json.loads(done.stdout)
    }


def _pct(after: float, before: float) -> float:
    return 100.0 * (after / before - 1.0) if before else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", metavar="SRC", help="another checkout's src, run side by side")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--scenarios", default=",".join([*SCENARIOS, "mooncake-conversation"]))
    ap.add_argument("--loads", default="0.6,0.9")
    ap.add_argument("--modes", default="token,text")
    ap.add_argument("--kv-cells", default="doc-qa:30000",
                    help="extra cells scenario:blocks, comma-separated ('' for none)")  # fmt: skip
    ap.add_argument("--params", default="{}", help="prefix_aware parameters, JSON, both sides")
    ap.add_argument("--mooncake-limit", type=int, default=3000)
    ap.add_argument("--client-max-tokens", type=int, default=0,
                    help="max_tokens clients send, a cap (0: each answer's length)")  # fmt: skip
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.5, help="percent that counts as moved")
    ap.add_argument("--all", action="store_true", help="print every cell, moved or not")
    ap.add_argument("--json", action="store_true", help="print this tree's figures as JSON only")
    args = ap.parse_args()
    try:
        create_policy("prefix_aware", json.loads(args.params))
    except json.JSONDecodeError as exc:
        ap.error(f"--params: not JSON ({exc.msg} at column {exc.colno})")
    except (ValueError, TypeError) as exc:
        ap.error(f"--params: {exc}")
    known = {*SCENARIOS, *TRACES}
    for name in [*args.scenarios.split(","), *(c.split(":")[0] for c in args.kv_cells.split(","))]:
        if name and name not in known:
            ap.error(f"unknown scenario {name!r}; known: {', '.join(sorted(known))}")
    if args.json:
        rows = [
            {"scenario": c[0], "load": c[1], "mode": c[2], "kv": c[3], "figures": f}
            for c, f in measure(args, "", quiet=True).items()
        ]
        print(json.dumps(rows))
        return
    after = measure(args, "this tree", quiet=False)
    before: dict[Cell, dict[str, float]] | None = None
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
    for cell in sorted(after, key=lambda c: (c[0], c[1], c[2], c[3] or 0)):
        a = after[cell]
        row = [cell[0], f"{cell[1]:.1f}", cell[2], "-" if cell[3] is None else str(cell[3])]
        if before is None:
            table.add_row(*row, f"{a['mean']:.1f}", f"{a['p99']:.1f}")
            continue
        b = before[cell]
        dm, dp = _pct(a["mean"], b["mean"]), _pct(a["p99"], b["p99"])
        up, down = dm > t or dp > t, dm < -t or dp < -t
        if up or down:
            tally["mixed" if up and down else "higher" if up else "lower"] += 1
        if up or down or args.all:
            table.add_row(
                *row,
                f"{b['mean']:.1f}", f"{a['mean']:.1f}", f"{dm:+.1f}%",
                f"{b['p99']:.1f}", f"{a['p99']:.1f}", f"{dp:+.1f}%",
                f"{_pct(a['prefill'], b['prefill']):+.1f}%",
            )  # fmt: skip
    console = Console(width=max(Console().width, 120))
    console.print(table)
    if before is not None:
        console.print(
            f"{len(after)} cells; moved by more than {t}% (mean or p99): "
            f"{tally['lower']} only lower, {tally['higher']} only higher, "
            f"{tally['mixed']} both ways."
        )


if __name__ == "__main__":
    main()
