"""The vLLM fleet launcher without vLLM: command lines, paths, and process handling.

A fake "venv" whose python runs a tiny HTTP server (``/health``,
``/reset_prefix_cache``) stands in for vLLM, so starting, waiting, restarting,
killing and stopping (the whole process group, children included) are checked
in the default test run; the real engines are exercised by ``pytest -m vllm``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.real_engines.vllm_fleet import (
    KvEventsOptions,
    VllmFleet,
    VllmOptions,
    VllmSetup,
    engine_command,
    sync_tokenizer,
    vllm_setup,
)
from prefixrouter.tokenization import CHAT_TEMPLATE_JINJA

FAKE_SERVER = textwrap.dedent(
    """
    import subprocess, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port = int(sys.argv[sys.argv.index("--port") + 1])
    # A child in the same process group, like vLLM's engine core.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[sys.argv.index("--model") + 1] + "/child.pid", "a") as f:
        f.write(f"{child.pid}\\n")

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status):
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_GET(self):
            self._reply(200 if self.path == "/health" else 404)

        def do_POST(self):
            self._reply(200 if self.path == "/reset_prefix_cache" else 404)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_setup(tmp_path: Path) -> VllmSetup:
    venv, model = tmp_path / "venv", tmp_path / "model"
    (venv / "bin").mkdir(parents=True)
    model.mkdir()
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    python = venv / "bin" / "python"
    # `python -m vllm.entrypoints.openai.api_server ARGS` -> the fake server with ARGS.
    python.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{server}" "$@"\n')
    python.chmod(0o755)
    return VllmSetup(venv=venv, model=model)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_engine_command_flags_and_env(tmp_path: Path) -> None:
    setup = VllmSetup(venv=tmp_path / "v", model=tmp_path / "m")
    events = KvEventsOptions("tcp://127.0.0.1:5557", topic="kv@{port}", replay=True)
    options = VllmOptions(
        max_model_len=2016, num_gpu_blocks_override=64, enable_scale_out=True, kv_events=events
    )
    argv, env, topic, replay = engine_command(
        setup, options, port=8123, index=1, core=1, replay_port=9001
    )
    if argv[0] == "taskset":
        assert argv[:3] == ["taskset", "-c", "1"]
        argv = argv[3:]
    assert argv[:3] == [str(setup.python), "-m", "vllm.entrypoints.openai.api_server"]
    flat = " ".join(argv)
    for flag in (
        "--host 127.0.0.1",
        "--port 8123",
        "--served-model-name tiny",
        "--dtype bfloat16",
        "--max-model-len 2016",
        "--block-size 32",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--num-gpu-blocks-override 64",
        "--enable-scale-out",
    ):
        assert flag in flat
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557",
        "topic": "kv@8123",
        "replay_endpoint": "tcp://127.0.0.1:9001",
    }
    assert (topic, replay) == ("kv@8123", "tcp://127.0.0.1:9001")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_LOOPBACK_IP"] == "127.0.0.1"

    # No router endpoint: the engine binds its own publisher, as vLLM does for "*".
    binds = VllmOptions(kv_events=KvEventsOptions(topic="kv@{index}"))
    argv3, _, topic3, replay3 = engine_command(
        setup, binds, port=8124, index=2, core=None, publisher_port=9100
    )
    config = json.loads(argv3[argv3.index("--kv-events-config") + 1])
    assert config["endpoint"] == "tcp://*:9100" and config["topic"] == "kv@2"
    assert (topic3, replay3) == ("kv@2", None) and "replay_endpoint" not in config

    plain, env2, topic2, _ = engine_command(setup, VllmOptions(), port=1, index=0, core=None)
    assert plain[0] != "taskset" and "--kv-events-config" not in plain and topic2 is None
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env2


def test_setup_paths_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXROUTER_VLLM_VENV", raising=False)
    monkeypatch.setenv("PREFIXROUTER_TINY_MODEL", str(tmp_path / "model"))
    setup = vllm_setup(tmp_path / "repo")
    assert setup.venv == tmp_path / "repo" / ".venvs" / "vllm"
    assert setup.model == tmp_path / "model"
    assert not setup.is_ready()


def test_sync_tokenizer_writes_only_what_differs(tmp_path: Path) -> None:
    assert sorted(sync_tokenizer(tmp_path)) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE_JINJA
    assert sync_tokenizer(tmp_path) == []


def test_fleet_starts_restarts_and_stops_process_groups(fake_setup: VllmSetup) -> None:
    children = fake_setup.model / "child.pid"
    with VllmFleet(2, VllmOptions(startup_timeout_s=30), setup=fake_setup) as fleet:
        first, second = fleet.start()
        assert len(set(fleet.urls)) == 2
        asyncio.run(reset_prefix_caches([first.url], drain_timeout_s=None, announce=False))
        assert "--port" in first.log_path.read_text()  # the command heads the log

        fleet.kill(second)  # a crash: the whole group dies
        assert not second.alive()
        again = fleet.restart(second)
        assert (again.index, again.port) == (second.index, second.port)
        assert [e.index for e in fleet.engines] == [0, 1]
        pids = [e.pid for e in fleet.engines]
    for pid in pids + [int(p) for p in children.read_text().split()]:
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), pid


def test_wait_healthy_reports_an_engine_that_exits(fake_setup: VllmSetup) -> None:
    (fake_setup.venv / "bin" / "python").write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    with VllmFleet(1, VllmOptions(startup_timeout_s=10), setup=fake_setup) as fleet:
        with pytest.raises(RuntimeError, match="exited with 3") as info:
            fleet.start()
        assert "boom" in str(info.value)
