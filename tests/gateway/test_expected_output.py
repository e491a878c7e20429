"""The gateway learns how much of ``max_tokens`` answers decode, from the engine's usage.

Real HTTP on loopback: two ``python -m prefixrouter.simulated_engine``
processes whose answers end on their own after ``ANSWER`` tokens
(``--answer-tokens``: ``finish_reason`` ``stop``, as a model's end of
sequence) behind ``python -m prefixrouter.gateway``. A client sends
``max_tokens`` 2,000 as a cap. The first request is expected to decode at
most the first guess (512 tokens: no answer has come back); once answers did,
a request is expected to decode what they decoded, streamed or not (a stream
is asked for its usage chunk). The decision log shows the expectation.
Processes are started on free ports and stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.core.output import DEFAULT_FIRST_GUESS_TOKENS
from prefixrouter.harness.processes import Fleet
from tests.gateway.served import engines_behind_gateway
from tests.gateway.test_text_estimate import Gateway, _log_records

ANSWER = 24
CAP = 2_000


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("expected-output")
    log = tmp / "decisions.jsonl"
    settings = {"decision_log": {"path": str(log), "flush_interval_s": 0.1}}
    with Fleet() as fleet:
        _, gw = engines_behind_gateway(
            fleet, tmp / "gw.yaml", settings, engine_args=("--answer-tokens", str(ANSWER))
        )
        yield Gateway(gw.url, log)


async def _ask(
    url: str, topic: str, *, stream: bool, cap: int | None = CAP
) -> tuple[str, int, str]:
    """One chat request with ``max_tokens`` ``cap`` (None: no such field): its id
    (the gateway's), completion tokens and finish reason."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Say something about {topic}."}],
        "stream": stream,
    }
    if cap is not None:
        body["max_tokens"] = cap
    if stream:
        body["stream_options"] = {"include_usage": True}
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(f"{url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        rid = r.headers["X-Request-Id"]
        if not stream:
            data = await r.json()
            return rid, data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]
        tokens, reason = 0, ""
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices", []):
                reason = choice.get("finish_reason") or reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return rid, tokens, reason


def test_a_cap_is_not_taken_for_the_answers_length_once_answers_came_back(
    gateway: Gateway,
) -> None:
    first, *answer = asyncio.run(_ask(gateway.url, "first", stream=False))
    assert answer == [ANSWER, "stop"]  # the engine ended the answer on its own
    later, *answer = asyncio.run(_ask(gateway.url, "later", stream=False))
    assert answer == [ANSWER, "stop"]
    streamed, *answer = asyncio.run(_ask(gateway.url, "streamed", stream=True))
    assert answer == [ANSWER, "stop"]
    records = _log_records(gateway.log, {first, later, streamed})
    expected = [records[rid]["expected_output_tokens"] for rid in (first, later, streamed)]
    assert expected == [DEFAULT_FIRST_GUESS_TOKENS, ANSWER, ANSWER]


UNCAPPED_ANSWER = 600  # beyond the first guess, and beyond any small nominal cap


@pytest.fixture(scope="module")
def uncapped_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Engines that decode up to 4,000 tokens when a request sets no cap, and whose
    answers end after UNCAPPED_ANSWER."""
    tmp = tmp_path_factory.mktemp("expected-output-uncapped")
    log = tmp / "decisions.jsonl"
    settings = {"decision_log": {"path": str(log), "flush_interval_s": 0.1}}
    args = ("--answer-tokens", str(UNCAPPED_ANSWER), "--default-max-tokens", "4000")
    with Fleet() as fleet:
        _, gw = engines_behind_gateway(fleet, tmp / "gw.yaml", settings, engine_args=args)
        yield Gateway(gw.url, log)


def test_requests_without_a_cap_expect_what_their_answers_decoded(
    uncapped_gateway: Gateway,
) -> None:
    """No ``max_tokens``: the engine decodes to the answer's end. The gateway learns
    that length itself (it once took 256 for such a request, and read any longer
    answer as 256)."""
    url = uncapped_gateway.url
    first, *answer = asyncio.run(_ask(url, "first", stream=False, cap=None))
    assert answer == [UNCAPPED_ANSWER, "stop"]
    later, *answer = asyncio.run(_ask(url, "later", stream=True, cap=None))
    assert answer == [UNCAPPED_ANSWER, "stop"]
    records = _log_records(uncapped_gateway.log, {first, later})
    expected = [records[rid]["expected_output_tokens"] for rid in (first, later)]
    assert expected == [DEFAULT_FIRST_GUESS_TOKENS, UNCAPPED_ANSWER]
