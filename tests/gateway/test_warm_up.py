"""Proactive copies through the gateway: a hot document is copied by the router's own request.

Real HTTP on loopback: three ``python -m prefixrouter.simulated_engine``
processes behind ``python -m prefixrouter.gateway`` with
``policy.params.proactive_copy``. A document is asked once, then by a burst
of concurrent questions: the hot-prefix rule calls for another replica, and
the gateway sends the copy itself (``max_tokens`` 1, not streamed), counted
in ``prefixrouter_warm_ups_total`` and never as a user request. Processes are
started on free ports and stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from prefixrouter.gateway.request_builder import BuiltRequest
from prefixrouter.gateway.warm_up import warm_up_body
from prefixrouter.harness.processes import Fleet, Server
from tests.cluster.live import metric
from tests.gateway.served import engines_behind_gateway

DOC = " ".join(
    f"clause {i}: the supplier shall deliver lot {i * 7} by day {i % 28}." for i in range(600)
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("warm-up")
    settings = {
        "policy": {"params": {"proactive_copy": True}},
        "metrics_poll": {"interval_s": 0.5},
    }
    with Fleet() as fleet:
        _, gw = engines_behind_gateway(fleet, tmp / "gw.yaml", settings, engines=3)
        yield gw


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same fleet, with copies allowed a thousandth of each worker's time."""
    tmp = tmp_path_factory.mktemp("warm-up-budget")
    params = {"proactive_copy": True, "copy_budget_share": 0.001, "copy_budget_window_s": 1.0}
    settings = {"policy": {"params": params}, "metrics_poll": {"interval_s": 0.5}}
    with Fleet() as fleet:
        _, gw = engines_behind_gateway(fleet, tmp / "gw.yaml", settings, engines=3)
        yield gw


def _body(question: int, max_tokens: int, doc: str = DOC) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{doc}\n\nQuestion {question}: which lot?"}],
        "max_tokens": max_tokens,
    }


async def _ask(
    s: aiohttp.ClientSession, url: str, question: int, max_tokens: int, doc: str = DOC
) -> int:
    async with s.post(url + "/v1/chat/completions", json=_body(question, max_tokens, doc)) as r:
        await r.read()
        return r.status


async def _hot_waves(
    url: str, docs: tuple[str, ...] = (DOC,)
) -> tuple[list[int], dict[str, float], float]:
    """Each document once, then three bursts of questions; the copies' outcomes."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        statuses = []
        for doc in docs:
            assert await _ask(s, url, 0, 8, doc) == 200  # settled on one engine
            for wave in range(3):  # bursts of concurrent questions: the document is hot
                statuses += await asyncio.gather(
                    *(_ask(s, url, 100 * wave + k, 64, doc) for k in range(24))
                )

        for _ in range(100):  # the copies answer in the background
            if await metric(url, "prefixrouter_warm_ups_total", {"outcome": "ok"}):
                break
            await asyncio.sleep(0.1)
        outcomes = {
            o: await metric(url, "prefixrouter_warm_ups_total", {"outcome": o})
            for o in ("ok", "error", "skipped", "over_budget")
        }
        users = await metric(url, "prefixrouter_requests_total")
    return statuses, outcomes, users


def test_a_hot_document_is_copied_by_the_routers_own_prefill_only_request(gateway: Server) -> None:
    statuses, outcomes, users = asyncio.run(_hot_waves(gateway.url))
    assert statuses == [200] * 72
    assert outcomes["ok"] >= 1 and outcomes["error"] == 0, outcomes
    assert users == 73  # the copies are not user requests


def test_copies_past_the_budget_are_refused_and_counted(budgeted: Server) -> None:
    # Two hot documents on three engines: some engine is asked for a copy of
    # each. A thousandth of its time: the first copy goes (into debt), the
    # second finds the budget spent.
    other = DOC.replace("supplier", "carrier").replace("deliver", "collect")
    statuses, outcomes, users = asyncio.run(_hot_waves(budgeted.url, (DOC, other)))
    assert statuses == [200] * 144 and users == 146
    assert outcomes["ok"] >= 1 and outcomes["error"] == 0
    assert outcomes["over_budget"] >= 1, outcomes


def test_the_copys_body_asks_for_one_token_of_one_answer_unstreamed() -> None:
    body = {**_body(1, 500), "stream": True, "stream_options": {"include_usage": True}, "n": 3,
            "max_completion_tokens": 900, "temperature": 0.2}  # fmt: skip
    built = BuiltRequest.__new__(BuiltRequest)
    built.body = body
    copy = orjson.loads(warm_up_body(built, None))
    assert copy["max_tokens"] == 1 and copy["stream"] is False
    assert not {"stream_options", "n", "max_completion_tokens"} & copy.keys()
    assert copy["messages"] == body["messages"] and copy["temperature"] == 0.2
    assert orjson.loads(warm_up_body(built, "s3cret"))["cache_salt"] == "s3cret"
