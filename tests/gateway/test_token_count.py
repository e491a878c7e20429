"""Text mode asks the engine to count a new document's tokens: its next requests predict right.

Real HTTP on loopback: two ``python -m prefixrouter.simulated_engine``
processes (the project's BPE tokenizer counts the prompt, and serves vLLM's
``POST /tokenize``) behind two ``python -m prefixrouter.gateway`` processes in
text mode, one with ``routing.token_count`` (the default) and one without.
For documents of four kinds (prose, source code, numbers, CJK: 3.3 to 0.33
characters per token), a long first request is sent, and a second one about
the same document while the first is still decoding: its answer, the first
that could teach the estimate, has not come back. With the count, the second
request's predicted cached tokens are within 5 % of the engine's; without it,
they are converted at the 4.0 prior, and off by more than that for each
kind. Processes are started on free ports and stopped by PID; every wait is
bounded.
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
from tests.cluster.live import metric
from tests.core.test_text_estimate import documents
from tests.gateway.served import engines_behind_gateway
from tests.gateway.test_text_estimate import _log_records

COUNTED, OK = "prefixrouter_token_counts_total", {"outcome": "ok"}
LONG_ANSWER = 4000
"""Output tokens of each document's first request: it decodes for about a second."""


@dataclass
class Gateway:
    url: str
    log: Path


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, Gateway]]:
    """Two gateways in text mode on the same two engines: token counts on (True) and off."""
    tmp = tmp_path_factory.mktemp("token-count")
    with Fleet() as fleet:

        def settings(log: Path, count: bool) -> dict[str, Any]:
            return {
                "metrics_poll": {"interval_s": 0.5},
                "decision_log": {"path": str(log), "flush_interval_s": 0.1},
                "routing": {"token_count": count},
            }

        on_log, off_log = tmp / "on.jsonl", tmp / "off.jsonl"
        engines, on = engines_behind_gateway(fleet, tmp / "on.yaml", settings(on_log, True))
        off_config = tmp / "off.yaml"
        workers = [{"url": e.url, "id": e.name} for e in engines]
        off_config.write_bytes(orjson.dumps({"workers": workers, **settings(off_log, False)}))
        off = fleet.start("gateway-off", "prefixrouter.gateway", ["--config", str(off_config)])
        asyncio.run(fleet.wait_healthy([off], timeout_s=30.0))
        yield {True: Gateway(on.url, on_log), False: Gateway(off.url, off_log)}


def _ask_during_first_prefill(gw: Gateway, system: str, count: bool) -> dict[str, tuple[str, int]]:
    """Per document: a long first request, a second while it runs; the second's (id, cached)."""

    def body(doc: str, question: int, max_tokens: int) -> dict[str, Any]:
        return {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{doc}\n\nQuestion {question}?"},
            ],
            "max_tokens": max_tokens,
        }

    async def post(s: aiohttp.ClientSession, b: dict[str, Any]) -> tuple[str, int]:
        async with s.post(gw.url + "/v1/chat/completions", json=b) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
            return resp.headers["X-Request-Id"], usage["prompt_tokens_details"]["cached_tokens"]

    async def run() -> dict[str, tuple[str, int]]:
        out = {}
        async with aiohttp.ClientSession() as s:
            for n, (kind, doc) in enumerate(documents().items()):
                first = asyncio.create_task(post(s, body(doc, 0, LONG_ANSWER)))
                if count:  # until this document's count came back (bounded)
                    end = time.monotonic() + 10
                    while await metric(gw.url, COUNTED, OK) < n + 1 and time.monotonic() < end:
                        await asyncio.sleep(0.02)
                else:  # until the first request's prefill is done (the engine holds it)
                    await asyncio.sleep(0.3)
                second = await post(s, body(doc, 1, 1))
                assert not first.done(), kind  # no answer for this document has come back
                await first
                out[kind] = second
        return out

    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("count", [True, False], ids=["token-count", "no-token-count"])
def test_request_during_first_prefill_predicted(gateways: dict[bool, Gateway], count: bool) -> None:
    gw = gateways[count]
    # Each gateway its own system prompt: the engines share none of its prefixes.
    seconds = _ask_during_first_prefill(gw, f"Answer from the document ({count}).\n\n", count)
    records = _log_records(gw.log, {rid for rid, _ in seconds.values()})
    for kind, (rid, cached) in seconds.items():
        rec = records[rid]
        assert rec["actual_cached_tokens"] == cached
        assert cached > 5_000, (kind, cached)  # the document was reused
        error = abs(rec["predicted_cached_tokens"] - cached) / cached
        if count:
            assert error <= 0.05, (kind, rec["predicted_cached_tokens"], cached)
        else:  # at the global estimate: the 4.0 prior, then the earlier kinds' mean
            assert error > 0.05, (kind, rec["predicted_cached_tokens"], cached)
