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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.harness.processes import Fleet
from tests.core.test_text_estimate import SYSTEM, documents
from tests.gateway.served import engines_behind_gateway

ROUNDS = 3


@dataclass
class Gateway:
    url: str
    log: Path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("text-estimate")
    with Fleet() as fleet:
        log = tmp / "decisions.jsonl"
        settings = {  # routing mode: the default, text
            "metrics_poll": {"interval_s": 0.5},
            "decision_log": {"path": str(log), "flush_interval_s": 0.1},
        }
        _, gw = engines_behind_gateway(fleet, tmp / "gateway.yaml", settings)
        yield Gateway(gw.url, log)


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
