"""The ``prefixrouter`` command line.

Commands:

* ``simulate``: a scenario (or a trace) through every policy on a simulated
  fleet, behind one router or several replicas (``--replicas``); prints a
  table, optionally writes JSON and a PNG;
* ``policies``: the registered routing policies and their parameters;
* ``profiles``: the simulated engine profiles;
* ``engine``: one simulated engine behind a vLLM-compatible HTTP API;
* ``demo``: engines and the gateway on loopback, round robin against prefixrouter;
* ``bench``: our gateway against sglang-router and vllm-router on one live fleet;
* ``serve``: the OpenAI-compatible gateway in front of a fleet;
* ``epp``: the endpoint picker behind Envoy (ext_proc), routing as the gateway does;
* ``lint``: volatile fields placed before long stable prompt content;
* ``analyze``: how much of a request log's prefill a prefix cache would save.

Errors the user can fix (unknown names, malformed traces, bad numbers) print
one line on stderr and exit with status 2; never a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prefixrouter import __version__
from prefixrouter.errors import PrefixRouterError, check_outputs, unreadable, unwritable
from prefixrouter.terminal import err_console, fail, note

if TYPE_CHECKING:
    from prefixrouter.sim.report import FirstSeen
    from prefixrouter.sim.runner import RequestTooLarge
    from prefixrouter.sim.workload import Workload

app = typer.Typer(
    name="prefixrouter",
    help="Prefix-aware router for LLM inference clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Tables are wide: give them room when the output is a file or a pipe
# (terminals keep their own width).
console = Console(width=None if sys.stdout.isatty() else 170)

MAX_SEED = 2**64 - 1
"""The largest --seed: the JSON report writes it as an unsigned 64-bit integer."""
MAX_WORKERS = 4096
"""The largest --workers. Every arrival is scored against every engine, so a run's
time grows with requests x workers x policies. Measured with 4,096 workers on doc-qa,
on the CPU of the review's machine, per 100 requests per policy: the first 25
requests at 5 req/s, times 4, took 4.5 to 16 s over the 12 policies (most 5 to 8 s;
kubeai_chwbl the 16 s); 100 requests at load 0.6 took 10.9 s (prefix_aware) and
5.8 s (round_robin). Earlier, on one core: 8,192 workers about 40 s (superlinear),
and a request on 100,000 of them seconds, so a run of the default size takes hours.
The figures depend on the machine: the help says only "several seconds"."""
PROGRESS_EVERY_S = 0.1
"""How often a progress bar is redrawn (a slow request still moves it)."""
DEFAULT_SCENARIO = "doc-qa"


def _version(value: bool) -> None:
    if value:
        console.print(f"prefixrouter {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Prefix-aware router for LLM inference clusters."""


def _policy_list(spec: str) -> list[str]:
    from prefixrouter.core.policy import alias_note, canonical_policy_name, policy_names

    if spec == "all":
        return policy_names()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise fail("--policies: give 'all' or a comma-separated list of policy names")
    for name in names:
        alias = alias_note(name)
        if alias is not None:
            note(f"--policies: {alias}")
    out: list[str] = []
    for name in map(canonical_policy_name, names):
        if name in out:
            # The same seed gives the same run: a second one adds a row, no figure.
            note(f"--policies: {name} is named twice; it runs once")
        else:
            out.append(name)
    return out


