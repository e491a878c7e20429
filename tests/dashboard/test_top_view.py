"""``prefixrouter top`` shows the gateway's strings as written and keeps the newest decisions.

Fake engines and a gateway on loopback (``tests/gateway/helpers.py``), read by
``top`` over HTTP: through the command line (the gateway served from a thread
of its own, :mod:`tests.dashboard.threaded`, as ``top`` runs its own event
loop) and through :func:`run_top` in the gateway's loop.
"""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from prefixrouter.cli import app
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.gateway.dashboard.routes import FEED
from prefixrouter.gateway.dashboard.top import DECISION_ROWS, _snapshot, render, run_top
from prefixrouter.harness.faults import until
from tests.admin_client import ADMIN_KEY
from tests.dashboard.threaded import served_gateway
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import Env, gateway_env, run

# Worker ids that are rich markup (or break it): shown as written, everywhere.
MARKUP_IDS = ["a[/]", "w3[red]x[/red]", "b[bold"]


async def _traffic(env: Env) -> set[str]:
    """Concurrent requests (spread over the workers by their load); the workers that served."""
    replies = await asyncio.gather(*(env.chat(f"question {i} " * 30) for i in range(12)))
    assert all(r.status == 200 for r in replies)
    return {wid for wid, e in zip(env.worker_ids(), env.engines, strict=True) if e.requests}


@pytest.mark.timeout(60)
def test_worker_ids_that_are_rich_markup_are_shown_as_written() -> None:
    options = [{"id": wid} for wid in MARKUP_IDS]
    engines = [FakeEngine(delay_s=0.05) for _ in MARKUP_IDS]  # requests overlap: spread
    with served_gateway(3, worker_options=options, engines=engines) as gw:
        chosen = gw.call(_traffic)
        runner = CliRunner()
        env = {ADMIN_KEY_ENV: ADMIN_KEY, "COLUMNS": "400"}
        once = runner.invoke(app, ["top", "--url", gw.url, "--once"], env=env)
        live = runner.invoke(app, ["top", "--url", gw.url, "--iterations", "1"], env=env)
    for result in (once, live):
        assert result.exit_code == 0, (result.output, result.exception)
        out = result.output
        assert "Traceback" not in out and "MarkupError" not in out, out
        for wid in MARKUP_IDS:
            # In the workers table, and as the chosen worker of its decisions.
            assert out.count(wid) >= (2 if wid in chosen else 1), (wid, out)
    assert chosen, "no worker served"


def test_the_newest_decisions_stay_listed_between_decisions() -> None:
    async def body() -> None:
        async with gateway_env(2) as env:
            out = io.StringIO()
            url = str(env.client.make_url("")).rstrip("/")
            view = asyncio.create_task(run_top(url, ADMIN_KEY, 60, Console(file=out, width=400)))

            def frames() -> list[str]:
                return out.getvalue().split("prefixrouter top")[1:]

            async def shown(n: int) -> bool:
                return len(frames()) >= n

            try:
                await until(lambda: shown(1), "the first frame", 10.0)
                # One request, then none: a rate far below one a second.
                assert (await env.chat("A single question about the night shift.")).status == 200
                rid = str(env.state.decisions.recent(1)[0]["request_id"])[:20]

                async def listed() -> int | None:
                    hits = [i for i, f in enumerate(frames()) if rid in f]
                    return hits[0] + 1 if hits else None  # +1: index 0 is never "missing"

                first = await until(listed, "the decision in a frame", 10.0) - 1
                # Three more ticks, each carrying no decision: it is still listed in each.
                await until(lambda: shown(first + 4), "three more frames", 10.0)
                later = frames()[first : first + 4]
                assert all(rid in f for f in later), later
                assert all("newest decisions" in f for f in later), later
            finally:
                view.cancel()
                await asyncio.gather(view, return_exceptions=True)

    run(body, timeout=40)


def test_once_lists_the_newest_decisions_not_only_the_last_second_s() -> None:
    async def body() -> None:
        async with gateway_env(2) as env:
            for i in range(DECISION_ROWS):
                assert (await env.chat(f"question {i} " * 10)).status == 200
            url = str(env.client.make_url("")).rstrip("/")
            await _snapshot(url, ADMIN_KEY)  # watched from here on
            assert (await env.chat("One more question.")).status == 200
            feed = env.client.app[FEED]

            async def sampled() -> bool:  # the latest tick carries the one decision alone
                return len(feed.latest["decisions"]) == 1

            await until(sampled, "a tick with the one decision", 10.0, 0.01)
            out = io.StringIO()
            Console(file=out, width=400).print(render(await _snapshot(url, ADMIN_KEY)))
            newest = [str(d["request_id"])[:20] for d in env.state.decisions.recent(DECISION_ROWS)]
            assert len(newest) == DECISION_ROWS
            assert all(rid in out.getvalue() for rid in newest), out.getvalue()

    run(body, timeout=30)


@pytest.mark.timeout(60)
def test_without_an_admin_key_top_says_which_setting_turns_the_dashboard_on() -> None:
    with served_gateway(1, overrides={"server": {"admin_api_key": None}}) as gw:
        runner = CliRunner()
        for args in (["--once"], ["--iterations", "1"]):
            result = runner.invoke(app, ["top", "--url", gw.url, *args], env={ADMIN_KEY_ENV: ""})
            assert result.exit_code == 2, result.output
            assert "server.admin_api_key" in result.output, result.output
            assert ADMIN_KEY_ENV in result.output, result.output
            assert "Traceback" not in result.output, result.output
