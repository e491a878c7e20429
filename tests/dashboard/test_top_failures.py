"""``prefixrouter top`` when the gateway goes away or the URL is not a gateway's.

The gateway here is a stand-in (an aiohttp or ``http.server`` app on loopback)
that serves a real snapshot, taken once from the live gateway of
``conftest.live``: it can be stopped and started again on the same port, and
made to answer as a web server that is no gateway does.
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from aiohttp import web
from rich.console import Console
from typer.testing import CliRunner

from prefixrouter.cli import app
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.gateway.dashboard.feed import sse_event
from prefixrouter.gateway.dashboard.top import _snapshot, run_top
from prefixrouter.harness.ports import HOST, free_port
from tests.dashboard.conftest import Live


@pytest.fixture(scope="module")
def snap(live: Live) -> dict[str, Any]:
    """A real snapshot of the live gateway's dashboard."""
    return asyncio.run(_snapshot(live.url, live.key))


async def _gateway(
    port: int, snap: dict[str, Any], gone: asyncio.Event, kill: bool
) -> web.AppRunner:
    """A stand-in gateway's event stream: a tick every 50 ms until ``gone`` is set.

    Then the stream ends as a gateway stopped with SIGTERM ends it (cleanly),
    or, with ``kill``, breaks off mid-body as a gateway killed with SIGKILL.
    """

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while not gone.is_set():
                await resp.write(sse_event("tick", snap))
                await asyncio.sleep(0.05)
        except ConnectionError:  # top had all it wanted and left
            return resp
        if kill and request.transport is not None:
            request.transport.abort()
        return resp

    application = web.Application()
    application.router.add_get("/dashboard/events", events)
    runner = web.AppRunner(application, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, HOST, port).start()
    return runner


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kill", [False, True], ids=["stopped", "killed"])
def test_top_says_the_gateway_went_away_and_reconnects_when_it_is_back(
    snap: dict[str, Any], kill: bool
) -> None:
    out, notes = io.StringIO(), io.StringIO()
    port = free_port()
    url = f"http://{HOST}:{port}"

    async def scenario() -> int:
        gone = asyncio.Event()
        first = await _gateway(port, snap, gone, kill)
        view = asyncio.create_task(
            run_top(
                url,
                None,
                6,
                Console(file=out, width=170),
                notes=Console(file=notes, width=400),
                retry_s=0.1,
            )
        )
        await _until(lambda: out.getvalue().count("prefixrouter top") >= 2)
        for site in list(first.sites):  # stop listening first: no reconnection to this one
            await site.stop()
        gone.set()
        await _until(lambda: "went away" in notes.getvalue())
        await first.cleanup()
        await asyncio.sleep(0.5)  # several refused tries, all silent
        assert not view.done()
        back = await _gateway(port, snap, asyncio.Event(), kill=False)
        try:
            return await asyncio.wait_for(view, 15)
        finally:
            await back.cleanup()

    assert asyncio.run(scenario()) == 6
    said = notes.getvalue()
    assert said.count("went away") == 1, said  # one line for the outage, not one per try
    assert f"the gateway at {url} went away" in said and "retrying every 0.1 s" in said, said
    assert said.count(f"the gateway at {url} is back") == 1, said
    assert "Traceback" not in said and "TransferEncodingError" not in said, said


def test_a_gateway_that_cannot_be_reached_at_start_is_an_error_not_a_wait() -> None:
    url = f"http://{HOST}:{free_port()}"
    out = CliRunner().invoke(app, ["top", "--url", url, "--iterations", "1"])
    assert out.exit_code == 2 and "cannot read" in out.output, out.output


@contextmanager
def _web_server(answers: dict[str, tuple[str, bytes]]) -> Iterator[str]:
    """A web server that is no gateway: ``path -> (content type, body)``, 200 for every GET."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ctype, body = answers.get(self.path, ("text/html", b"<html>hello</html>"))
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((HOST, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


OTHER_JSON = b'{"status": "ok"}'


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("answers", "mode"),
    [
        ({}, "--once"),  # HTML everywhere (a single-page app, a default web server)
        ({}, "live"),
        ({"/dashboard/snapshot": ("application/json", OTHER_JSON)}, "--once"),
        ({"/dashboard/events": ("application/json", OTHER_JSON)}, "live"),
        ({"/dashboard/events": ("text/event-stream", b"data: " + OTHER_JSON + b"\n\n")}, "live"),
        ({"/dashboard/snapshot": ("application/json", b"[1, 2]")}, "--once"),
    ],
    ids=["html-once", "html-live", "json-once", "json-live", "sse-json-live", "json-list-once"],
)
def test_a_server_that_is_not_a_gateway_is_one_error_line(
    answers: dict[str, tuple[str, bytes]], mode: str
) -> None:
    with _web_server(answers) as url:
        args = ["--once"] if mode == "--once" else ["--iterations", "2"]
        out = CliRunner().invoke(app, ["top", "--url", url, *args], env={ADMIN_KEY_ENV: ""})
    assert out.exit_code == 2, (out.output, out.exception)
    assert f"error: {url} is not a prefixrouter gateway" in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1, out.output


@pytest.mark.parametrize(
    "url",
    ["127.0.0.1:8080", "localhost:8080", "not-a-url", "ftp://x", "http://127.0.0.1:99999",
     "http://[::1", "http://", "http://127.0.0.1:0", "http://127.0.0.1:8080/?x=1"],
)  # fmt: skip
def test_a_bad_url_says_what_a_url_must_be_before_connecting(url: str) -> None:
    for args in (["--once"], []):
        out = CliRunner().invoke(app, ["top", "--url", url, *args])
        assert out.exit_code == 2, out.output
        assert "--url" in out.output and "must be http(s)://HOST:PORT" in out.output, out.output
        assert "cannot read" not in out.output, out.output  # it never tried to connect
