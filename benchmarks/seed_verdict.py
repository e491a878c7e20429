"""Ours against the best baseline over several seeds: the summary's verdict, with its spread.

``RESULTS.md``'s summary compares prefixrouter with the best of the peers'
policies on one seed. A p99 of 800 requests is the ninth slowest (nearest
rank 792), and on the scenarios whose tail is the first cold prefill of
each prefix (six forms of `templates`, one prompt of `system-prompt`) the
ninth slowest can be a warm request at two thirds of the eighth's time:
one seed's p99 verdict can turn on one request (on `templates` 0.6, seed
0, llm-d's weighted scorers' p99 is 49 ms at rank 792 and the next rank
75 ms). This runs every
policy on every scenario (the bundled Mooncake trace's first windows
included) at each load and seed, token mode, and judges each cell over the
seeds::

    python benchmarks/seed_verdict.py --seeds 0,1,2,3 \\
        --json benchmarks/results/seed_verdict.json \\
        --markdown benchmarks/seed_verdict_results.md \\
        --plot benchmarks/results/seed_verdict.png

Per cell and figure (mean TTFT, p99 TTFT): each policy's mean over the
seeds of that figure; the *best baseline* is the peer policy whose
seed-mean is lowest; the change is ours against it in percent, with the
standard error of the per-seed differences (paired: the same requests,
``policy_diff.change``); *ahead* or *behind* when the change is beyond two
standard errors, else *level*; and on how many seeds ours was the lower.
Seeds of the trace are its windows of ``--mooncake-limit`` requests, as in
``policy_diff.py`` (one owner: its ``workload``). ``--from-json`` rewrites
the markdown and plot from a saved run without simulating. After a change
to ``prefix_aware`` alone, ``--peers-from`` takes the peers' runs from a
saved run (same arrivals, trace windows, cells and seeds; refused by name
otherwise) and simulates only ours: a twelfth of the time. Use it only when
nothing else the peers run on changed (the simulator, the profiles, the
workloads): ``git log`` on those since the saved run says so.

``--profile`` and ``--workers`` run the same verdict on another engine
(``prefixrouter profiles``) or fleet size, the held-out checks: the
policy's parameters were tuned on the default profile and each scenario's
own fleet, so a rule that only fits those shows here
(``seed_verdict_heldout_results.md``).

Deterministic (the simulator is); about 30 minutes for four seeds on two
cores with ``--processes 2``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from policy_diff import TRACES, Change, Job, Shape, change, trace_windows, workload
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sim_results import MOONCAKE_LIMIT, PROFILE

from prefixrouter.core.policy import policy_names
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.runner import plan, run_plan
from prefixrouter.sim.scenarios import SCENARIOS
from prefixrouter.sim.workload import arrival_cv

OURS = "prefix_aware"
FIGURES = ("mean", "p99")
NEGATIVE_CONTROLS = frozenset({"unique", "templates-bad"})
"""Scenarios with no prefix to reuse: not counted among the shared-prefix cells (issue 15)."""

# scenario, load -> policy -> seed -> {"mean": ms, "p99": ms}
Runs = dict[tuple[str, float], dict[str, dict[int, dict[str, float]]]]


@dataclass(frozen=True)
class Task:
    """One simulated run: a policy on a scenario at a load and seed (token mode)."""

    scenario: str
    load: float
    policy: str
    seed: int
    mooncake_limit: int
    arrival: str = "poisson"
    profile: str = PROFILE
    workers: int = 0  # 0: the scenario's own fleet


def run_task(task: Task) -> tuple[Task, dict[str, float]]:
    """One policy's mean and p99 TTFT on one cell and seed, as ``sim_results.py`` runs it."""
    job = Job((task.scenario, task.load, "token", None), task.seed, {}, task.mooncake_limit, 0,
              Shape(arrival=task.arrival))  # fmt: skip
    p = plan(workload(job), get_profile(task.profile), [task.policy], load=task.load,
             mode="token", workers=task.workers or None)  # fmt: skip
    results, _ = run_plan(p)
    ttft = results[0]["ttft_ms"]
    return task, {"mean": float(ttft["mean"]), "p99": float(ttft["p99"])}


