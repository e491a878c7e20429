"""The ``prefixrouter demo`` command (see :mod:`prefixrouter.demo.run`).

Progress bars on stderr, then one table (TTFT p50, p99 and mean, the share
of prompt tokens the engines served from cache, prefill tokens; ``-`` where
nothing was measured) with the bench's notes under it (failed requests and
the first error, an engine not read after the run, requests that waited in
the client for a slot), the bench's PNG, and with ``--serve`` a gateway that
stays up until Ctrl-C (it prints the gateway's address, the admin key of the
run, and the dashboard's address). A router whose run failed is a row with
its error; the table and the PNG still show the others, then the demo exits
with status 1 (and does not serve). Requests too long for ``--kv-blocks``
are refused before any engine starts (status 2).
``--envoy`` instead starts engines, ``prefixrouter epp`` and a real Envoy in
front of them (:mod:`prefixrouter.demo.envoy`) and keeps them up until Ctrl-C;
Envoy's bootstrap is in a temporary folder (its path is printed, to read while
the demo runs) that is removed when the demo ends.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prefixrouter.errors import PrefixRouterError, output_problem, unwritable
from prefixrouter.harness.processes import Fleet
from prefixrouter.harness.replay import ReplayResult
from prefixrouter.terminal import fail

console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True)


def served_lines(url: str, admin_key: str, admin_url: str | None = None) -> list[str]:
    """What ``--serve`` prints: where to send requests, a request to try, the key, the dashboard.

    ``admin_url`` is where ``/admin``, ``/metrics`` and the dashboard are when
    that is not ``url`` (``--envoy``: the picker's HTTP port behind Envoy).
    """
    from prefixrouter.gateway.cli import ADMIN_KEY_ENV
    from prefixrouter.gateway.dashboard import dashboard_url

    admin = admin_url or url
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}'
    return [
        f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        f"admin API key (this run only): {admin_key}",
        f"curl -s {admin}/admin/workers -H 'Authorization: Bearer {admin_key}'",
        f"dashboard: {dashboard_url(admin, admin_key)}",
        f"in a terminal: {ADMIN_KEY_ENV}={admin_key} prefixrouter top --url {admin}",
    ]


def demo_table(report: dict[str, Any], workers: int, requests: int, rate: float) -> Table:
    """The demo's table, one row per router, from the bench's scenario report.

    A figure nothing measured (every request failed, no usage reported) is
    ``-``, never ``0``; a router whose run failed shows its error. The
    bench's notes (:func:`prefixrouter.bench.report.result_notes`) are its
    caption.
    """
    from prefixrouter.bench.report import NOT_MEASURED, result_notes

    def ms(figures: dict[str, float] | None, key: str) -> str:
        return NOT_MEASURED if figures is None else f"{figures[key]:.0f} ms"

    notes = result_notes(report)
    table = Table(
        title=f"{workers} engines, {requests} requests per router, {rate:g} req/s",
        caption="\n".join(notes) or None,
        caption_justify="left",
    )
    for col in ("router", "ok", "TTFT p50", "TTFT p99", "TTFT mean", "cached", "prefill tokens"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for s in report["results"]:
        if "requests" not in s:  # the router's run failed as a whole
            table.add_row(s["router"], "failed", str(s.get("error", ""))[:150])
            continue
        ttft, cached, prefill = s["ttft_ms"], s["client_cached_share"], s["prefill_tokens"]
        table.add_row(
            s["router"],
            f"{s['ok']}/{s['requests']}",
            ms(ttft, "p50"),
            ms(ttft, "p99"),
            ms(ttft, "mean"),
            NOT_MEASURED if cached is None else f"{cached:.1%}",
            NOT_MEASURED if prefill is None else f"{prefill:,}",
            style="bold" if s["router"] == "prefix_aware" else None,
        )
    return table


def demo(
    workers: Annotated[int, typer.Option(min=1, max=16, help="Engine processes.")] = 4,
    requests: Annotated[int, typer.Option(min=10, help="Requests per router.")] = 240,
    rate: Annotated[float, typer.Option(min=0.1, help="Offered requests per second.")] = 8.0,
    kv_blocks: Annotated[int, typer.Option(min=64, help="KV blocks per engine.")] = 700,
    plot: Annotated[Path, typer.Option(help="Where to write the PNG.")] = Path("demo.png"),
    serve: Annotated[
        bool, typer.Option("--serve", help="Keep a prefixrouter gateway running afterwards.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    envoy: Annotated[
        bool,
        typer.Option(
            "--envoy",
            help="Instead: engines, prefixrouter epp and Envoy in front of them, until Ctrl-C.",
        ),
    ] = False,
) -> None:
    """Start engines and the gateway on loopback; compare round robin and prefixrouter live."""
    from prefixrouter.bench.report import plot as plot_runs
    from prefixrouter.demo.run import DemoConfig, run_demo, serve_forever
    from prefixrouter.gateway.cli import stop_on_signals

    cfg = DemoConfig(workers=workers, requests=requests, rate=rate, kv_blocks=kv_blocks, seed=seed)
    if not envoy and (why := output_problem(plot, suffix=".png")) is not None:
        raise fail(f"--plot {plot}: {why}")  # before the engines start, not after the run
    if envoy:
        _envoy(cfg)
        return
    with Fleet() as fleet:
        with Progress(
            TextColumn("[bold]{task.description:<24}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
        ) as progress:
            tasks: list[Any] = []

            def on_router(name: str, total: int) -> None:
                tasks.append(progress.add_task(f"through {name}", total=total))

            def on_done(_: ReplayResult) -> None:
                progress.advance(tasks[-1])

            try:
                scenario, engines = asyncio.run(
                    run_demo(cfg, fleet, on_router=on_router, on_done=on_done)
                )
            except PrefixRouterError as exc:  # a request too long for the KV cache
                raise fail(str(exc)) from None
            except RuntimeError as exc:
                raise fail(str(exc), code=1) from None
        console.print(demo_table(scenario.report(), cfg.workers, requests, rate))
        try:
            plot_runs([scenario], [], plot)
        except OSError as exc:  # checked before the run; a full disk still shows here
            raise fail(f"--plot {unwritable(plot, exc)}") from None
        console.print(f"wrote {plot}")
        failed = [r for r in scenario.runs if r.error is not None]
        if failed:  # after the table: what the other routers measured is shown
            raise fail(f"{failed[0].spec.label}: {failed[0].error}", code=1)
        if serve:

            async def keep_serving() -> None:
                # A fresh key per run: the admin API adds and removes workers,
                # so it is never open without one.
                admin_key = secrets.token_urlsafe(24)
                gateway = await serve_forever(fleet, engines, admin_key)
                stop = stop_on_signals("demo")  # before the lines a user acts on
                console.print(f"prefixrouter gateway on {gateway.url} (Ctrl-C stops everything)")
                for line in served_lines(gateway.url, admin_key):
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
                await stop.wait()

            asyncio.run(keep_serving())


def _envoy(cfg: Any) -> None:
    """``--envoy``: the endpoint picker behind a real Envoy (:mod:`prefixrouter.demo.envoy`)."""
    from prefixrouter.demo.envoy import serve_envoy
    from prefixrouter.gateway.cli import stop_on_signals

    async def keep_serving() -> None:
        admin_key = secrets.token_urlsafe(24)
        # The folder is left last, after the fleet has stopped Envoy (which reads it),
        # on every way out: Ctrl-C, SIGTERM, a process that did not start.
        with (
            tempfile.TemporaryDirectory(prefix="prefixrouter-demo-envoy-") as workdir,
            Fleet() as fleet,
        ):
            err_console.print(f"starting {cfg.workers} engines, prefixrouter epp and Envoy ...")
            try:
                stack = await serve_envoy(cfg, fleet, admin_key, Path(workdir))
            except RuntimeError as exc:
                raise fail(str(exc), code=1) from None
            url, picker = stack.envoy.url, stack.picker.url
            stop = stop_on_signals("demo")  # before the lines a user acts on
            console.print(f"Envoy on {url}, asking prefixrouter epp on grpc://127.0.0.1:"
                          f"{stack.grpc_port} (Ctrl-C stops everything)")  # fmt: skip
            console.print(f"the picker's metrics: curl -s {picker}/metrics", highlight=False)
            for line in served_lines(url, admin_key, picker):
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            console.print(
                f"Envoy's bootstrap (removed when the demo ends): {stack.envoy.config_path}",
                highlight=False,
                soft_wrap=True,
            )
            await stop.wait()

    asyncio.run(keep_serving())
