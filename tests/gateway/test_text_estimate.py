"""Text mode end to end: the second question about a document is predicted within 5 %.

Real HTTP on loopback: two ``python -m prefixrouter.simulated_engine``
processes (the project's BPE tokenizer counts the prompt, its prefix cache
reports ``prompt_tokens_details.cached_tokens``) behind ``python -m
prefixrouter.gateway`` in its default text mode, with a decision log. Four
documents of different kinds (prose, source code, numbers, CJK: 3.3 to 0.33
characters per token) are asked about in turn; the log's predicted cached
tokens of every request after a document's first are within 5 % of the
engine's, and each document keeps one prefix key. Processes are started on
free ports and stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Server, stop_process
from tests.core.test_text_estimate import SYSTEM, documents

PY = sys.executable
ROUNDS = 3


@dataclass
class Gateway:
    url: str
    log: Path


def _wait_up(name: str, url: str, proc: subprocess.Popen[bytes]) -> None:
    wait_healthy([Server(name, int(url.rsplit(":", 1)[1]), proc)], timeout_s=30.0)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("text-estimate")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        engines = []
        for i in range(2):
            port = free_port()
            cmd = [PY, "-m", "prefixrouter.simulated_engine", "--port", str(port),
                   "--profile", "tiny-cpu", "--time-scale", "20", "--model", "tiny",
                   "--kv-blocks", "8192"]  # fmt: skip
            procs[f"e{i}"] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
            )
            engines.append(f"http://127.0.0.1:{port}")
        for i, url in enumerate(engines):
            _wait_up(f"e{i}", url, procs[f"e{i}"])
        log = tmp / "decisions.jsonl"
        cfg = tmp / "gateway.yaml"
        cfg.write_bytes(
            orjson.dumps(  # JSON is YAML; routing mode: the default, text
                {
                    "workers": [{"url": u, "id": f"e{i}"} for i, u in enumerate(engines)],
                    "metrics_poll": {"interval_s": 0.5},
                    "decision_log": {"path": str(log), "flush_interval_s": 0.1},
                }
            )
        )
        gw = subprocess.Popen(
            [PY, "-m", "prefixrouter.gateway", "--config", str(cfg), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        procs["gateway"] = gw
        assert gw.stdout is not None
        line = gw.stdout.readline().decode()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        _wait_up("gateway", match.group(1), gw)
        yield Gateway(match.group(1), log)
    finally:
        for proc in procs.values():
            stop_process(proc)


def _log_records(log: Path, ids: set[str]) -> dict[str, dict[str, Any]]:
    """The decision log's records of ``ids`` (polled until all are flushed, at most 10 s)."""
    end = time.monotonic() + 10
    found: dict[str, dict[str, Any]] = {}
    while time.monotonic() < end and len(found) < len(ids):
        for line in log.read_bytes().splitlines() if log.exists() else []:
            rec = orjson.loads(line)
            if rec["request_id"] in ids:
                found[rec["request_id"]] = rec
        if len(found) < len(ids):
            time.sleep(0.1)
    return found


def test_second_question_predicted_within_5_percent(gateway: Gateway) -> None:
    docs = documents()

    async def ask_all() -> dict[str, list[tuple[str, int]]]:
        out: dict[str, list[tuple[str, int]]] = {k: [] for k in docs}
        async with aiohttp.ClientSession() as s:
            for r in range(ROUNDS):
                for kind, doc in docs.items():
                    body = {
                        "model": "tiny",
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"{doc}\n\nQuestion {r}: part {r * 7}?"},
                        ],
                        "max_tokens": 4,
                    }
                    async with s.post(gateway.url + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        usage = (await resp.json())["usage"]
                        rid = resp.headers["X-Request-Id"]
                    out[kind].append((rid, usage["prompt_tokens_details"]["cached_tokens"]))
        return out

    answers = asyncio.run(asyncio.wait_for(ask_all(), 60))
    records = _log_records(gateway.log, {rid for seen in answers.values() for rid, _ in seen})
    keys: dict[str, set[str]] = {}
    for kind, seen in answers.items():
        for r, (rid, cached) in enumerate(seen):
            rec = records[rid]
            assert rec["actual_cached_tokens"] == cached
            keys.setdefault(kind, set()).add(rec["prefix_key"])
            if r == 0:
                continue
            predicted = rec["predicted_cached_tokens"]
            assert cached > 5_000, (kind, r, cached)  # the document was reused
            assert abs(predicted - cached) <= 0.05 * cached, (kind, r, predicted, cached)
    assert all(len(k) == 1 for k in keys.values()), keys  # one key per document
    assert len(set().union(*keys.values())) == len(docs)
