"""``python -m prefixrouter.simulated_engine`` as a real process, and the command's errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import typer
from typer.testing import CliRunner

from prefixrouter.harness.ports import free_port
from prefixrouter.simulated_engine.cli import engine
from tests.simulated_engine.conftest import long_text


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def test_subprocess_serves_and_stops_on_sigterm(tokenizer_cache: str) -> None:
    port = free_port()
    env = {**os.environ, "PREFIXROUTER_CACHE": tokenizer_cache}
    cmd = [sys.executable, "-m", "prefixrouter.simulated_engine", "--port", str(port)]
    cmd += ["--time-scale", "20", "--model", "mini", "--block-size", "32"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1].decode()
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.05)
        body = {"model": "mini", "prompt": "x " * 200, "max_tokens": 4}
        first = _post(base + "/v1/completions", body)
        second = _post(base + "/v1/completions", body)
        assert first["usage"]["completion_tokens"] == 4
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 32 == 0  # the --block-size took effect
        # No --profile: the newcomer default takes the seed's 30,000-token document.
        document = _post(base + "/v1/completions", {**body, "prompt": long_text(8100)})
        assert document["usage"]["prompt_tokens"] >= 30_000
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            assert b'vllm:prefix_cache_hits_total{engine="0",model_name="mini"}' in resp.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode()
    log = err.decode()
    assert f"serving 'mini' on http://127.0.0.1:{port}" in log
    assert "/v1/completions" not in log  # no per-request logging


def test_configuration_errors_exit_2() -> None:
    app = typer.Typer()
    app.command()(engine)
    runner = CliRunner()
    res = runner.invoke(app, ["--port", "0", "--profile", "nope"])
    assert res.exit_code == 2 and "unknown engine profile" in res.output
    res = runner.invoke(app, ["--port", "0", "--max-model-len", "999999"])
    assert res.exit_code == 2 and "max_model_len" in res.output


def test_a_file_that_is_not_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(engine)
    not_json = tmp_path / "passwd"
    not_json.write_text("root:x:0:0:root:/root:/bin/bash\n")
    res = CliRunner().invoke(app, ["--port", "0", "--tokenizer", str(not_json)])
    assert res.exit_code == 2, res.output
    assert f"error: {not_json}: not a tokenizers file" in " ".join(res.output.split())


def test_a_port_in_use_is_one_line_in_the_gateways_words(tokenizer_cache: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PREFIXROUTER_CACHE": tokenizer_cache}
        cmd = [sys.executable, "-m", "prefixrouter.simulated_engine", "--port", str(port)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
