"""The ``prefixrouter bench`` command: our gateway against sglang-router and vllm-router, live.

Parses the options, reports peers that are not installed (skipped, with the
command that installs them), runs :func:`prefixrouter.bench.runner.run_bench`
with rich progress bars on stderr, and prints one table per scenario as it
ends, then the overhead table. ``--json``, ``--plot`` and ``--markdown`` are
rewritten after every scenario.

Bad input (unknown scenario, router or profile, a peers dir that is a file,
an output path that cannot be written: checked before any engine starts)
prints one line and exits with status 2; a fleet that cannot start exits with 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from prefixrouter.errors import PrefixRouterError, check_outputs
from prefixrouter.harness.replay import ReplayResult
from prefixrouter.terminal import fail

console = Console(width=None if sys.stdout.isatty() else 170)
err_console = Console(stderr=True)


class _RichUI:
    """Progress bars on stderr, tables on stdout."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None
        self.overhead_task: TaskID | None = None

    def router_started(self, scenario: str, router: str, total: int) -> None:
        self.task = self.progress.add_task(f"{scenario} · {router}", total=total)

    def request_done(self, result: ReplayResult) -> None:
        if self.task is not None:
            self.progress.advance(self.task)

    def scenario_done(self, report: dict[str, Any]) -> None:
        from prefixrouter.bench.report import rounds_table, scenario_table

        console.print(scenario_table(report))
        if "rounds" in report:
            console.print(rounds_table(report))

    def overhead_router(self, router: str, index: int, total: int) -> None:
        if self.overhead_task is None:
            self.overhead_task = self.progress.add_task("overhead", total=total)
        self.progress.update(
            self.overhead_task, completed=index, description=f"overhead · {router}"
        )


