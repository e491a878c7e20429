"""Engines that answer completions their own way, behind a real gateway, on loopback.

Each is the fake vLLM server of :mod:`tests.gateway.fakes` (``/health``,
``/metrics``, ``/v1/models`` as vLLM answers them) whose
``POST /v1/chat/completions`` and ``/v1/completions`` are answered by the
test's own handler instead: SSE framed as sse-starlette frames it, a body
cut after its headers, a refusal with ``Retry-After``. The handler gets the
request and its parsed body; every body is kept in :attr:`OddEngine.requests`,
so a test can count how many engines a request reached.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.gateway.fakes import FakeEngine, make_app
from tests.gateway.helpers import Env, gateway_env

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class OddEngine:
    """One engine: its completions handler and the request bodies it received."""

    handler: Handler
    requests: list[dict[str, Any]] = field(default_factory=list)


def _app(odd: OddEngine) -> web.Application:
    app = make_app(FakeEngine())

    @web.middleware
    async def completions(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method == "POST" and request.path.endswith("completions"):
            body = orjson.loads(await request.read())
            odd.requests.append(body)
            return await odd.handler(request, body)
        return await handler(request)

    app.middlewares.append(completions)
    return app


@asynccontextmanager
async def odd_env(
    handlers: list[Handler],
    overrides: dict[str, Any] | None = None,
    worker_options: list[dict[str, Any]] | None = None,
) -> AsyncIterator[tuple[Env, list[OddEngine]]]:
    """One :class:`OddEngine` per handler (workers ``w0``, ``w1``...) and a gateway.

    Round-robin routing, so a test knows which worker an attempt goes to;
    ``overrides`` are merged into the gateway's configuration sections;
    ``worker_options``: more settings of each worker's entry, in order.
    """
    odds = [OddEngine(h) for h in handlers]
    round_robin: dict[str, Any] = {"policy": {"name": "round_robin"}}
    async with gateway_env(
        overrides={**round_robin, **(overrides or {})},
        apps=[_app(o) for o in odds],
        worker_options=worker_options,
    ) as env:
        yield env, odds


def chunk(content: str | None, *, usage: Any = "absent", choices: bool = True) -> dict[str, Any]:
    """An OpenAI chat.completion.chunk (``usage``: left out unless given, None included)."""
    obj: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
        if choices
        else [],
    }
    if usage != "absent":
        obj["usage"] = usage
    return obj


USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 2,
    "total_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def wants_usage(body: dict[str, Any]) -> bool:
    """The request asks for the usage chunk (the gateway asks for it on every stream)."""
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))
