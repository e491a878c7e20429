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

A gateway that stops or is killed while the view runs is tried again every
second until it is back (one line says it went away, one that it is back);
Ctrl-C ends the wait. ``--url`` is checked before connecting, and a server
that is not a prefixrouter gateway (a 200 of HTML or of other JSON), a
refused key or an unreachable address is one ``error:`` line and status 2.

The admin key (``--api-key`` or ``PREFIXROUTER_ADMIN_API_KEY``, preferred: a
command line is visible to every local user) goes in the ``Authorization``
header, as for ``/admin/*``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from prefixrouter.addresses import address_problem
from prefixrouter.errors import PrefixRouterError
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.gateway.dashboard.feed import ALL, HITS
from prefixrouter.gateway.dashboard.routes import DASHBOARD_PATH

DECISION_ROWS = 8
RETRY_S = 1.0
"""How often the live view tries a gateway that went away (a restart takes about a second)."""
SNAPSHOT_KEYS = ("gateway", "window", "workers", "drift", "point", "classes")
"""What a dashboard snapshot has that a random JSON answer (an SPA's, a health check's) lacks."""


class TopError(PrefixRouterError):
    """The gateway cannot be read (unreachable, refused the key, not a prefixrouter)."""


class _Gone(Exception):
    """The connection failed or broke: the gateway may be restarting (retried once it was seen)."""


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


async def _events(url: str, api_key: str | None) -> AsyncGenerator[dict[str, Any]]:
    """One connection's snapshots, parsed (hello first), until the stream ends.

    Raises:
        TopError: The server answered, but not as a gateway's dashboard (a
            refused key, no dashboard, not an event stream, not its JSON).
        _Gone: The connection failed or broke, or a proxy in front answered 5xx:
            the gateway may be restarting.
    """
    import aiohttp

    headers = {"Accept": "text/event-stream", **_auth(api_key)}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url.rstrip("/") + DASHBOARD_PATH + "/events", headers=headers) as resp,
        ):
            _check_status(resp.status, url, api_key)
            if resp.content_type != "text/event-stream":
                raise TopError(
                    _not_a_gateway(url, "/events", f"{resp.content_type}, not an event stream")
                )
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while (end := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:end], buf[end + 2 :]
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            yield _parsed(line[5:], url, "/events")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _Gone(_why(exc)) from None


async def _snapshot(url: str, api_key: str | None) -> dict[str, Any]:
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
            session.get(
                url.rstrip("/") + DASHBOARD_PATH + "/snapshot", headers=_auth(api_key)
            ) as resp,
        ):
            _check_status(resp.status, url, api_key)
            return _parsed(await resp.read(), url, "/snapshot")
    except _Gone as exc:  # a 5xx
        raise TopError(f"cannot read {url}: {exc}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TopError(f"cannot read {url}: {_why(exc)}") from None


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _why(exc: Exception) -> str:
    """A failed or broken connection in words (aiohttp's own text can be a bare URL)."""
    import aiohttp

    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the connection broke off mid-stream"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, TimeoutError):
        return "no answer within the timeout"
    return str(exc) or type(exc).__name__


def _not_a_gateway(url: str, route: str, what: str) -> str:
    return f"{url} is not a prefixrouter gateway: {DASHBOARD_PATH}{route} answered {what}"


def _parsed(raw: bytes, url: str, route: str) -> dict[str, Any]:
    """A snapshot from its JSON, checked to be the dashboard's (any web server answers 200)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise TopError(_not_a_gateway(url, route, "something that is not JSON")) from None
    if not (
        isinstance(data, dict)
        and all(key in data for key in SNAPSHOT_KEYS)
        and isinstance(data["gateway"], dict)
    ):
        raise TopError(_not_a_gateway(url, route, "JSON that is not a dashboard snapshot"))
    return data


def _render(snap: dict[str, Any], url: str) -> RenderableType:
    """:func:`render`, a snapshot it cannot read (another version's) one error, not a traceback."""
    try:
        return render(snap)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise TopError(
            f"{url} sent a dashboard snapshot this top cannot read "
            f"({type(exc).__name__}: {exc}): is the gateway another prefixrouter version?"
        ) from None


def _check_status(status: int, url: str, api_key: str | None) -> None:
    # The dashboard answers 401 for a missing and for a wrong key alike (as /admin/* does).
    if status == 401 and api_key:
        raise TopError(
            f"{url} refused the admin API key given (--api-key or {ADMIN_KEY_ENV}): "
            "it is not the gateway's server.admin_api_key"
        )
    if status == 401:
        raise TopError(
            f"{url} refused the dashboard without its admin API key: pass --api-key or set "
            f"{ADMIN_KEY_ENV}"
        )
    if status == 404:
        raise TopError(f"{url} has no {DASHBOARD_PATH}: is it a prefixrouter gateway?")
    if status >= 500:  # a proxy in front of a gateway that is restarting, say
        raise _Gone(f"HTTP {status}")
    if status != 200:
        raise TopError(f"{url}{DASHBOARD_PATH}: HTTP {status}")


async def _snapshots(
    url: str, api_key: str | None, say: Callable[[str], None], retry_s: float
) -> AsyncGenerator[dict[str, Any]]:
    """Every snapshot of the live view, across the gateway's restarts.

    Once the gateway has sent a snapshot, a stream that ends (a gateway
    stopping ends it cleanly) or breaks (a killed one) is tried again every
    ``retry_s`` until it is back or Ctrl-C: ``say`` gets one line when it
    goes away and one when it is back, not one per try. Before the first
    snapshot a failure is an error: a wrong ``--url`` fails at once.
    """
    seen = False
    away = False
    while True:
        try:
            async with aclosing(_events(url, api_key)) as events:
                async for snap in events:
                    if away:
                        say(f"the gateway at {url} is back")
                        away = False
                    seen = True
                    yield snap
            why = "it ended the stream"
        except _Gone as exc:
            why = str(exc)
        if not seen:
            raise TopError(f"cannot read {url}: {why}")
        if not away:
            say(
                f"the gateway at {url} went away ({why}); retrying every {retry_s:g} s "
                "until it is back (Ctrl-C to stop)"
            )
            away = True
        await asyncio.sleep(retry_s)


async def run_top(
    url: str,
    api_key: str | None,
    iterations: int | None,
    console: Console,
    *,
    notes: Console | None = None,
    retry_s: float = RETRY_S,
) -> int:
    """Show the live view until interrupted or after ``iterations`` snapshots; returns how many.

    ``notes`` gets the lines that say the gateway went away and came back
    (default: stderr); on a terminal they are printed above the view instead,
    where rich's ``Live`` keeps its place.
    """
    shown = 0
    if console.is_terminal:
        with Live(console=console, auto_refresh=False, screen=False) as live:

            def above(line: str) -> None:
                live.console.print(line, markup=False, highlight=False)

            async with aclosing(_snapshots(url, api_key, above, retry_s)) as snaps:
                async for snap in snaps:
                    live.update(_render(snap, url), refresh=True)
                    shown += 1
                    if iterations is not None and shown >= iterations:
                        break
    else:
        err = notes if notes is not None else Console(stderr=True)

        def note(line: str) -> None:
            err.print(line, markup=False, highlight=False, soft_wrap=True)

        async with aclosing(_snapshots(url, api_key, note, retry_s)) as snaps:
            async for snap in snaps:
                console.print(_render(snap, url))
                console.print()
                shown += 1
                if iterations is not None and shown >= iterations:
                    break
    return shown


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a gateway's base URL (``http[s]://HOST[:PORT][/PATH]``), or None.

    Checked before connecting: aiohttp's own error for a bad URL is the URL alone.
    """
    why = address_problem(url, ("http", "https"))
    if why is None:
        return None
    return f"must be http(s)://HOST:PORT, e.g. http://127.0.0.1:8080: it {why}"


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
    """The dashboard's live view in the terminal (reads GET /dashboard/events).

    If the gateway stops or restarts while the view runs, it says so and
    reconnects (every second) until the gateway is back or Ctrl-C.
    """
    from prefixrouter.terminal import fail

    if (why := url_problem(url)) is not None:
        raise fail(f"--url {url!r}: {why}")
    console = Console(width=None if sys.stdout.isatty() else 170)
    try:
        if once:
            snap = asyncio.run(_snapshot(url, api_key))
            console.print(_render(snap, url))
        else:
            asyncio.run(run_top(url, api_key, iterations, console))
    except TopError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        pass