def bench(
    scenario: Annotated[
        list[str] | None,
        typer.Option(
            help="Scenario, repeatable (default: doc-qa, system-prompt, multi-turn, unique)."
        ),
    ] = None,
    routers: Annotated[
        str,
        typer.Option(
            help="'all' or a comma-separated list of round_robin, prefix_aware, "
            "prefix_aware-token, oracle (documents pinned from the workload), "
            "sglang-cache_aware, sglang-round_robin, vllm-cache_aware; ours also as "
            "NAME@N (N replicas sharing facts over NATS) or NAME@N-nosync; "
            "gateway:POLICY runs our gateway with any registered policy "
            "(`prefixrouter policies`)."
        ),
    ] = "all",
    replicas: Annotated[
        int,
        typer.Option(
            min=1,
            max=32,
            help="Run each of our gateway routers as this many replicas; the client "
            "spreads requests over them round robin, as a Kubernetes Service would.",
        ),
    ] = 1,
    sync: Annotated[
        bool,
        typer.Option(
            "--sync/--no-sync",
            help="With --replicas: share routing facts over a nats-server the bench "
            "starts (--no-sync: each replica learns alone).",
        ),
    ] = True,
    workers: Annotated[int, typer.Option(min=1, max=16, help="Engine processes.")] = 4,
    rate: Annotated[float, typer.Option(min=0.1, help="Offered requests per second (wall).")] = 8.0,
    requests: Annotated[int, typer.Option(min=1, help="Requests per scenario and router.")] = 160,
    load: Annotated[
        float, typer.Option(min=0.01, max=10.0, help="Fleet load the engines' speed is set for.")
    ] = 0.8,
    time_scale: Annotated[
        float | None, typer.Option(min=1e-4, help="Engine time scale (overrides --load).")
    ] = None,
    scale: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Scenario token lengths times this.")
    ] = 0.5,
    profile: Annotated[str, typer.Option(help="Engine profile (see `profiles`).")] = (
        "llama3-8b-h100"
    ),
    warmup: Annotated[
        int, typer.Option(min=0, help="Unique warm-up requests through each router first.")
    ] = 100,
    rounds: Annotated[
        int,
        typer.Option(
            min=1,
            max=50,
            help="Run every router this many times, interleaved (round 1 runs each once, "
            "then round 2, ...), and report each router's spread and its mean TTFT over the "
            "first router's, round by round.",
        ),
    ] = 1,
    seed: Annotated[int, typer.Option(min=0, help="Workload seed.")] = 0,
    kv_blocks: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="KV blocks per engine (default: the scenario's, times --scale); "
            "cache-pressure is sized from it.",
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the results here.")] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="Write the tables as Markdown here.")
    ] = None,
    overhead: Annotated[
        bool, typer.Option("--overhead/--no-overhead", help="Also compare router overhead.")
    ] = True,
    live: Annotated[
        bool, typer.Option("--live/--no-live", help="Run the scenarios (--no-live: overhead only).")
    ] = True,
    overhead_rate: Annotated[
        float, typer.Option(min=1.0, help="Overhead: offered requests per second.")
    ] = 300.0,
    overhead_seconds: Annotated[
        float,
        typer.Option(
            min=0.5, help="Overhead: open-loop seconds per router (closed loop: up to 3)."
        ),
    ] = 4.0,
    peers_dir: Annotated[
        Path | None,
        typer.Option(help="Peers' venvs (default: $PREFIXROUTER_PEERS_DIR, else .venvs)."),
    ] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="Keep router logs and our decision logs here.")
    ] = None,
) -> None:
    """Our gateway against sglang-router and vllm-router on one live fleet, side by side."""
    from prefixrouter.bench.overhead import OverheadConfig
    from prefixrouter.bench.report import overhead_table
    from prefixrouter.bench.routers import default_peers_dir, parse_routers, skip_reason
    from prefixrouter.bench.runner import BenchOptions, run_bench
    from prefixrouter.bench.workload import DEFAULT_SCENARIOS, live_scenarios
    from prefixrouter.harness.processes import Fleet
    from prefixrouter.sim.profiles import get_profile

    names = list(dict.fromkeys(scenario or DEFAULT_SCENARIOS)) if live else []
    if not live and not overhead:
        raise fail("--no-live with --no-overhead leaves nothing to run")
    known = live_scenarios()
    bad = [n for n in names if n not in known]
    if bad:
        raise fail(f"unknown scenario {bad[0]!r}; live scenarios: {', '.join(known)}")
    try:
        specs = parse_routers(routers)
        if replicas > 1:  # names that say their replicas keep them
            specs = [
                s.replicated(replicas, sync) if s.ours and s.replicas == 1 else s for s in specs
            ]
        prof = get_profile(profile)
    except (PrefixRouterError, KeyError) as exc:
        raise fail(str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)) from None
    peers = peers_dir if peers_dir is not None else default_peers_dir()
    if peers.exists() and not peers.is_dir():
        raise fail(f"--peers-dir: {peers} is not a directory")
    # Written after every scenario: a bad path must cost seconds, not the run.
    # No two outputs in one file: the last written would leave only itself.
    outputs = (("--json", json_out, None), ("--markdown", markdown, None), ("--plot", plot, ".png"))
    if (why := check_outputs(outputs)) is not None:
        raise fail(why)
    for spec in specs:
        reason = skip_reason(spec, peers)
        if reason is not None:
            err_console.print(f"[yellow]skipping {spec.name}:[/] {reason}", highlight=False)
    opts = BenchOptions(
        scenarios=names, routers=specs, profile=prof, peers_dir=peers, workers=workers,
        rate=rate, requests=requests, load=load, time_scale=time_scale, scale=scale,
        warmup=warmup, rounds=rounds, seed=seed, kv_blocks=kv_blocks, log_dir=log_dir,
        json_out=json_out, plot_out=plot, markdown_out=markdown,
        overhead=OverheadConfig(
            workers=workers, rate=overhead_rate, seconds=overhead_seconds,
            saturation_s=min(3.0, overhead_seconds),
        )
        if overhead else None,
    )  # fmt: skip
    progress = Progress(
        TextColumn("[bold]{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    try:
        with Fleet() as fleet, progress:
            result = run_bench(opts, fleet, _RichUI(progress))
    except PrefixRouterError as exc:  # OutputError too: a write failed after the checks
        raise fail(str(exc)) from None
    except RuntimeError as exc:
        raise fail(str(exc), code=1) from None
    if result.overhead is not None:
        console.print(overhead_table(result.overhead, overhead_rate))
    for path in (json_out, plot, markdown):
        if path is not None:
            console.print(f"wrote {path}")
