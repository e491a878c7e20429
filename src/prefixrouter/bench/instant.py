"""Engines that answer at once: one process, several ports, every endpoint routers call.

``python -m prefixrouter.bench.instant --ports P1,P2,... [--model tiny] [--model-path DIR]
[--ttft-ms T --decode-ms D]``

The overhead comparison measures what a router adds, so its engines must add
(almost) nothing: each completion gets a fixed vLLM-shaped answer (JSON, or
three SSE events when the request streams), with usage and
``prompt_tokens_details.cached_tokens``. Beyond the OpenAI API it serves what
the peer routers probe or call: ``/health``, ``/v1/models``, vLLM ``/metrics``,
SGLang's ``/server_info`` and ``/model_info`` (``model_path`` = a local
tokenizer folder), and vllm-router's ``/v1/chat/completions/render``,
``/v1/completions/render`` and ``/tokenize``. Those return cheap stand-in token
ids (every fourth byte of the text), so prompts that share text share ids and a
cache-aware router has something to match, without the cost of a tokenizer.

With ``--ttft-ms`` / ``--decode-ms`` a completion takes time like a real
engine's (``benchmarks/cluster_sync.py``: a request's routing, first token and
answer happen apart, as they do live): its first bytes come after T ms, the
rest D ms later; nothing else changes.

It prints ``instant engines listening`` on stderr once every port is bound.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

RESPONSE_USAGE = {
    "prompt_tokens": 2048,
    "completion_tokens": 1,
    "total_tokens": 2049,
    "prompt_tokens_details": {"cached_tokens": 1536},
}


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _prompt_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            parts.append(content if isinstance(content, str) else "")
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def stand_in_ids(body: dict[str, Any]) -> list[int]:
    """Cheap token ids for a request: every fourth byte of its text."""
    return list(_prompt_text(body).encode()[::4])


def create_app(
    model: str = "tiny", model_path: str = "", ttft_s: float = 0.0, decode_s: float = 0.0
) -> web.Application:
    """The instant engine application (the same app serves every port).

    ``ttft_s`` / ``decode_s``: a completion's first bytes after ``ttft_s``, the rest
    ``decode_s`` later (both 0: at once).
    """
    answer = orjson.dumps(
        {
            "id": "chatcmpl-instant",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "length",
                }
            ],
            "usage": RESPONSE_USAGE,
        }
    )
    chunk = {
        "id": "chatcmpl-instant",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
    }
    stream = (
        b"data: "
        + orjson.dumps({**chunk, "choices": [{"index": 0, "delta": {"content": "ok"}}]})
        + b"\n\ndata: "
        + orjson.dumps({**chunk, "choices": [], "usage": RESPONSE_USAGE})
        + b"\n\ndata: [DONE]\n\n"
    )
    metrics = (
        f'vllm:num_requests_running{{engine="0",model_name="{model}"}} 0.0\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.0\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100000"} 1.0\n'
    )
    info = {
        "model_path": model_path or model,
        "tokenizer_path": model_path or model,
        "served_model_name": model,
        "dp_size": 1,
        "tp_size": 1,
        "page_size": 16,
        "context_length": 131072,
        "is_generation": True,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }
    models = {
        "object": "list",
        "data": [{"id": model, "object": "model", "owned_by": "vllm", "max_model_len": 131072}],
    }

    async def completion(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        streamed = b'"stream":true' in raw or b'"stream": true' in raw
        body, kind = (stream, "text/event-stream") if streamed else (answer, "application/json")
        if not ttft_s and not decode_s:
            return web.Response(body=body, content_type=kind)
        await asyncio.sleep(ttft_s)
        out = web.StreamResponse(headers={"Content-Type": kind})
        out.content_length = len(body)
        await out.prepare(request)
        await out.write(body[:8])  # the first token's bytes
        await asyncio.sleep(decode_s)
        await out.write(body[8:])
        await out.write_eof()
        return out

    async def render(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        item = {
            "request_id": "render-instant",
            "model": model,
            "token_ids": stand_in_ids(body),
            "features": None,
            "sampling_params": {"max_tokens": body.get("max_tokens") or 16},
            "cache_salt": body.get("cache_salt"),
            "stream": False,
        }
        return _json(item if request.path.startswith("/v1/chat") else [item])

    async def tokenize(request: web.Request) -> web.Response:
        ids = stand_in_ids(orjson.loads(await request.read()))
        return _json({"count": len(ids), "max_model_len": 131072, "tokens": ids})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions/render", render)
    app.router.add_post("/v1/completions/render", render)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/reset_prefix_cache", ok)
    for path in ("/health", "/ping"):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", _constant(orjson.dumps(models), "application/json"))
    app.router.add_get("/metrics", _constant(metrics.encode(), "text/plain"))
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, _constant(orjson.dumps(info), "application/json"))
    app.router.add_get("/load", _constant(b'{"server_load": 0}', "application/json"))
    return app


def _constant(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    return handler


async def serve(
    ports: list[int], model: str, model_path: str, ttft_s: float = 0.0, decode_s: float = 0.0
) -> None:
    """Serve the instant app on every port of 127.0.0.1 until killed."""
    runner = web.AppRunner(create_app(model, model_path, ttft_s, decode_s), access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
    print("instant engines listening", file=sys.stderr, flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--ports", required=True, help="comma-separated ports")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--model-path", default="")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="first bytes after this")
    ap.add_argument("--decode-ms", type=float, default=0.0, help="the rest this much later")
    args = ap.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",") if p]
    run = serve(ports, args.model, args.model_path, args.ttft_ms / 1e3, args.decode_ms / 1e3)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(run)
        return
    uvloop.run(run)


if __name__ == "__main__":
    main()
