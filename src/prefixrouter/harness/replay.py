"""The replay client: timed OpenAI chat requests, streamed, measured as a user feels them.

A workload is a list of :class:`ReplayRequest` (a send offset and an OpenAI
chat body; the demo's, the bench's scenarios and the real-vLLM benchmark's
all have this shape). :func:`replay` sends each at its offset from the start
(open loop, so a slow router is not hidden by the client slowing down),
streams it and times it **from its scheduled send time**, as a user who
clicked then would count: time to first token is the first chunk with
content, end-to-end the ``[DONE]`` line. The stream is then read to its end,
as the OpenAI SDKs do: closing the connection right after ``[DONE]`` makes a
proxy see a disconnect. The engine's ``usage`` (from the final chunk,
``include_usage``) gives prompt and cached tokens.

``concurrency`` bounds requests in flight so a stalled fleet cannot exhaust
the machine. A request that finds every slot taken waits in the client, and
that wait is part of its TTFT (timing from the actual send would hide it, and
hide most of it for the slowest router: coordinated omission). Each result
also keeps its own client-side delay (``wait_s``: scheduled send to actual
send, the slot wait plus the event loop's lateness) and whether it had to wait
for a slot (``queued``), so a report can say when the client, not the router,
was the bottleneck. Errors are recorded in the :class:`ReplayResult`, never
raised; a stream that ends without ``[DONE]`` is an error that says what broke
(the gateway's ``data: {"error": ...}`` event, else the missing ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from prefixrouter.errors import exception_text


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
    """What one request measured.

    ``ttft_s`` and ``e2e_s`` count from the request's scheduled send time
    (its offset), so they include ``wait_s``; they are -1 when not reached.

    Attributes:
        kind: The request's :attr:`ReplayRequest.kind`.
        group: The request's :attr:`ReplayRequest.group`.
        ok: The stream ended with ``[DONE]``.
        status: HTTP status (0: no response).
        ttft_s: Scheduled send to the first chunk with content.
        e2e_s: Scheduled send to ``[DONE]``.
        wait_s: Client-side delay: scheduled send to actual send (waiting for
            a concurrency slot, plus the event loop's lateness).
        queued: It found every concurrency slot taken and waited for one.
        prompt_tokens: The engine's ``usage.prompt_tokens``.
        cached_tokens: The engine's ``usage.prompt_tokens_details.cached_tokens``.
        error: What went wrong ("" when nothing did).
    """

    kind: str
    group: str
    ok: bool = False
    status: int = 0
    ttft_s: float = -1.0
    e2e_s: float = -1.0
    wait_s: float = 0.0
    queued: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def _stream_error(chunk: dict[str, Any]) -> str | None:
    """The message of an in-stream error event (``data: {"error": ...}``), or None."""
    err = chunk.get("error")
    if not err:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or err)
    return str(err)


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    req: ReplayRequest,
    headers: dict[str, str],
    scheduled: float,
    queued: bool = False,
) -> ReplayResult:
    """Send one request now and time it from ``scheduled`` (its due time, ``perf_counter``).

    The clock starts at the scheduled time, not now: whatever delayed the
    send (a full set of slots, a late event loop) is time the user waited.
    """
    res = ReplayResult(req.kind, req.group, queued=queued)
    res.wait_s = max(0.0, time.perf_counter() - scheduled)
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
                    res.e2e_s = time.perf_counter() - scheduled
                    res.ok = not res.error  # an error event before [DONE] still failed
                    continue
                chunk = orjson.loads(payload)
                broke = _stream_error(chunk)
                if broke is not None and not res.error:
                    # The gateway ends a broken upstream stream with an error
                    # event and no [DONE]: keep its words, not just "HTTP 200".
                    res.error = f"stream error after HTTP 200: {broke}"[:200]
                if res.ttft_s < 0 and any(
                    (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
                ):
                    res.ttft_s = time.perf_counter() - scheduled
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
            if not res.ok and not res.error:
                res.error = "stream ended without data: [DONE]"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        res.error = exception_text(exc)  # a bare TimeoutError (the total timeout) says its type
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

    Every request is timed from its scheduled send time (module doc); one
    that finds all ``concurrency`` slots taken waits for one, and says so
    (``queued``, ``wait_s``). Several base URLs (gateway replicas behind no
    load balancer) take the requests round robin, request ``i`` to URL
    ``i mod n``, as a Kubernetes Service spreads connections; ``concurrency``
    bounds them all together.
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
            scheduled = start + req.offset_s
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            queued = limit.locked()  # every slot taken: this request waits in the client
            async with limit:
                res = await _one(session, urls[i % len(urls)], req, hdrs, scheduled, queued)
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests))))
