"""``prefixrouter top``: the dashboard's live view in a terminal, for SSH users.

It reads the same server-sent events as the page (``GET /dashboard/events``,
a snapshot a second, :mod:`.feed`) and redraws with rich's ``Live``: the
gateway's figures, every worker (health, in flight, queue, KV use, cached
share, the prefixes it holds by prefill saved), the per-prefix-class table of
the last 60 s (cached share, TTFT warm/partial/cold, predicted against actual
cached tokens, warm-abandoned share, queue wait by decision), evictions by
age, the drift alarm, the replicas and the newest decisions with their tier
and reason. ``--once`` prints one snapshot (``GET /dashboard/snapshot``) and
exits; ``--iterations N`` stops after N snapshots. When the output is not a
terminal each snapshot is printed in turn instead of redrawn.

The admin key (``--api-key`` or ``PREFIXROUTER_ADMIN_API_KEY``, preferred: a
command line is visible to every local user) goes in the ``Authorization``
header, as for ``/admin/*``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from prefixrouter.errors import PrefixRouterError
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.gateway.dashboard.feed import ALL, HITS
from prefixrouter.gateway.dashboard.routes import DASHBOARD_PATH

DECISION_ROWS = 8


class TopError(PrefixRouterError):
    """The gateway cannot be read (unreachable, refused the key, not a prefixrouter)."""


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def _num(v: float | None, digits: int = 0) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def _mean(pair: list[float]) -> float | None:
    return pair[0] / pair[1] if pair[1] else None


def _share(a: float, b: float) -> float | None:
    return a / b if b else None


def render(snap: dict[str, Any]) -> RenderableType:
    """One snapshot as rich renderables (pure: the tests read its text)."""
    g = snap["gateway"]
    window = snap["window"]
    all_ = window["classes"].get(ALL)
    head = Text.assemble(
        ("prefixrouter top", "bold"),
        f"  policy {g['policy']} · {g['mode']} mode",
        f" · replica {g['replica']}" if g["replica"] else "",
        f" · up {g['uptime_s']:.0f} s · {g['decisions_per_s']:.1f} decisions/s",
        f" · {g['requests']:,} requests",
    )
    drift = snap["drift"]
    ev = window["evictions"]
    tiles = Text.assemble(
        "cached share (60 s) ",
        (_pct(_share(all_["cached"], all_["cached"] + all_["uncached"])) if all_ else "–", "bold"),
        " · cached tokens/s ",
        (_num(snap["point"]["classes"].get(ALL, {}).get("cached_per_s")), "bold"),
        " · warm-abandoned ",
        (_pct(_share(all_["abandoned"], all_["n"])) if all_ else "–", "bold"),
        f" · evictions (60 s) {ev['observed']}",
        " · drift ",
        (drift["state"], "bold red" if drift["firing"] else "green"),
    )

    workers = Table(title="workers", title_justify="left", expand=False)
    for col in ("worker", "state", "in flight", "queue", "KV use", "cached share", "index"):
        workers.add_column(col, justify="left" if col in ("worker", "state") else "right")
    workers.add_column("prefixes held (prefill saved)")
    for w in snap["workers"]:
        held = ", ".join(
            f"{p['key'][:8]} {p['class']} {p['saved_tokens']:,} tok" for p in w["prefixes"][:3]
        )
        workers.add_row(
            w["id"],
            Text(w["state"], style="green" if w["healthy"] else "red"),
            _num(w["in_flight"]),
            _num(w["queue"]),
            _pct(w["kv_usage"]),
            _pct(w["cached_share"]),
            f"{w['index_blocks']:,}",
            held or "–",
        )

    classes = Table(title="by prefix class, last 60 s", title_justify="left")
    for col in ("class", "decisions", "cached share", *(f"TTFT {h}" for h in HITS)):
        classes.add_column(col, justify="left" if col == "class" else "right")
    for col in ("predicted", "actual", "warm-abandoned", "queue wait by decision"):
        classes.add_column(col, justify="right")
    for cls in (ALL, *snap["classes"]):
        a = window["classes"].get(cls)
        if a is None:
            continue
        waits = " ".join(f"{t} {_num(_mean(p), 1)}ms" for t, p in sorted(a["wait"].items()))
        classes.add_row(
            "all" if cls == ALL else cls,
            _num(a["n"]),
            _pct(_share(a["cached"], a["cached"] + a["uncached"])),
            *(_num(_mean(a["ttft"][h]), 1) + " ms" for h in HITS),
            _num(a["predicted"]),
            _num(a["actual"]),
            _pct(_share(a["abandoned"], a["n"])),
            waits or "–",
        )

    parts: list[RenderableType] = [head, tiles, workers, classes]
    ages = [f"{label} {n}" for label, n in ev["age_buckets"] if n]
    if ages:
        parts.append(Text("evicted prefixes by age (60 s): " + ", ".join(ages)))
    cluster = snap.get("cluster")
    if cluster is not None:
        lag = cluster["lag_ms"]
        peers = ", ".join(p["replica"] for p in cluster["peers"]) or "none"
        parts.append(
            Text(
                f"replica {cluster['replica']} · peers {peers} · lag p50 {_num(lag['p50'], 2)} ms"
                f" p99 {_num(lag['p99'], 2)} ms · applied {cluster['facts_applied_per_s']}/s"
            )
        )
    decisions = snap.get("decisions") or snap.get("recent") or []
    if decisions:
        table = Table(title="newest decisions (sampled)", title_justify="left")
        for col in ("request", "class", "tier", "worker", "predicted", "actual", "reason"):
            table.add_column(col, justify="right" if col in ("predicted", "actual") else "left")
        for d in decisions[-DECISION_ROWS:][::-1]:
            table.add_row(
                str(d["request_id"])[:20],
                d["prefix_class"],
                d["tier"],
                d["selected_worker"],
                _num(d["predicted_cached_tokens"]),
                _num(d["actual_cached_tokens"]),
                d["reason"],
            )
        parts.append(table)
    return Group(*parts)


async def _events(url: str, api_key: str | None) -> AsyncIterator[dict[str, Any]]:
    """The stream's snapshots, parsed (hello first)."""
    import aiohttp

    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url.rstrip("/") + DASHBOARD_PATH + "/events", headers=headers) as resp,
        ):
            _check_status(resp.status, url)
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while (end := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:end], buf[end + 2 :]
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            yield orjson.loads(line[5:])
    except aiohttp.ClientError as exc:
        raise TopError(f"cannot read {url}: {exc}") from None


