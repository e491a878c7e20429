"""The picker behind Envoy places requests as the standalone gateway does, with the same reuse.

One workload (four documents, three questions each), run twice on the
same three engines, their prefix caches emptied before each run: through
``python -m prefixrouter.gateway``, then through Envoy and ``prefixrouter
epp``, both fresh and configured alike. Each document's first question is
a long stream held open, so the next cold documents are placed with the
engines before them busy (a load the routers see exactly, unlike timing);
the later questions go one at a time. Both runs place alike (every later
question with its document) and the engines report the same cached share:
the picker runs the gateway's router on the gateway's parse of the same
bodies. Which engine a cold document takes is not compared: near-ties go
by each router's learned calibration of the engines' speed, measured on
its own path (Envoy's hop included).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import orjson

from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.harness.processes import Fleet
from tests.epp.fleet import (
    Answer,
    chat_body,
    client,
    post,
    start_engines,
    start_picker,
    start_proxy,
    wait_up,
    write_config,
)

DOCS = 4
QUESTIONS = 3
JSON = {"Content-Type": "application/json"}


def _waves() -> list[list[str]]:
    docs = [
        f"Report {d}. " + " ".join(f"Item {d}.{i} costs {i * (d + 3)} credits." for i in range(70))
        for d in range(DOCS)
    ]
    return [
        [f"{docs[d]}\n\nQuestion {q} about report {d}?" for d in range(DOCS)]
        for q in range(QUESTIONS)
    ]


def _share(answers: list[Answer]) -> float:
    prompt = sum(int((a.usage or {}).get("prompt_tokens") or 0) for a in answers)
    return sum(a.cached for a in answers) / prompt


async def _run(session: aiohttp.ClientSession, url: str) -> tuple[list[str], list[Answer]]:
    """The first wave held open (long streams: each counts in flight), then the rest one by one."""
    waves = _waves()
    held: list[str] = []
    async with contextlib.AsyncExitStack() as open_streams:
        for question in waves[0]:
            body = orjson.dumps(chat_body(question, stream=True, max_tokens=2000))
            resp = await open_streams.enter_async_context(
                session.post(url + "/v1/chat/completions", data=body, headers=JSON)
            )
            assert resp.status == 200
            await resp.content.readline()  # its first event: routed, and in flight until closed
            held.append(resp.headers["x-prefixrouter-worker"])
    later = [await post(session, url, chat_body(q)) for wave in waves[1:] for q in wave]
    return held, later


def test_placement_and_cached_share_match_the_gateway(tmp_path: Path) -> None:
    async def body() -> None:
        with Fleet() as fleet:
            engines = start_engines(fleet, 3)
            config = write_config(tmp_path / "router.yaml", engines)
            gateway = fleet.start("gateway", "prefixrouter.gateway", ["--config", str(config)])
            picker = start_picker(fleet, config)
            envoy = start_proxy(fleet, picker, engines, tmp_path)
            await wait_up(fleet, [*engines, gateway, picker.server], [envoy])
            runs: dict[str, tuple[list[str], list[Answer]]] = {}
            async with client() as s:
                for name, url in (("gateway", gateway.url), ("envoy+epp", envoy.url)):
                    await reset_prefix_caches([e.url for e in engines], announce=False)
                    runs[name] = await _run(s, url)
            for name, (first, later) in runs.items():
                # Every later question goes where its document went.
                assert [a.worker for a in later] == first * (QUESTIONS - 1), name
            shares = {name: _share(later) for name, (_, later) in runs.items()}
            assert abs(shares["envoy+epp"] - shares["gateway"]) < 0.01, shares
            assert shares["gateway"] > 0.8

    asyncio.run(asyncio.wait_for(body(), 90))
