"""Soak: a mixed streamed workload for M minutes with faults injected on a schedule.

Starts the fault suite's fleet (:func:`prefixrouter.harness.fault_scenarios.start_fault_fleet`:
three simulated engines with served logs, fault injection and KV events with
replay, and one gateway at its default settings), runs the suite's open-loop
load (:class:`~prefixrouter.harness.faults.OpenLoad`: repeated documents and
unique prompts) the whole time, and every ``--gap-s`` seconds injects the next
fault of the suite's scenarios in turn (engine SIGKILL and restart, SIGSTOP
for 10 s, 10x slow, 500s, malformed JSON, truncated SSE, wrong usage fields,
dropped KV events). The gateway itself is never restarted: its RSS over the
run is the leak check. Lost and duplicated requests are counted from the
engines' own served logs (:func:`~prefixrouter.harness.faults.account`)::

    PYTHONPATH=src python benchmarks/soak.py --minutes 30 --json OUT.json [--plot OUT.png] \\
        [--results benchmarks/reliability_results.md]

The JSON: ``requests``, ``complete``, ``errors`` by cause, ``lost``,
``duplicated``, ``faults`` (what ran when), and per minute: ``requests``,
``p99_ttft_s`` (of the requests sent that minute that completed) and
``gateway_rss_mb`` (the largest of the samples of ``/proc/PID/status``
``VmRSS`` taken every ``RSS_EVERY_S`` that minute).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from prefixrouter.bench.marked import markers, replace_marked
from prefixrouter.harness.fault_scenarios import SINGLE, FaultFleet, FaultTimes, start_fault_fleet
from prefixrouter.harness.faults import LoadMix, OpenLoad, Outcome, account, read_served
from prefixrouter.harness.processes import Fleet
from prefixrouter.stats import percentile

RSS_EVERY_S = 5.0
FAULT_ROOM_S = 30.0
"""A fault starts only if this much of the run is left (a fault takes up to ~20 s)."""
SCHEDULE = [k for k in SINGLE if k != "gateway_sigkill"]
"""The faults, in turn (the gateway is not restarted: its RSS is what a soak watches)."""
console = Console(stderr=True)


def rss_mb(pid: int) -> float | None:
    """The resident set size of process ``pid`` in MiB (None: it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cause(o: Outcome) -> str:
    """A short cause for a request that did not complete."""
    if o.kind == "clean_error":
        if o.status != 200:
            return f"HTTP {o.status}"
        return "SSE error: " + o.error.split(":")[0][:60]
    return o.kind


def per_minute(
    outcomes: Sequence[Outcome], rss: Sequence[tuple[float, float]], t0: float, minutes: int
) -> list[dict[str, Any]]:
    rows = []
    for m in range(minutes):
        lo, hi = t0 + 60 * m, t0 + 60 * (m + 1)
        sent = [o for o in outcomes if lo <= o.t_send < hi]
        ttfts = [o.ttft_s for o in sent if o.kind == "complete" and o.ttft_s is not None]
        mem = [v for t, v in rss if lo <= t < hi]
        rows.append(
            {
                "minute": m + 1,
                "requests": len(sent),
                "complete": sum(o.kind == "complete" for o in sent),
                "p99_ttft_s": round(percentile(ttfts, 0.99), 4) if ttfts else None,
                "gateway_rss_mb": round(max(mem), 1) if mem else None,
            }
        )
    return rows


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    total_s = 60.0 * args.minutes
    faults: list[dict[str, Any]] = []
    frozen: dict[str, list[tuple[float, float]]] = {}
    rss: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp, Fleet() as fleet:
        ff: FaultFleet = await start_fault_fleet(fleet, Path(tmp), engines=3)
        load = OpenLoad(ff.urls, LoadMix(rate=args.rate, seed=args.seed), name="soak")
        t0 = time.monotonic()
        end = t0 + total_s
        await load.start()

        async def sample() -> None:
            while time.monotonic() < end:
                got = rss_mb(ff.gateways["gw"].pid)
                if got is not None:
                    rss.append((time.monotonic(), got))
                await asyncio.sleep(RSS_EVERY_S)

        sampler = asyncio.create_task(sample())
        columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("soak: warming up", total=total_s)

            async def tick() -> None:
                while time.monotonic() < end:
                    done = len(load.outcomes)
                    bad = sum(o.kind != "complete" for o in load.outcomes)
                    progress.update(task, completed=time.monotonic() - t0)
                    progress.update(task, description=f"soak: {done} done, {bad} not complete")
                    await asyncio.sleep(1.0)

            ticker = asyncio.create_task(tick())
            turn = 0
            next_at = t0 + args.gap_s
            while True:
                now = time.monotonic()
                if now + FAULT_ROOM_S > end:
                    break
                if now < next_at:
                    await asyncio.sleep(min(1.0, next_at - now))
                    continue
                key = SCHEDULE[turn % len(SCHEDULE)]
                turn += 1
                title, scenario = SINGLE[key]
                progress.console.log(f"fault: {title}")
                times: FaultTimes = await scenario(ff, load)
                if times.frozen:
                    frozen.setdefault(times.target, []).append((times.t_fault, times.t_ready))
                faults.append(
                    {
                        "fault": key,
                        "target": times.target,
                        "at_s": round(times.t_fault - t0, 1),
                        "fault_s": round(times.t_ready - times.t_fault, 2),
                    }
                )
                next_at = time.monotonic() + args.gap_s
            while time.monotonic() < end:
                await asyncio.sleep(min(1.0, end - time.monotonic()))
            outcomes = await load.stop()
            await ticker
            await sampler
            progress.update(task, completed=total_s)
        stuck = await ff.settled_in_flight()
        tracebacks = ff.tracebacks()
        tally = account(outcomes, read_served(ff.served), frozen)
    errors = Counter(cause(o) for o in outcomes if o.kind != "complete")
    return {
        "minutes": args.minutes,
        "rate": args.rate,
        "requests": tally.requests,
        "complete": tally.complete,
        "errors": dict(errors.most_common()),
        "lost": tally.lost,
        "duplicated": tally.duplicated,
        "stuck_in_flight": stuck,
        "gateway_tracebacks": tracebacks,
        "faults": faults,
        "per_minute": per_minute(outcomes, rss, t0, args.minutes),
        "examples": tally.examples[:5],
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_minute"]
    mins = [r["minute"] - 0.5 for r in rows]  # each minute's figure at its middle
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.plot(mins, [r["p99_ttft_s"] for r in rows], marker="o")
    ax1.set_ylabel("p99 TTFT (s)")
    ax1.set_ylim(bottom=0)
    ax2.plot(mins, [r["gateway_rss_mb"] for r in rows], marker="o", color="tab:green")
    ax2.set_ylabel("gateway RSS (MiB)")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("minutes since the start")
    for f in report["faults"]:
        for ax in (ax1, ax2):
            ax.axvline(f["at_s"] / 60, color="tab:red", alpha=0.25, lw=1)
    ax1.set_title(
        f"soak: {report['requests']} requests, {report['lost']} lost, "
        f"{report['duplicated']} duplicated, {len(report['faults'])} faults (red lines)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict[str, Any], plot_name: str | None) -> str:
    """RESULTS.md's soak block: totals, errors by cause, p99 TTFT and RSS over time."""
    rows = report["per_minute"]
    step = max(1, len(rows) // 10)
    shown = [r for r in rows if r["minute"] % step == 0 or r["minute"] in (1, len(rows))]
    errors = ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"
    lines = [
        f"{report['minutes']} minutes at {report['rate']:g} req/s, "
        f"{len(report['faults'])} faults: **{report['requests']} requests, "
        f"{report['complete']} complete, {report['lost']} lost, "
        f"{report['duplicated']} duplicated**; {report['stuck_in_flight']} stuck in flight, "
        f"{report['gateway_tracebacks']} gateway tracebacks. Errors by cause: {errors}.",
        "",
        "| minute | requests | complete | p99 TTFT (s) | gateway RSS (MiB) |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {r['minute']} | {r['requests']} | {r['complete']} | {r['p99_ttft_s']} "
            f"| {r['gateway_rss_mb']} |"
            for r in shown
        ),
    ]
    if plot_name:
        lines += ["", f"![soak: p99 TTFT and gateway RSS per minute](results/{plot_name})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=int, default=30, help="length of the run (default 30)")
    ap.add_argument("--json", type=Path, required=True, help="write the report here")
    ap.add_argument("--plot", type=Path, help="write a PNG of p99 TTFT and RSS per minute")
    ap.add_argument("--rate", type=float, default=15.0, help="requests per second")
    ap.add_argument("--gap-s", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, help="results file whose soak block to replace")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: redraw --plot and --results from the existing --json",
    )
    args = ap.parse_args(argv)
    if args.minutes < 1:
        ap.error("--minutes: must be at least 1")
    if args.results and markers("soak")[0] not in args.results.read_text():
        ap.error(f"--results: {args.results} has no {markers('soak')[0]} block")
    # A SIGTERM unwinds like an error: the fleet stops every process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render_only:
        report = orjson.loads(args.json.read_bytes())
    else:
        report = asyncio.run(soak(args))
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.plot:
        plot(report, args.plot)
    if args.results:
        replace_marked(
            args.results, "soak", markdown(report, args.plot.name if args.plot else None)
        )
    console.print(
        f"soak: {report['requests']} requests, {report['complete']} complete, "
        f"{report['lost']} lost, {report['duplicated']} duplicated; errors {report['errors']}",
        highlight=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
