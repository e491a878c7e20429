"""The replay client: timed OpenAI chat requests, streamed, measured as a user feels them.

A workload is a list of :class:`ReplayRequest` (a send offset and an OpenAI
chat body; the demo's, the bench's scenarios and the real-vLLM benchmark's
all have this shape). :func:`replay` sends each at its offset from the start
(open loop, so a slow router is not hidden by the client slowing down),
streams it and times it: time to first token is the first chunk with
content, end-to-end the ``[DONE]`` line. The stream is then read to its end,
as the OpenAI SDKs do: closing the connection right after ``[DONE]`` makes a
proxy see a disconnect. The engine's ``usage`` (from the final chunk,
``include_usage``) gives prompt and cached tokens. ``concurrency`` bounds
requests in flight so a stalled fleet cannot exhaust the machine; errors are
recorded in the :class:`ReplayResult`, never raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a workload: when to send it, what it is, and the OpenAI chat body.

    Attributes:
        offset_s: Send time, seconds from the start of the replay.
        kind: Its workload or traffic kind (``doc-qa``, ``warmup`` ...).
        group: What it shares a prefix with (a document, a session ...).
        body: The ``/v1/chat/completions`` JSON body.
    """

    offset_s: float
    kind: str
    group: str
    body: dict[str, Any]


@dataclass(slots=True)
class ReplayResult:
    """What one request measured (``ttft_s`` and ``e2e_s`` are -1 when not reached)."""

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
    session: aiohttp.ClientSession, url: str, req: ReplayRequest, headers: dict[str, str]
) -> ReplayResult:
    res = ReplayResult(req.kind, req.group)
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
    base_url: str | Sequence[str],
    requests: Sequence[ReplayRequest],
    *,
    concurrency: int = 64,
    timeout_s: float = 120.0,
    on_done: Callable[[ReplayResult], None] | None = None,
    headers: dict[str, str] | None = None,
) -> list[ReplayResult]:
    """Send ``requests`` at their offsets to ``base_url``; returns results in request order.

    Several base URLs (gateway replicas behind no load balancer) take the
    requests round robin, request ``i`` to URL ``i mod n``, as a Kubernetes
    Service spreads connections; ``concurrency`` bounds them all together.
    """
    bases = [base_url] if isinstance(base_url, str) else list(base_url)
    if not bases:
        raise ValueError("replay needs at least one base URL")
    urls = [b.rstrip("/") + "/v1/chat/completions" for b in bases]
    limit = asyncio.Semaphore(concurrency)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def fire(i: int, req: ReplayRequest) -> ReplayResult:
            delay = req.offset_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                res = await _one(session, urls[i % len(urls)], req, hdrs)
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests))))