async def _snapshot(url: str, api_key: str | None) -> dict[str, Any]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(url.rstrip("/") + DASHBOARD_PATH + "/snapshot", headers=headers) as resp,
        ):
            _check_status(resp.status, url)
            data: dict[str, Any] = orjson.loads(await resp.read())
            return data
    except aiohttp.ClientError as exc:
        raise TopError(f"cannot read {url}: {exc}") from None


def _check_status(status: int, url: str) -> None:
    if status in (401, 403):
        raise TopError(
            f"{url} refused the dashboard without its admin API key: pass --api-key or set "
            f"{ADMIN_KEY_ENV}"
        )
    if status == 404:
        raise TopError(f"{url} has no {DASHBOARD_PATH}: is it a prefixrouter gateway?")
    if status != 200:
        raise TopError(f"{url}{DASHBOARD_PATH}: HTTP {status}")


async def run_top(url: str, api_key: str | None, iterations: int | None, console: Console) -> int:
    """Show the live view until interrupted or after ``iterations`` snapshots; returns how many."""
    shown = 0
    if console.is_terminal:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            async for snap in _events(url, api_key):
                live.update(render(snap), refresh=True)
                shown += 1
                if iterations is not None and shown >= iterations:
                    break
    else:
        async for snap in _events(url, api_key):
            console.print(render(snap))
            console.print()
            shown += 1
            if iterations is not None and shown >= iterations:
                break
    return shown


def top(
    url: Annotated[
        str, typer.Option("--url", help="The gateway's base URL, e.g. http://127.0.0.1:8080.")
    ] = "http://127.0.0.1:8080",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=ADMIN_KEY_ENV,
            show_envvar=True,
            help="The gateway's admin API key, when it has one (sent as a bearer token).",
        ),
    ] = None,
    iterations: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many snapshots (one a second).")
    ] = None,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
) -> None:
    """The dashboard's live view in the terminal (reads GET /dashboard/events)."""
    console = Console(width=None if sys.stdout.isatty() else 170)
    try:
        if once:
            console.print(render(asyncio.run(_snapshot(url, api_key))))
        else:
            asyncio.run(run_top(url, api_key, iterations, console))
    except TopError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        pass
