"""``prefixrouter top`` against the live gateway (``conftest.live``), for a bounded time.

It reads the dashboard's stream for two snapshots (``--iterations 2``) or one
(``--once``) and must name every worker and show the figures; a refused key
and an unreachable gateway are one line on stderr and status 2.
"""

from __future__ import annotations

import asyncio
import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from prefixrouter.cli import app
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.gateway.dashboard.top import run_top
from prefixrouter.harness.ports import free_port
from tests.dashboard.conftest import Live
from tests.dashboard.traffic import send


@pytest.mark.timeout(60)
def test_top_names_the_workers_and_shows_the_figures(live: Live) -> None:
    runner = CliRunner()
    # One snapshot first: it names the workers, and makes the dashboard's feed work
    # (it counts only while someone watches) for the traffic that follows.
    once = runner.invoke(app, ["top", "--url", live.url, "--once", "--api-key", live.key])
    assert once.exit_code == 0, once.output
    assert once.output.count("prefixrouter top") == 1
    assert all(w in once.output for w in live.workers), once.output
    assert asyncio.run(send(live.url, rounds=2, unique=2, seed=3)) == 8
    result = runner.invoke(
        app, ["top", "--url", live.url, "--iterations", "2"], env={ADMIN_KEY_ENV: live.key}
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.count("prefixrouter top") == 2  # two snapshots, printed in turn (not a tty)
    for worker in live.workers:
        assert re.search(rf"\b{worker}\b.*healthy", out), out
    assert re.search(r"cached share \(60 s\) \d+\.\d %", out), out
    assert "by prefix class, last 60 s" in out and "document" in out, out
    assert re.search(r"\d+\.\d ms", out), out  # a TTFT
    assert "newest decisions" in out and "exact" in out, out
    assert "drift no alarm" in out, out


@pytest.mark.timeout(60)
def test_on_a_terminal_top_redraws_in_place(live: Live) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=170)
    shown = asyncio.run(run_top(live.url, live.key, 2, console))
    assert shown == 2
    text = out.getvalue()
    assert "\x1b[" in text  # cursor movement: rich's Live redraws the view
    assert all(w in text for w in live.workers)


def test_top_says_what_is_wrong_in_one_line(live: Live) -> None:
    runner = CliRunner()
    refused = runner.invoke(app, ["top", "--url", live.url, "--once"], env={ADMIN_KEY_ENV: ""})
    assert refused.exit_code == 2
    assert "admin API key" in refused.output and ADMIN_KEY_ENV in refused.output
    assert "Traceback" not in refused.output
    # A key that is given but wrong (the gateway answers 401 as for none) is named as such.
    wrong = runner.invoke(app, ["top", "--url", live.url, "--once", "--api-key", "not-the-key"])
    assert wrong.exit_code == 2
    assert "refused the admin API key given" in wrong.output, wrong.output
    assert "without" not in wrong.output, wrong.output
    gone = runner.invoke(app, ["top", "--url", f"http://127.0.0.1:{free_port()}", "--once"])
    assert gone.exit_code == 2
    assert "cannot read" in gone.output and "Traceback" not in gone.output
