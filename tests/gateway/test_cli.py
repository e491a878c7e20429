"""``serve`` / ``python -m prefixrouter.gateway``: options, errors, the listening line."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from prefixrouter.gateway.cli import serve


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(serve)
    return app


def test_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers:\n  - url: nope\n")
    result = CliRunner().invoke(_app(), ["--config", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2: workers.0.url" in result.output
    result = CliRunner().invoke(_app(), ["--policy", "nope"])
    assert result.exit_code == 2 and "unknown policy 'nope'" in result.output


def test_a_bad_discover_is_one_line_listing_the_forms() -> None:
    result = CliRunner().invoke(_app(), ["--discover", "k8s:llm"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --discover: 'k8s:llm' is not one of k8s:NAMESPACE/LABEL_SELECTOR[:PORT], "
        "k8s-pool:NAMESPACE/INFERENCEPOOL[:PORT], k8s-service:NAMESPACE/SERVICE[:PORT], static"
    ]


def test_discovery_without_a_kubeconfig_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "kubeconfig"
    args = ["--port", "0", "--discover", "k8s:llm/app=vllm:8000"]
    env = {"KUBECONFIG": str(missing), "KUBERNETES_SERVICE_HOST": ""}  # not in a cluster
    result = CliRunner().invoke(_app(), args, env=env)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: discovery: no kubeconfig ({missing} not found) and not in a cluster "
        "(KUBERNETES_SERVICE_HOST is unset): set discovery.kubeconfig or KUBECONFIG"
    ]


def test_port_in_use_is_one_line_naming_the_address_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "prefixrouter.gateway", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_module_entry_point_serves_ignores_sighup_and_stops_on_sigterm() -> None:
    """SIGHUP (the usual reload signal) is said and ignored; it used to end the process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixrouter.gateway", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        os.kill(proc.pid, signal.SIGHUP)
        for _ in range(3):  # served after the signal too
            with urllib.request.urlopen(match.group(1) + "/v1/models", timeout=5) as r:
                assert r.status == 200
        assert proc.poll() is None
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert b"no workers yet" in err
    assert b"SIGHUP ignored: the gateway does not reload its configuration" in err


def test_public_api() -> None:
    import prefixrouter.gateway as gw

    assert sorted(gw.__all__) == [
        "GatewayState",
        "STATE",
        "build_config",
        "build_state",
        "create_app",
        "run_gateway",
        "serve",
    ]
    for name in gw.__all__:
        assert getattr(gw, name) is not None


@pytest.mark.parametrize(
    ("option", "setting"),
    [("--decision-log", "decision_log.path"), ("--access-log", "access_log.path")],
)
def test_an_unwritable_log_is_refused_at_startup_in_one_line(
    tmp_path: Path, option: str, setting: str
) -> None:
    (tmp_path / "file").write_text("")
    for path in (tmp_path, tmp_path / "file" / "log.jsonl"):  # a folder; under a file
        args = ["--port", "0", "--worker", "http://127.0.0.1:9", option, str(path)]
        result = CliRunner().invoke(_app(), args)
        assert result.exit_code == 2
        last = result.output.strip().splitlines()[-1]
        assert last.startswith(f"error: {setting}: {path}: cannot write: "), last
        assert "Traceback" not in result.output


def test_a_tokenizer_path_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    # The examples' placeholder (/models/tiny), copied as it is: before, a traceback.
    cfg = tmp_path / "gw.yaml"
    missing = tmp_path / "models" / "tiny"
    cfg.write_text(
        "workers: [{url: 'http://127.0.0.1:9'}]\n"
        f"routing: {{mode: token, tokenizer: '{missing}'}}\n"
    )
    result = CliRunner().invoke(_app(), ["--config", str(cfg), "--port", "0"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: routing.tokenizer: {missing}"), last
    assert "cannot read" in last and "Traceback" not in result.output


def test_an_invalid_listen_address_is_named_as_such() -> None:
    result = CliRunner().invoke(_app(), ["--port", "0", "--host", "999.1.1.1"])
    assert result.exit_code == 2
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: cannot listen on 999.1.1.1:0: not a valid address")
    assert "Unknown error" not in last


@pytest.mark.parametrize("level", ["info", "warning"])
def test_the_log_says_info_lines_with_time_and_level(level: str) -> None:
    """Info lines (a worker down) reach stderr by default, timestamped; not at warning."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixrouter.gateway", "--port", "0"]
    cmd += ["--worker", f"http://127.0.0.1:{dead}", "--log-level", level]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.search(rf"^{stamp} WARNING prefixrouter.gateway: worker \S+ unhealthy", err, re.M)
    down = re.search(rf"^{stamp} INFO prefixrouter.gateway: worker \S+ down", err, re.M)
    assert (down is not None) == (level == "info"), err


def test_kv_events_in_text_mode_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    """Events' token blocks never match text mode's prefixes: one warning at start."""
    from prefixrouter.gateway.cli import warn_about
    from prefixrouter.gateway.config import config_from_dict

    events = {"workers": [{"url": "http://127.0.0.1:9"}], "kv_events": {"endpoint": "tcp://*:5557"}}
    warn_about(config_from_dict(events))
    assert "warning: KV events with routing.mode: text" in capsys.readouterr().err
    warn_about(config_from_dict({**events, "routing": {"mode": "token"}}))
    assert "KV events" not in capsys.readouterr().err
