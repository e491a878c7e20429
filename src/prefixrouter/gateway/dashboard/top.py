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

The newest decisions are a rolling list, as on the page (:class:`Newest`): a
tick carries only the decisions sampled in its second, so at a low rate most
ticks carry none; the view keeps the newest ``DECISION_ROWS`` it has seen.

Every string from the gateway (worker, replica and tenant-chosen ids, prefix
classes, reasons) goes to rich as a :class:`~rich.text.Text`, never as markup:
an id such as ``w3[red]x[/red]`` is shown as written, and ``a[/]`` does not
end the view with a markup error.

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
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from prefixrouter.addresses import address_problem
from prefixrouter.errors import PrefixRouterError, exception_text
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.gateway.dashboard.feed import ALL, HITS
from prefixrouter.gateway.dashboard.routes import DASHBOARD_PATH

if TYPE_CHECKING:
    from aiohttp import ClientResponse

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


def _t(value: object) -> Text:
    """A table cell from the gateway's data: literal text, never parsed as rich markup."""
    return Text(str(value))


class Newest:
    """The newest decisions seen, at most ``rows``, newest last: the page's rolling list.

    A ``hello`` (and ``/dashboard/snapshot``) carries ``recent``, the feed's
    newest decisions: it replaces the list (a gateway that restarted starts a
    new one). A ``tick`` carries only its second's sample, added to the list.
    """

    def __init__(self, rows: int = DECISION_ROWS) -> None:
        self._kept: deque[dict[str, Any]] = deque(maxlen=rows)

    def update(self, snap: dict[str, Any]) -> list[dict[str, Any]]:
        """Take in one snapshot's decisions; return the list now."""
        recent = snap.get("recent")
        if recent is not None:
            self._kept.clear()
            self._kept.extend(recent)
        else:
            self._kept.extend(snap.get("decisions") or [])
        return list(self._kept)


def render(
    snap: dict[str, Any], decisions: Iterable[dict[str, Any]] | None = None
) -> RenderableType:
    """One snapshot as rich renderables (pure: the tests read its text).

    ``decisions``: the newest decisions to list (:class:`Newest`); by default
    the snapshot's own (its ``recent``, else its tick's sample).
    """
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
    unrouted = window.get("unrouted")  # None: a gateway from before it was sent
    tiles = Text.assemble(
        "cached share (60 s) ",
        (_pct(_share(all_["cached"], all_["cached"] + all_["uncached"])) if all_ else "–", "bold"),
        " · cached tokens/s ",
        (_num(snap["point"]["classes"].get(ALL, {}).get("cached_per_s")), "bold"),
        " · warm-abandoned ",
        (_pct(_share(all_["abandoned"], all_["n"])) if all_ else "–", "bold"),
        f" · evictions (60 s) {ev['observed']}",
        f" · errors before routing (60 s) {unrouted['total']}" if unrouted else "",
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
        state = w["state"]
        # Green exactly when routable (prefixrouter_worker_healthy); asked-for or passing
        # states yellow; out for failing (down, ejected) red.
        style = (
            "green"
            if w["healthy"]
            else "yellow"
            if state in ("draining", "suspect", "not ready")
            else "red"
        )
        capacity = w.get("index_capacity")
        workers.add_row(
            _t(w["id"]),
            Text(str(state), style=style),
            _t(_num(w["in_flight"])),
            _t(_num(w["queue"])),
            _t(_pct(w["kv_usage"])),
            _t(_pct(w["cached_share"])),
            # The capacity is unknown (None) until the engine reports its KV size.
            _t(f"{w['index_blocks']:,} / " + ("?" if capacity is None else f"{capacity:,}")),
            _t(held or "–"),
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
            _t("all" if cls == ALL else cls),
            _t(_num(a["n"])),
            _t(_pct(_share(a["cached"], a["cached"] + a["uncached"]))),
            *(_t(_num(_mean(a["ttft"][h]), 1) + " ms") for h in HITS),
            _t(_num(a["predicted"])),
            _t(_num(a["actual"])),
            _t(_pct(_share(a["abandoned"], a["n"]))),
            _t(waits or "–"),
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
    newest = list(Newest().update(snap) if decisions is None else decisions)
    if newest:
        table = Table(title="newest decisions (sampled)", title_justify="left")
        for col in ("request", "class", "tier", "worker", "predicted", "actual", "reason"):
            table.add_column(col, justify="right" if col in ("predicted", "actual") else "left")
        for d in newest[-DECISION_ROWS:][::-1]:
            table.add_row(
                _t(str(d["request_id"])[:20]),
                _t(d["prefix_class"]),
                _t(d["tier"]),
                _t(d["selected_worker"]),
                _t(_num(d["predicted_cached_tokens"])),
                _t(_num(d["actual_cached_tokens"])),
                _t(d["reason"]),
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
            _check_status(resp.status, url, api_key, await _said(resp))
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
            _check_status(resp.status, url, api_key, await _said(resp))
            return _parsed(await resp.read(), url, "/snapshot")
    except _Gone as exc:  # a 5xx
        raise TopError(f"cannot read {url}: {exc}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TopError(f"cannot read {url}: {_why(exc)}") from None


async def _said(resp: ClientResponse) -> str | None:
    """A 403's own message (the gateway's says which setting turns the dashboard on), or None.

    Read only for a 403: any other answer's body is the caller's to read.
    """
    import aiohttp

    if resp.status != 403:
        return None
    try:
        message = orjson.loads(await resp.content.read(64 * 1024))["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError, aiohttp.ClientError, TimeoutError):
        return None  # not the gateway's JSON error: the status alone is said
    return message if isinstance(message, str) else None


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


def _render(snap: dict[str, Any], url: str, newest: Newest | None = None) -> RenderableType:
    """:func:`render`, a snapshot it cannot read (another version's) one error, not a traceback.

    ``newest``: the live view's rolling list of decisions, updated with ``snap``'s.
    """
    try:
        return render(snap, None if newest is None else newest.update(snap))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise TopError(
            f"{url} sent a dashboard snapshot this top cannot read "
            f"({exception_text(exc)}): is the gateway another prefixrouter version?"
        ) from None


def _check_status(status: int, url: str, api_key: str | None, said: str | None = None) -> None:
    """Raise for an answer that is not the dashboard's data; ``said``: a 403's message."""
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
    if status == 403:  # no admin key configured: its data is off (routes.DASHBOARD_DISABLED)
        raise TopError(f"{url} refused the dashboard: {said or 'HTTP 403'}")
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
    newest = Newest()
    if console.is_terminal:
        with Live(console=console, auto_refresh=False, screen=False) as live:

            def above(line: str) -> None:
                live.console.print(line, markup=False, highlight=False)

            async with aclosing(_snapshots(url, api_key, above, retry_s)) as snaps:
                async for snap in snaps:
                    live.update(_render(snap, url, newest), refresh=True)
                    shown += 1
                    if iterations is not None and shown >= iterations:
                        break
    else:
        err = notes if notes is not None else Console(stderr=True)

        def note(line: str) -> None:
            err.print(line, markup=False, highlight=False, soft_wrap=True)

        async with aclosing(_snapshots(url, api_key, note, retry_s)) as snaps:
            async for snap in snaps:
                console.print(_render(snap, url, newest))
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