def tasks(args: argparse.Namespace) -> list[Task]:
    """Every run asked for, the long scenarios first (two cores stay busy to the end)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    names = list(dict.fromkeys(args.scenarios.split(",")))  # each once, however often named
    trace_seeds = seeds
    if TRACES.intersection(names):
        trace_seeds = [s for s in seeds if s < trace_windows(args.mooncake_limit)]
    fleet = (args.profile, args.workers)
    out = [
        Task(name, float(load), policy, seed, args.mooncake_limit, args.arrival, *fleet)
        for name in names
        for load in args.loads.split(",")
        for policy in policy_names()
        for seed in (trace_seeds if name in TRACES else seeds)
        if args.peers_from is None or policy == OURS
    ]
    slow = {"llmd-customers", "mooncake-conversation"}
    return sorted(out, key=lambda t: t.scenario not in slow)


def peer_runs(saved: dict[str, Any], args: argparse.Namespace) -> Runs:
    """The peers' runs of every cell and seed ``args`` asks for, from a saved run.

    Raises ValueError naming what does not match: the arrivals, the trace's
    windows, or a cell, policy or seed the saved run lacks.
    """
    if saved.get("arrival", "poisson") != args.arrival:
        raise ValueError(
            f"its arrivals are {saved.get('arrival', 'poisson')!r}, not {args.arrival!r}"
        )
    if int(saved.get("mooncake_limit", MOONCAKE_LIMIT)) != args.mooncake_limit:
        raise ValueError(f"its trace windows are {saved.get('mooncake_limit')} requests")
    if saved.get("profile", PROFILE) != args.profile:
        raise ValueError(f"its engine profile is {saved.get('profile', PROFILE)!r}")
    workers = int(saved.get("workers", 0))
    if workers != args.workers:
        fleet = f"{workers} workers" if workers else "each scenario's own"
        raise ValueError(f"its fleet is {fleet}")
    runs: Runs = {}
    have = _decode(saved["cells"])
    peers = [p for p in policy_names() if p != OURS]
    for task in tasks(args):
        cell = (task.scenario, task.load)
        got = have.get(cell, {})
        for policy in peers:
            figures = got.get(policy, {}).get(task.seed)
            if figures is None:
                what = f"{task.scenario} at {task.load}, seed {task.seed}"
                raise ValueError(f"no {policy} run of {what}")
            runs.setdefault(cell, {}).setdefault(policy, {})[task.seed] = figures
    return runs


def measure(args: argparse.Namespace, peers: Runs | None = None) -> Runs:
    """Every task's figures, in a process pool, with a progress bar (``peers``: the
    peer policies' runs, already known; only ours is simulated)."""
    todo = tasks(args)
    runs: Runs = {cell: dict(by) for cell, by in (peers or {}).items()}
    columns = (TextColumn("policy x scenario x load x seed"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True)) as progress:
        bar = progress.add_task("runs", total=len(todo))
        with ProcessPoolExecutor(args.processes) as pool:
            for task, figures in pool.map(run_task, todo):
                cell = runs.setdefault((task.scenario, task.load), {})
                cell.setdefault(task.policy, {})[task.seed] = figures
                progress.advance(bar)
    return runs


@dataclass(frozen=True)
class Verdict:
    """One figure of one cell: ours against the baseline whose seed-mean is lowest."""

    baseline: str
    change: Change  # before: the baseline, after: ours
    seeds_lower: int
    seeds: int

    @property
    def word(self) -> str:
        if not self.change.clear:
            return "level"
        return "ahead" if self.change.pct < 0 else "behind"


def judge(cell: dict[str, dict[int, dict[str, float]]], figure: str) -> Verdict:
    """``figure``'s verdict for one cell (every policy ran the same seeds)."""
    ours = cell[OURS]

    def seed_mean(policy: str) -> float:
        return statistics.fmean(f[figure] for f in cell[policy].values())

    baseline = min((p for p in cell if p != OURS), key=seed_mean)
    theirs = cell[baseline]
    seeds = sorted(ours.keys() & theirs.keys())
    lower = sum(ours[s][figure] < theirs[s][figure] for s in seeds)
    return Verdict(baseline, change(theirs, ours, figure), lower, len(seeds))


def ordered(runs: Runs) -> list[tuple[str, float]]:
    """The cells in the summary table's order: scenarios as registered, then load."""
    rank = {name: i for i, name in enumerate(SCENARIOS)}
    return sorted(runs, key=lambda cell: (rank.get(cell[0], len(rank)), cell[0], cell[1]))


def _ms(v: float) -> str:
    return f"{v / 1e3:.2f} s" if v >= 10_000 else f"{v:.0f} ms"