def _results_table(report: dict[str, Any]) -> Table:
    from prefixrouter.sim.report import arrival_text, total_prefill_tokens

    bound = report["lower_bound_prefill_tokens"]
    title = f"{report['scenario']} · {report['workers']} workers · {arrival_text(report)}"
    if report.get("scale", 1) != 1:
        title += f" · lengths x{report['scale']:g}, {report['kv_blocks']} KV blocks"
    replicas = report.get("replicas")
    if replicas is not None:
        title += f" · {_replicas_text(replicas)}"
    floor = report.get("ttft_floor_ms")
    caption = (
        f"TTFT floor (an idle engine per request, every earlier prefix reusable once "
        f"computed): mean {_ms(floor['mean'])}, p99 {_ms(floor['p99'])}"
        if floor is not None
        else None
    )
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for col in (
        "policy",
        "TTFT mean",
        "p50",
        "p90",
        "p99",
        "e2e p99",
        "req/s",
        "cached",
        "prefill ×bound",
        "evictions",
        "imbalance",
        "warm left",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in report["results"]:
        t = r["ttft_ms"]
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        ratio = total_prefill_tokens(r) / bound if bound else float("nan")
        style = "bold" if r["policy"] == "prefix_aware" else None
        table.add_row(
            r["policy"],
            _ms(t["mean"]),
            _ms(t["p50"]),
            _ms(t["p90"]),
            _ms(t["p99"]),
            _ms(r["e2e_ms"]["p99"]),
            f"{r['throughput_rps']:.2f}",
            f"{share:.1%}",
            f"{ratio:.2f}",
            str(r["evictions"]),
            f"{r['load_imbalance']:.2f}",
            str(r["warm_abandoned"]),
            style=style,
        )
    return table


def _ms(value: float) -> str:
    return f"{value / 1e3:.2f} s" if value >= 10_000 else f"{value:.0f} ms"


def _replicas_text(replicas: dict[str, Any]) -> str:
    sync = f"sync, {replicas['sync_lag_ms']:g} ms lag" if replicas["sync"] else "no sync"
    return f"{replicas['routers']} router replicas ({sync})"


def _replicas_table(report: dict[str, Any]) -> Table:
    """Per policy: pooled figures and the range over router replicas (the JSON has each)."""
    table = Table(
        title=f"per router replica: pooled (min - max over replicas) · "
        f"{_replicas_text(report['replicas'])}",
        title_justify="left",
    )
    for col in ("policy", "cached", "TTFT mean", "TTFT p99", "requests/replica"):
        table.add_column(col, justify="left" if col == "policy" else "right")

    def spread(values: list[float], fmt: Any) -> str:
        return f"({fmt(min(values))} - {fmt(max(values))})" if values else "(-)"

    for r in report["results"]:
        reps = r["replicas"]
        # A replica that routed nothing has no share or TTFT (its JSON zeros are not
        # figures): out of the ranges, still in the requests' range.
        served = [x for x in reps if x["requests"]]
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        pct = "{:.1%}".format
        table.add_row(
            r["policy"],
            f"{share:.1%} {spread([x['cached_share'] for x in served], pct)}",
            f"{_ms(r['ttft_ms']['mean'])} {spread([x['ttft_ms']['mean'] for x in served], _ms)}",
            f"{_ms(r['ttft_ms']['p99'])} {spread([x['ttft_ms']['p99'] for x in served], _ms)}",
            spread([x["requests"] for x in reps], str),
            style="bold" if r["policy"] == "prefix_aware" else None,
        )
    return table


@app.command()
def simulate(
    scenario: Annotated[
        str | None, typer.Option(help="Scenario name (see --list; default doc-qa).")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="Replay this trace file instead of a scenario.")
    ] = None,
    trace_format: Annotated[str, typer.Option(help="Trace format: mooncake.")] = "mooncake",
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_WORKERS,
            help=f"Engine replicas (scenario default), at most {MAX_WORKERS:,}: every "
            "arrival is scored against every engine, so thousands take several seconds "
            "per 100 requests per policy.",
        ),
    ] = None,
    profile: Annotated[str, typer.Option(help="Engine profile (see `profiles`).")] = (
        "llama3-8b-h100"
    ),
    kv_blocks: Annotated[
        int | None, typer.Option(min=1, help="KV blocks per replica (scenario default).")
    ] = None,
    load: Annotated[
        float | None, typer.Option(min=0.01, help="Arrival rate as a fraction of capacity.")
    ] = None,
    rate: Annotated[
        float | None, typer.Option(min=1e-6, help="Arrival rate in requests/s (overrides --load).")
    ] = None,
    requests: Annotated[int | None, typer.Option(min=1, help="Requests to generate.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Keep only the first N requests.")] = (
        None
    ),
    scale: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=1.0,
            help="Token lengths and the scenario's KV size times this, as `bench --scale` "
            "(0.5 with --requests 160 --load 0.8 --workers 4 is the live bench's doc-qa).",
        ),
    ] = 1.0,
    rate_scale: Annotated[
        float,
        typer.Option(
            min=1e-6,
            help="Trace replay speed-up (2 = twice as fast); traces only, without --load/--rate.",
        ),
    ] = 1.0,
    arrival: Annotated[
        str,
        typer.Option(
            help="Arrival process: poisson, gamma or gamma:CV (the gaps' coefficient of "
            "variation, 0.01 to 100: below, the gaps are constant; above, most are 0 and "
            "a run's rate is not the one asked for)."
        ),
    ] = "poisson",
    policies: Annotated[
        str, typer.Option(help="'all' or a comma-separated list of policies.")
    ] = "all",
    kv_events: Annotated[
        bool,
        typer.Option("--kv-events", help="Feed engine KV events to the router (token mode)."),
    ] = False,
    mode: Annotated[
        str,
        typer.Option(
            help="How the router sees prompts: text (chat bodies in character chunks, "
            "the gateway's default) or token (token ids in engine blocks)."
        ),
    ] = "text",
    replicas: Annotated[
        int,
        typer.Option(min=1, help="Router replicas, each with its own state; arrivals round robin."),
    ] = 1,
    sync_lag_ms: Annotated[
        float,
        typer.Option(min=0.0, help="Delay of each replica's routing facts to its peers (ms)."),
    ] = 0.0,
    sync: Annotated[
        bool,
        typer.Option(
            "--sync/--no-sync", help="Replicas share routing facts (--no-sync: each on its own)."
        ),
    ] = True,
    token_count: Annotated[
        bool,
        typer.Option(
            "--token-count/--no-token-count",
            help="Text mode: the engine counts a new prefix's tokens when it is first routed "
            "(the gateway's routing.token_count).",
        ),
    ] = True,
    client_max_tokens: Annotated[
        int,
        typer.Option(
            min=-1,
            help="The max_tokens clients send, a cap (answers still end at their own "
            "length); 0: each request asks for its answer's exact length; -1: clients "
            "send none.",
        ),
    ] = 0,
    seed: Annotated[
        int, typer.Option(min=0, max=MAX_SEED, help="Seed of the workload generator.")
    ] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the results here.")] = None,
    list_: Annotated[
        bool, typer.Option("--list", help="List the scenarios, one line each, and exit.")
    ] = False,
) -> None:
    """Simulate a workload on a fleet under every routing policy, side by side."""
    from prefixrouter.core.dispatch import routing_mode
    from prefixrouter.sim.report import lower_bound_prefill_tokens, ttft_floor_ms
    from prefixrouter.sim.runner import RateError, Replicas, RequestTooLarge, plan, run_plan
    from prefixrouter.sim.scenarios import SCENARIOS

    if list_:
        width = max(len(n) for n in SCENARIOS)
        for name, spec in SCENARIOS.items():
            console.print(f"{name:<{width}}  {spec.summary}", highlight=False)
        return
    try:
        routing = routing_mode(mode)
    except ValueError:
        raise fail(f"--mode: expected 'text' or 'token', got {mode!r}") from None
    if kv_events and mode != "token":
        raise fail(
            "--kv-events needs --mode token: engine KV events name token blocks, "
            "which text-mode hashes (character chunks) never match"
        )
    _check_arrival_options(scenario, trace, trace_format, arrival, rate_scale, load, rate)
    # typer's min=0 lets inf and NaN through: refused here naming the option (the
    # fleet's configuration refuses them too, for every other caller).
    if not math.isfinite(sync_lag_ms):
        raise fail(f"--sync-lag-ms {sync_lag_ms}: must be a finite number of milliseconds")
    if replicas == 1 and (not sync or sync_lag_ms):
        # A one-router cell of a replica sweep is run with the sweep's lag: note, not refuse.
        note("--no-sync and --sync-lag-ms have no effect on one router (--replicas 1)")
    elif not sync and sync_lag_ms:
        # The report records the lag that applied, none (Replicas.as_dict says so).
        note("--sync-lag-ms has no effect with --no-sync: the replicas share nothing to delay")
    if rate is not None and load is not None:
        note(f"--rate {rate:g} overrides --load {load:g}")
    outputs = (("--json", json_out, None), ("--plot", plot, ".png"))
    if (why := check_outputs(outputs, {"the trace it reads": trace})) is not None:
        raise fail(why)
    try:
        workload = _load_workload(
            scenario or DEFAULT_SCENARIO, trace, trace_format, requests, seed, arrival, rate_scale
        )
        if limit is not None:
            workload = workload.limited(limit)
        workload = workload.lengths_scaled(scale)
        from prefixrouter.sim.profiles import get_profile

        prof = get_profile(profile)
        names = _policy_list(policies)
        p = plan(
            workload,
            prof,
            names,
            workers=workers,
            kv_blocks=kv_blocks,
            load=load,
            rate=rate,
            kv_events=kv_events,
            mode=routing,
            replicas=Replicas(replicas, sync, sync_lag_ms / 1e3),
            token_count=token_count,
            client_max_tokens=client_max_tokens,
            scan=_scan_with_progress,
        )
    except OSError as exc:  # the trace file
        raise fail(unreadable(exc.filename, exc) if exc.filename else str(exc)) from None
    except RequestTooLarge as exc:
        raise fail(_too_large(exc, trace, kv_blocks, profile, scale)) from None
    except RateError as exc:
        raise fail(f"--{exc.option} {exc.value:g}: {exc}") from None
    except (PrefixRouterError, KeyError, ValueError) as exc:
        raise fail(str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)) from None

    # The bound, the floor and a load's capacity read one scan of the prompts: the
    # plan's, if a load made one, else one made now (before the runs, with its bar).
    seen = p.first_seen if p.first_seen is not None else _scan_with_progress(p.workload)
    with _progress() as progress:
        ticks: list[Callable[[int], None]] = []

        def on_start(name: str, total: int) -> None:
            task = progress.add_task(name, total=total)
            ticks.append(_every(lambda done: progress.update(task, completed=done), total))

        def on_progress(done: int) -> None:
            ticks[-1](done)

        results, runs = run_plan(p, on_start=on_start, on_progress=on_progress)

    report: dict[str, Any] = {
        "scenario": workload.name,
        "workers": p.workers,
        "profile": prof.name,
        "kv_blocks": p.kv_blocks if p.kv_blocks is not None else prof.kv_blocks,
        "seed": seed,
        "load": p.load,
        "rate_rps": p.rate,
        "kv_events": kv_events,
        # Token-mode reports keep the keys they had before modes existed (no key: token).
        **({"mode": "text"} if mode == "text" else {}),
        # One router's reports keep the keys they had before replicas existed.
        **({"replicas": p.replicas.as_dict()} if replicas > 1 else {}),
        **({"client_max_tokens": client_max_tokens} if client_max_tokens else {}),
        **({"scale": scale} if scale != 1 else {}),
        # The other options that change the results, each only when it is not the
        # default, so that the reports of default runs keep their bytes.
        **({"trace": str(trace)} if trace is not None else {}),
        **({"arrival": arrival} if arrival != "poisson" else {}),
        **({"rate_scale": rate_scale} if rate_scale != 1 else {}),
        **({"token_count": False} if not token_count else {}),
        **({"requests": requests} if requests is not None else {}),
        **({"limit": limit} if limit is not None else {}),
        "lower_bound_prefill_tokens": lower_bound_prefill_tokens(p.workload, seen),
        "ttft_floor_ms": ttft_floor_ms(p.workload, prof.speed, seen),
        "results": results,
    }
    console.print(_results_table(report))
    if replicas > 1:
        console.print(_replicas_table(report))
    if json_out is not None:
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:  # checked before the run; a full disk still shows here
            raise fail(f"--json {unwritable(json_out, exc)}") from None
        console.print(f"wrote {json_out}")
    if plot is not None:
        from prefixrouter.sim.plot import plot_report

        try:
            plot_report(report, runs, plot)
        except OSError as exc:
            raise fail(f"--plot {unwritable(plot, exc)}") from None
        console.print(f"wrote {plot}")


