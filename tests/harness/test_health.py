"""Health waits against real processes: healthy, crashed, and silent until the deadline."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from prefixrouter.harness.health import HealthTimeout, ServerExited, http_status, wait_healthy
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server

# /health answers 200 after a delay (argv[2] seconds), like a server loading a model.
SLOW_SERVER = """
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        ready = time.monotonic() - START > float(sys.argv[2])
        self.send_response(200 if ready and self.path == "/health" else 503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

START = time.monotonic()
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _slow(fleet: Fleet, name: str, delay_s: float, tmp_path: Path) -> Server:
    script = tmp_path / "slow_server.py"
    script.write_text(SLOW_SERVER)
    port = free_port()
    return fleet.start_command(name, [sys.executable, str(script), str(port), str(delay_s)], port)


def test_waits_until_every_server_answers_200(tmp_path: Path) -> None:
    with Fleet() as fleet:
        servers = [_slow(fleet, f"s{i}", 0.5, tmp_path) for i in range(2)]
        asyncio.run(fleet.wait_healthy(servers, timeout_s=20))
        assert all(http_status(s.url + "/health") == 200 for s in fleet.servers)


def test_a_silent_server_times_out_by_name(tmp_path: Path) -> None:
    with Fleet() as fleet:
        server = _slow(fleet, "never-ready", 3600, tmp_path)
        t0 = time.monotonic()
        with pytest.raises(HealthTimeout, match="never-ready did not become healthy in 1 s"):
            wait_healthy([server], timeout_s=1.0)
        assert time.monotonic() - t0 < 10
        assert server.alive()


def test_a_server_that_exits_fails_at_once_with_its_log() -> None:
    with Fleet() as fleet:
        cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
        server = fleet.start_command("crasher", cmd, port=1)
        t0 = time.monotonic()
        with pytest.raises(ServerExited, match=r"crasher exited with 3.*no model here"):
            wait_healthy([server], timeout_s=60)
        assert time.monotonic() - t0 < 30  # not the deadline


def test_http_status_of_nothing_is_none() -> None:
    assert http_status(f"http://127.0.0.1:{free_port()}/health", timeout_s=1) is None