def markdown(
    runs: Runs,
    command: str,
    elapsed_s: float,
    arrival: str = "poisson",
    plot_name: str = "",
    trace_requests: int = MOONCAKE_LIMIT,
) -> str:
    """The verdict table, one row per cell, and the counts under it."""
    seeds = sorted({s for cell in runs.values() for s in cell[OURS]})
    minutes = round(elapsed_s / 60)
    spent = f"{minutes} minute{'' if minutes == 1 else 's'} on the 2-core development machine"
    took = f" ({spent})" if elapsed_s else ""
    if took and "--peers-from" in command:
        peers = "the peers' runs taken from a saved run of the same cells and seeds"
        took = f" (ours: {spent}; {peers})"
    arrivals = "" if arrival == "poisson" else f", {arrival} arrivals"
    plotted = f"; plot: `results/{plot_name}`" if plot_name else ""
    lines = [
        f"### Over seeds {seeds[0]}-{seeds[-1]}{arrivals}: the verdict with its spread",
        "",
        f"Produced by `{command}`{took}{plotted}.",
        "Token mode, every policy, the same requests per",
        f"seed (the trace's seeds are its windows of {trace_requests:,} requests). Each figure is",
        "the mean over the seeds of that figure; the best baseline is the peer policy",
        "whose seed-mean is lowest; Δ is ours against it, ± the standard error of the",
        "per-seed differences; **ahead** / **behind** beyond two standard errors,",
        "else level; *seeds* counts those on which ours was the lower.",
        *(
            []
            if arrival == "poisson"
            else [
                f"Arrivals: `{arrival}` (gamma gaps, `prefixrouter.sim.workload`: bursts and",
                "lulls at the same mean rate); the trace keeps its own times.",
            ]
        ),
        "",
        "| scenario | load | ours mean | best baseline mean | Δ | verdict | seeds | ours p99 | "
        "best baseline p99 | Δ | verdict | seeds |",
        "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    tally: dict[str, dict[str, int]] = {f: {"ahead": 0, "level": 0, "behind": 0} for f in FIGURES}
    twenty = 0
    shared = 0
    for name, load in ordered(runs):
        cell = runs[(name, load)]
        row = [name, f"{load:.1f}"]
        for figure in FIGURES:
            v = judge(cell, figure)
            tally[figure][v.word] += 1
            word = v.word if v.word == "level" else f"**{v.word}**"
            row += [_ms(v.change.after), f"{_ms(v.change.before)} ({v.baseline})",
                    v.change.label(), word, f"{v.seeds_lower}/{v.seeds}"]  # fmt: skip
            if figure == "mean" and name not in NEGATIVE_CONTROLS:
                shared += 1
                twenty += v.change.pct <= -20.0
        lines.append("| " + " | ".join(row) + " |")
    lines += [""]
    for figure in FIGURES:
        t = tally[figure]
        lines.append(
            f"- {figure}: ahead on {t['ahead']} cells, level on {t['level']}, "
            f"behind on {t['behind']} (of {len(runs)})."
        )
    lines.append(
        f"- At least 20 % lower mean than the best baseline: {twenty} of {shared} "
        "shared-prefix cells."
    )
    return "\n".join(lines) + "\n"


def plot(runs: Runs, path: Path, setting: str = "") -> None:
    """Ours against the best baseline per cell: mean and p99 change, two standard errors
    (``setting``: what differs from the default runs, in the title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = ordered(runs)
    labels = [f"{name} {load:.1f}" for name, load in cells]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(cells) + 1.5), sharey=True)
    for ax, figure in zip(axes, FIGURES, strict=True):
        verdicts = [judge(runs[c], figure) for c in cells]
        pct = [v.change.pct for v in verdicts]
        err = [2.0 * (v.change.se_pct or 0.0) for v in verdicts]
        colors = ["tab:green" if v.word == "ahead" else "tab:red" if v.word == "behind"
                  else "tab:gray" for v in verdicts]  # fmt: skip
        ax.barh(range(len(cells)), pct, xerr=err, color=colors, capsize=2)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel(f"{figure} TTFT, ours vs best baseline (%; lower is better)")
        ax.set_yticks(range(len(cells)), labels)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    title = "prefix_aware against the best peer policy per cell, ± two standard errors"
    fig.suptitle(f"{title}\n({setting})" if setting else title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setting(profile: str, workers: int, arrival: str) -> str:
    """What a run's engines, fleet and arrivals are, where they are not the default ('')."""
    parts = [f"profile {profile}"] if profile != PROFILE else []
    parts += [f"{workers} workers per scenario"] if workers else []
    parts += [f"{arrival} arrivals"] if arrival != "poisson" else []
    return ", ".join(parts)


def _encode(runs: Runs) -> list[dict[str, Any]]:
    return [{"scenario": n, "load": x, "policies": {p: {str(s): f for s, f in by.items()}
             for p, by in cell.items()}} for (n, x), cell in runs.items()]  # fmt: skip


def _decode(rows: list[dict[str, Any]]) -> Runs:
    return {
        (row["scenario"], float(row["load"])): {
            p: {int(s): f for s, f in by.items()} for p, by in row["policies"].items()
        }
        for row in rows
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (a bad argument exits naming it, status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))  # the trace's included
    ap.add_argument("--loads", default="0.6,0.9")
    ap.add_argument("--mooncake-limit", type=int, default=MOONCAKE_LIMIT)
    ap.add_argument("--arrival", default="poisson",
                    help="the scenarios' arrival process: poisson, gamma or gamma:CV "
                         "(the trace keeps its own times)")  # fmt: skip
    ap.add_argument(
        "--profile",
        default=PROFILE,
        help="engine profile (`prefixrouter profiles`): the fleet's speed and KV",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=0,
        help="every scenario's fleet size (0: each scenario's own)",
    )
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    ap.add_argument("--markdown", type=Path, help="write the verdict table here")
    ap.add_argument("--plot", type=Path, help="write the verdict plot (PNG) here")
    ap.add_argument("--from-json", type=Path, help="judge a saved run (no simulation)")
    ap.add_argument("--peers-from", type=Path,
                    help="the peers' runs from this saved run; simulate only ours")  # fmt: skip
    args = ap.parse_args(argv)
    known = {*SCENARIOS, *TRACES}
    for name in args.scenarios.split(","):
        if name not in known:
            ap.error(f"--scenarios: unknown scenario {name!r}; known: {', '.join(sorted(known))}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        [float(x) for x in args.loads.split(",")]
    except ValueError as exc:
        ap.error(f"--seeds / --loads: {exc}")
    try:
        arrival_cv(args.arrival)
    except ValueError as exc:
        ap.error(f"--arrival: {exc}")
    if not seeds or min(seeds) < 0:
        ap.error("--seeds: one or more seeds, 0 or more")
    try:
        get_profile(args.profile)
    except KeyError as exc:
        ap.error(f"--profile: {exc.args[0] if exc.args else args.profile}")
    if args.workers < 0:
        ap.error("--workers: 0 (each scenario's own) or more")
    for flag, path in (("--from-json", args.from_json), ("--peers-from", args.peers_from)):
        if path is not None and not path.is_file():
            ap.error(f"{flag}: no file {path}")
    return args


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    if args.from_json is not None:
        try:
            saved = orjson.loads(args.from_json.read_bytes())
            runs, command, elapsed = _decode(saved["cells"]), saved["command"], saved["elapsed_s"]
            arrival = str(saved.get("arrival", "poisson"))
            trace_requests = int(saved.get("mooncake_limit", MOONCAKE_LIMIT))
            profile, workers = str(saved.get("profile", PROFILE)), int(saved.get("workers", 0))
            if not runs or any(OURS not in cell for cell in runs.values()):
                raise ValueError(f"no cells with {OURS}")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"{args.from_json} is not a saved run ({exc!r})"
            raise SystemExit(f"--from-json: {what}") from None
    else:
        peers = None
        if args.peers_from is not None:
            try:
                peers = peer_runs(orjson.loads(args.peers_from.read_bytes()), args)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise SystemExit(f"--peers-from: {args.peers_from}: {exc}") from None
        runs = measure(args, peers)
        elapsed = time.monotonic() - started
        arrival, trace_requests = args.arrival, args.mooncake_limit
        profile, workers = args.profile, args.workers
        command = f"python benchmarks/seed_verdict.py --seeds {args.seeds}"
        if args.arrival != "poisson":
            command += f" --arrival {args.arrival}"
        if args.scenarios != ",".join(SCENARIOS):
            command += f" --scenarios {args.scenarios}"
        if args.mooncake_limit != MOONCAKE_LIMIT:
            command += f" --mooncake-limit {args.mooncake_limit}"
        if args.profile != PROFILE:
            command += f" --profile {args.profile}"
        if args.workers:
            command += f" --workers {args.workers}"
        if args.peers_from is not None:
            command += f" --peers-from {args.peers_from.name}"
        if args.json is not None:
            payload = {"command": command, "elapsed_s": elapsed, "arrival": arrival,
                       "mooncake_limit": trace_requests, "profile": profile,
                       "workers": workers, "cells": _encode(runs)}  # fmt: skip
            args.json.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2) + b"\n")
    plot_name = args.plot.name if args.plot is not None else ""
    text = markdown(runs, command, elapsed, arrival, plot_name, trace_requests)
    if args.markdown is not None:
        args.markdown.write_text(text, encoding="utf-8")
    if args.plot is not None:
        plot(runs, args.plot, setting(profile, workers, arrival))
    print(text)


if __name__ == "__main__":
    main()
