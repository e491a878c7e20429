"""Proactive copy on and off, side by side: prefix_aware's mean and p99 TTFT per scenario.

Usage::

    python benchmarks/proactive_copy.py [--scenarios a,b,...] [--loads 0.6,0.9]
        [--seeds 4] [--doc-qa-kv 9000,30000] [--mode token] [--processes 2]
        [--out benchmarks/proactive_copy_results.md]

``prefix_aware`` with ``proactive_copy`` off and on (the default), on the same
requests and fleet (:mod:`prefixrouter.sim.runner`'s plan), for every
scenario, load and seed; doc-qa also at the ``--doc-qa-kv`` sizes (issue 15,
goal 3: more KV must not make it slower). Several seeds, because a shared
prefix's first cold prefill and the requests that queue behind it make one
seed's mean move by a third (doc-qa at 0.9: 185-340 ms over seeds 0-9); the
Mooncake trace has one order whatever the seed, so it runs once.

Writes the markdown table (means over seeds, on/off ratios, the router's
warm-ups per run and the prefill tokens' ratio) and a PNG of the ratios
beside it. Deterministic: the same arguments give the same files.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_results import PROFILE, build

from prefixrouter.core.dispatch import RoutingMode
from prefixrouter.core.policy import create_policy
from prefixrouter.sim.cluster import ClusterConfig, Simulation
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import summarize, total_prefill_tokens
from prefixrouter.sim.runner import plan

SCENARIOS = "doc-qa,system-prompt,templates,rag,multi-turn,hot-prefix,mooncake-conversation"
TRACES = {"mooncake-conversation"}  # one request order whatever the seed

Job = tuple[str, float, int | None, int, RoutingMode]  # scenario, load, kv blocks, seed, mode


def run_cell(job: Job) -> tuple[Job, dict[bool, dict[str, Any]]]:
    """Both settings on one scenario, load, KV size and seed."""
    name, load, kv, seed, mode = job
    p = plan(build(name, seed, 3000), get_profile(PROFILE), ["prefix_aware"], load=load, mode=mode,
             kv_blocks=kv)  # fmt: skip
    out: dict[bool, dict[str, Any]] = {}
    for proactive in (False, True):
        policy = create_policy("prefix_aware", {"proactive_copy": proactive})
        config = ClusterConfig(p.workers, p.profile, p.kv_blocks, mode=p.mode)
        run = Simulation(p.workload, config, policy).run()
        s = summarize(run)
        out[proactive] = {
            "mean": s["ttft_ms"]["mean"],
            "p99": s["ttft_ms"]["p99"],
            "prefill": total_prefill_tokens(s),  # the router's own copies counted
            "warm_ups": run.warm_ups,
        }
    return job, out


def _ratio(on: float, off: float) -> float:
    return on / off if off > 0 else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=SCENARIOS)
    ap.add_argument("--loads", default="0.6,0.9")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--doc-qa-kv", default="9000,30000", help="extra KV sizes for doc-qa")
    ap.add_argument("--mode", default="token", choices=("token", "text"))
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/proactive_copy_results.md"))
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x]
    extra_kv = [int(x) for x in args.doc_qa_kv.split(",") if x]
    cells: list[tuple[str, float, int | None]] = []
    for name in (n for n in args.scenarios.split(",") if n):
        for load in loads:
            sizes: list[int | None] = [None, *(extra_kv if name == "doc-qa" else [])]
            cells.extend((name, load, kv) for kv in sizes)
    jobs: list[Job] = [
        (name, load, kv, seed, args.mode)
        for name, load, kv in cells
        for seed in range(1 if name in TRACES else args.seeds)
    ]
    got: dict[tuple[str, float, int | None], list[dict[bool, dict[str, Any]]]] = {}
    console = Console(stderr=True, width=140)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with (
        Progress(*columns, console=console) as progress,
        ProcessPoolExecutor(args.processes) as pool,
    ):
        task = progress.add_task("scenario x load x KV x seed", total=len(jobs))
        for job, out in pool.map(run_cell, jobs):
            got.setdefault(job[:3], []).append(out)
            progress.advance(task)
    rows: list[dict[str, Any]] = []
    for name, load, kv in cells:
        runs = got[(name, load, kv)]

        def mean_of(
            setting: bool, key: str, runs: list[dict[bool, dict[str, Any]]] = runs
        ) -> float:
            return statistics.fmean(r[setting][key] for r in runs)

        rows.append({
            "scenario": name, "load": load, "kv_blocks": kv, "seeds": len(runs),
            "mean_off": mean_of(False, "mean"), "mean_on": mean_of(True, "mean"),
            "p99_off": mean_of(False, "p99"), "p99_on": mean_of(True, "p99"),
            "prefill_ratio": _ratio(mean_of(True, "prefill"), mean_of(False, "prefill")),
            "warm_ups": mean_of(True, "warm_ups"),
        })  # fmt: skip
    table = Table(title=f"proactive copy, {args.mode} mode (means over seeds)")
    for col in ("scenario", "load", "KV", "seeds", "mean off", "mean on", "ratio", "p99 off",
                "p99 on", "ratio", "prefill", "warm-ups"):  # fmt: skip
        table.add_column(col, justify="left" if col == "scenario" else "right")
    lines = [
        f"# Proactive copy, {args.mode} mode",
        "",
        f"Produced by `python benchmarks/proactive_copy.py --mode {args.mode} --seeds "
        f"{args.seeds}`: `prefix_aware` with `proactive_copy` off and on (the default), "
        "on the same requests and fleet; each figure is the mean over the seeds (one for "
        "the Mooncake trace). *ratio* is on / off; *prefill* is the prefill tokens' "
        "ratio, the router's copies counted; *warm-ups* the router's prefill-only "
        "copies per run. KV: blocks per worker (-: the scenario's default).",
        "",
        "| scenario | load | KV | seeds | mean off | mean on | ratio | p99 off | p99 on "
        "| ratio | prefill | warm-ups |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cells_text = [
            r["scenario"], f"{r['load']:g}", "-" if r["kv_blocks"] is None else str(r["kv_blocks"]),
            str(r["seeds"]), f"{r['mean_off']:.1f}", f"{r['mean_on']:.1f}",
            f"{_ratio(r['mean_on'], r['mean_off']):.3f}", f"{r['p99_off']:.0f}",
            f"{r['p99_on']:.0f}", f"{_ratio(r['p99_on'], r['p99_off']):.3f}",
            f"{r['prefill_ratio']:.3f}", f"{r['warm_ups']:.1f}",
        ]  # fmt: skip
        table.add_row(*cells_text)
        lines.append("| " + " | ".join(cells_text) + " |")
    console.print(table)
    args.out.write_text("\n".join(lines) + "\n")
    _plot(rows, args.out.with_suffix(".png"), args.mode)
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _plot(rows: list[dict[str, Any]], path: Path, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['scenario']} {r['load']:g}"
        + ("" if r["kv_blocks"] is None else f" kv{r['kv_blocks']}")
        for r in rows
    ]
    mean = [_ratio(r["mean_on"], r["mean_off"]) for r in rows]
    p99 = [_ratio(r["p99_on"], r["p99_off"]) for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], mean, height=0.4, label="mean TTFT on/off")
    ax.barh([i + 0.2 for i in y], p99, height=0.4, label="p99 TTFT on/off")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (below 1: proactive copy is faster)")
    ax.set_title(f"prefix_aware, proactive copy on vs off ({mode} mode)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