def _progress() -> Progress:
    """The progress bars of ``simulate`` (on stderr, kept when done)."""
    return Progress(
        TextColumn("[bold]{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    )


def _every(update: Callable[[int], None], total: int) -> Callable[[int], None]:
    """``update(done)`` at most every :data:`PROGRESS_EVERY_S`, and at ``total``: by time,
    not by count, so that a bar moves whatever one step costs (a request on thousands
    of workers, or a long prompt to hash) and costs nothing when steps are quick."""
    last = -math.inf

    def tick(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done == total or now - last >= PROGRESS_EVERY_S:
            last = now
            update(done)

    return tick


def _scan_with_progress(workload: Workload) -> FirstSeen:
    """:func:`~prefixrouter.sim.report.first_seen` (it hashes every prompt) with its own bar."""
    from prefixrouter.sim.report import first_seen

    total = len(workload.requests)
    with _progress() as progress:
        task = progress.add_task("prefix bound", total=total)
        return first_seen(
            workload, on_progress=_every(lambda done: progress.update(task, completed=done), total)
        )


def _load_workload(
    scenario: str,
    trace: Path | None,
    trace_format: str,
    requests: int | None,
    seed: int,
    arrival: str,
    rate_scale: float,
) -> Any:
    if trace is not None:
        if trace_format != "mooncake":
            raise ValueError(f"unknown trace format {trace_format!r}; known: mooncake")
        from prefixrouter.sim.traces import load_mooncake

        return load_mooncake(trace, limit=requests, rate_scale=rate_scale, seed=seed)
    from prefixrouter.sim.scenarios import get_scenario

    spec = get_scenario(scenario)
    if scenario == "mooncake-conversation":
        from prefixrouter.sim.traces import bundled_mooncake_path, load_mooncake

        # Reported as the scenario the user named, not after the file. Its request
        # ids keep the file's stem, as this command always made them: policies seed
        # their random choices with them, and new ids would change its figures.
        workload = load_mooncake(
            bundled_mooncake_path(), limit=requests, rate_scale=rate_scale, seed=seed
        )
        return dataclasses.replace(workload, name=spec.name)
    return spec.build(seed, requests, arrival)


def _check_arrival_options(
    scenario: str | None,
    trace: Path | None,
    trace_format: str,
    arrival: str,
    rate_scale: float,
    load: float | None,
    rate: float | None,
) -> None:
    """Refuse arrival options that the chosen workload would silently ignore, or that
    name no arrival process."""
    from prefixrouter.sim.workload import arrival_cv

    try:
        arrival_cv(arrival)
    except ValueError as exc:
        raise fail(f"--arrival: {exc}") from None
    if trace is not None and scenario is not None:
        raise fail("--trace replaces the scenario: give --trace or --scenario, not both")
    if trace is None and trace_format != "mooncake":
        raise fail("--trace-format applies to --trace FILE, and none was given")
    is_trace = trace is not None or scenario == "mooncake-conversation"
    if is_trace and arrival != "poisson":
        raise fail(
            "--arrival: a trace replays its own arrival times (--rate-scale, --load or "
            "--rate stretch them); --arrival applies to generated scenarios"
        )
    if rate_scale != 1.0:
        if not is_trace:
            raise fail(
                "--rate-scale speeds up a trace replay (--trace or mooncake-conversation); "
                "set a generated scenario's rate with --load or --rate"
            )
        if load is not None or rate is not None:
            raise fail(
                "--rate-scale has no effect with --load or --rate: they set the trace's "
                "mean rate themselves; give one of them"
            )


def _too_large(
    exc: RequestTooLarge, trace: Path | None, kv_blocks: int | None, profile: str, scale: float
) -> str:
    """The one-line message for a request that does not fit the KV cache, naming what to change."""
    from prefixrouter.sim.traces import trace_line

    req = exc.request
    line = trace_line(req.request_id) if trace is not None else None
    if line is not None:
        scaled = f" (after --scale {scale:g})" if scale != 1 else ""
        return (
            f"{trace}:{line}: input_length {req.prompt_tokens:,} + output_length "
            f"{req.output_tokens:,}{scaled} = {exc.needed_tokens:,} tokens, more than the KV "
            f"cache holds ({exc.capacity_tokens:,}: {exc.kv_blocks:,} blocks of "
            f"{exc.block_size}); see --kv-blocks and --profile"
        )
    if exc.source == "kv_blocks":
        return f"--kv-blocks {kv_blocks}: {exc}"
    where = f"--profile {profile}" if exc.source == "profile" else "the scenario's KV cache"
    return f"{where}: {exc}; give more with --kv-blocks"


@app.command("policies")
def list_policies() -> None:
    """List the routing policies and their parameters with defaults."""
    from prefixrouter.core.policy import ALIASES, POLICIES, policy_names

    aliases = ", ".join(f"{old} = {new}" for old, new in ALIASES.items())
    table = Table(title="routing policies", caption=f"deprecated names: {aliases}")
    table.add_column("policy")
    table.add_column("parameters (defaults)")
    for name in policy_names():
        params = POLICIES[name].Params()
        fields = ", ".join(
            f"{f.name}={getattr(params, f.name)!r}" for f in dataclasses.fields(params)
        )
        table.add_row(name, fields or "-")
    console.print(table)


@app.command("profiles")
def list_profiles() -> None:
    """List the simulated engine profiles."""
    from prefixrouter.sim.profiles import PROFILES

    table = Table(title="engine profiles")
    for col in ("profile", "description", "KV blocks", "block", "max seqs", "step budget"):
        table.add_column(col)
    for p in PROFILES.values():
        table.add_row(
            p.name,
            p.description,
            str(p.kv_blocks),
            str(p.block_size),
            str(p.max_num_seqs),
            str(p.max_batched_tokens),
        )
    console.print(table)


def _register_commands() -> None:
    """Commands that live in their own packages (their imports stay lazy enough)."""
    from prefixrouter.analyze.cli import analyze
    from prefixrouter.analyze.lint_cli import lint
    from prefixrouter.bench.cli import bench
    from prefixrouter.demo.cli import demo
    from prefixrouter.epp.cli import epp
    from prefixrouter.gateway.cli import serve
    from prefixrouter.gateway.dashboard.top import top
    from prefixrouter.simulated_engine.cli import engine

    app.command("demo")(demo)
    app.command("serve")(serve)
    app.command("epp")(epp)
    app.command("engine")(engine)
    app.command("lint")(lint)
    app.command("analyze")(analyze)
    app.command("bench")(bench)
    app.command("top")(top)


_register_commands()
