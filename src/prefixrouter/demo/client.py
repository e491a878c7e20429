"""A bounded asynchronous OpenAI client that measures what users feel.

Each request is sent at its offset from the start (open loop, so a slow
router is not hidden by the client slowing down), streamed, and timed: time
to first token is the first chunk with content, end-to-end the ``[DONE]``
line. The stream is then read to its end, as the OpenAI SDKs do: closing the
connection right after ``[DONE]`` makes a proxy see a disconnect. The
engine's ``usage`` (from the final chunk, ``include_usage``) gives prompt and
cached tokens. ``concurrency`` bounds requests in flight so a
stalled fleet cannot exhaust the machine; errors are recorded, never raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from prefixrouter.demo.workload import DemoRequest


@dataclass(slots=True)
class Result:
    """What one request measured."""

    kind: str
    group: str
    ok: bool = False
    status: int = 0
    ttft_s: float = -1.0
    e2e_s: float = -1.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def _one(
    session: aiohttp.ClientSession, url: str, req: DemoRequest, headers: dict[str, str]
) -> Result:
    res = Result(req.kind, req.group)
    start = time.perf_counter()
    try:
        async with session.post(url, data=orjson.dumps(req.body), headers=headers) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = (await resp.text())[:200]
                return res
            async for raw in resp.content:
                line = raw.strip()
                if res.ok or not line.startswith(b"data:"):
                    continue  # after [DONE], read to the end as SDKs do (no reset)
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    res.e2e_s = time.perf_counter() - start
                    res.ok = True
                    continue
                chunk = orjson.loads(payload)
                if res.ttft_s < 0 and any(
                    (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
                ):
                    res.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def replay(
    base_url: str,
    requests: Sequence[DemoRequest],
    *,
    concurrency: int = 64,
    timeout_s: float = 120.0,
    on_done: Callable[[Result], None] | None = None,
    headers: dict[str, str] | None = None,
) -> list[Result]:
    """Send ``requests`` at their offsets to ``base_url``; returns results in request order."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limit = asyncio.Semaphore(concurrency)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def fire(req: DemoRequest) -> Result:
            delay = req.offset_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                res = await _one(session, url, req, hdrs)
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(fire(r) for r in requests)))
