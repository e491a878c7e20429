"""An in-test fake of a vLLM OpenAI server, precise in its wire format.

Same endpoints, usage fields and metric names as vLLM (see shared/REAL_ENGINES.md):
``/v1/chat/completions`` and ``/v1/completions`` (streaming with
``stream_options.include_usage``: usage only in a last chunk with ``"choices": []``),
``usage.prompt_tokens_details.cached_tokens`` (a multiple of the block size,
the last token always recomputed), ``/v1/models``, ``/health``, ``/metrics``
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``, ``vllm:cache_config_info``).

Tokens are 4 characters; the prefix cache holds block hashes (one per 16
tokens) keyed by ``cache_salt``, without eviction. Knobs make it refuse
(``status``), reject prompts past a context length with vLLM's 400
(``max_prompt_tokens``), hang (``delay_s``), close before the first byte
(``die_before_first_byte``) or after a few chunks (``die_after_chunks``),
or go silent after a few chunks (``hang_after_chunks``), or answer ``/health``
late (``health_delay_s``). ``start_time`` is
exported as ``process_start_time_seconds`` (change it to fake a restart).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

BLOCK = 16
CHARS_PER_TOKEN = 4


@dataclass
class FakeEngine:
    """One fake vLLM server's state and knobs."""

    model: str = "tiny"
    adapters: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # vLLM's --served-model-name with several names
    status: int = 200
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    die_before_first_byte: bool = False
    die_after_chunks: int | None = None
    hang_after_chunks: int | None = None
    end_after_chunks: int | None = None  # a clean end of body, no [DONE]
    cut_body: bool = False  # an unstreamed 200 whose JSON is cut in half
    start_time: float | None = None
    health_delay_s: float = 0.0
    max_prompt_tokens: int | None = None
    healthy: bool = True
    num_gpu_blocks: int = 4096
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    running: int = 0
    blocks: set[bytes] = field(default_factory=set)
    queries: int = 0
    hits: int = 0

    def prompt_text(self, body: dict[str, Any]) -> str:
        if "messages" in body:
            return "".join(f"<{m['role']}>{m.get('content') or ''}" for m in body["messages"])
        p = body["prompt"]
        return p if isinstance(p, str) else " ".join(map(str, p))

    def usage(self, body: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
        text = self.prompt_text(body)
        salt = str(body.get("cache_salt", "")).encode()
        tokens = max(1, len(text) // CHARS_PER_TOKEN)
        h = hashlib.sha256(salt).digest()
        cached_blocks, still = 0, True
        step = BLOCK * CHARS_PER_TOKEN
        whole = (tokens - 1) // BLOCK  # the last token is always recomputed
        for i in range(whole):
            h = hashlib.sha256(h + text[i * step : (i + 1) * step].encode()).digest()
            if still and h in self.blocks:
                cached_blocks += 1
            else:
                still = False
            self.blocks.add(h)
        cached = cached_blocks * BLOCK
        self.queries += tokens
        self.hits += cached
        return {
            "prompt_tokens": tokens,
            "total_tokens": tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _chunk(kind: str, rid: str, model: str, text: str | None, finish: str | None) -> bytes:
    if kind == "chat":
        delta: dict[str, Any] = {} if text is None else {"content": text}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": 1, "model": model, "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def make_app(engine: FakeEngine) -> web.Application:
    """The aiohttp app of a fake engine."""

    async def completion(request: web.Request, kind: str) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        engine.requests.append(body)
        if engine.status != 200:
            err = {
                "error": {
                    "message": "overloaded",
                    "type": "ServiceUnavailable",
                    "param": None,
                    "code": engine.status,
                }
            }
            return web.Response(
                status=engine.status, body=orjson.dumps(err), content_type="application/json"
            )
        if body.get("model") not in (engine.model, *engine.aliases, *engine.adapters):
            err = {
                "error": {
                    "message": f"The model `{body.get('model')}` does not exist.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            }
            return web.Response(status=404, body=orjson.dumps(err), content_type="application/json")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        prompt_tokens = max(1, len(engine.prompt_text(body)) // CHARS_PER_TOKEN)
        limit = engine.max_prompt_tokens
        if limit is not None and prompt_tokens + n > limit:
            # vLLM checks max_model_len before scheduling: nothing is prefilled.
            err = {
                "error": {
                    "message": f"This model's maximum context length is {limit} tokens. "
                    f"However, you requested {prompt_tokens + n} tokens "
                    f"({prompt_tokens} in the messages, {n} in the completion).",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
            return web.Response(status=400, body=orjson.dumps(err), content_type="application/json")
        words = [f"w{i} " for i in range(n)]
        rid = f"cmpl-{len(engine.requests)}"
        engine.running += 1
        try:
            if engine.delay_s:
                await asyncio.sleep(engine.delay_s)
            if engine.die_before_first_byte:
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(0.05)
                raise ConnectionResetError
            usage = engine.usage(body, n)
            if not body.get("stream"):
                if kind == "chat":
                    choice: dict[str, Any] = {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": "length",
                    }
                else:
                    choice = {"index": 0, "text": "".join(words), "finish_reason": "length"}
                out = {
                    "id": rid,
                    "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": 1,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage,
                }
                raw = orjson.dumps(out)
                if engine.cut_body:
                    raw = raw[: len(raw) // 2]
                return web.Response(body=raw, content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunks = [_chunk(kind, rid, body["model"], w, None) for w in words]
            chunks.append(
                _chunk(kind, rid, body["model"], None if kind == "chat" else "", "length")
            )
            opts = body.get("stream_options") or {}
            if opts.get("include_usage"):
                last = {
                    "id": rid,
                    "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": 1,
                    "model": body["model"],
                    "choices": [],
                    "usage": usage,
                }
                chunks.append(b"data: " + orjson.dumps(last) + b"\n\n")
            chunks.append(b"data: [DONE]\n\n")
            for i, c in enumerate(chunks):
                if engine.die_after_chunks is not None and i >= engine.die_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if engine.end_after_chunks is not None and i >= engine.end_after_chunks:
                    break
                if engine.hang_after_chunks is not None and i >= engine.hang_after_chunks:
                    await asyncio.sleep(3600)  # silent, connection open, until cancelled
                await resp.write(c)
                if engine.chunk_delay_s:
                    await asyncio.sleep(engine.chunk_delay_s)
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            engine.cancelled += 1
            raise
        finally:
            engine.running -= 1

    async def chat(request: web.Request) -> web.StreamResponse:
        return await completion(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await completion(request, "completions")

    async def models(request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 1,
                "owned_by": "vllm",
                "root": engine.model,
                "parent": None,
            }
            for name in (engine.model, *engine.aliases)
        ]
        data += [
            {
                "id": a,
                "object": "model",
                "created": 1,
                "owned_by": "vllm",
                "root": "/lora",
                "parent": engine.model,
            }
            for a in engine.adapters
        ]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def health(request: web.Request) -> web.Response:
        if engine.health_delay_s:
            await asyncio.sleep(engine.health_delay_s)
        return web.Response(status=200 if engine.healthy else 503)

    async def metrics(request: web.Request) -> web.Response:
        labels = f'engine="0",model_name="{engine.model}"'
        usage = min(1.0, engine.running * 8 / engine.num_gpu_blocks)
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(engine.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries (tokens).\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(engine.queries)}\n"
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits (tokens).\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(engine.hits)}\n"
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{BLOCK}",cache_dtype="auto",'
            'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
            f'num_cpu_blocks="None",num_gpu_blocks="{engine.num_gpu_blocks}",'
            'prefix_caching_hash_algo="sha256"} 1.0\n'
        )
        if engine.start_time is not None:
            text += (
                "# HELP process_start_time_seconds Start time of the process.\n"
                "# TYPE process_start_time_seconds gauge\n"
                f"process_start_time_seconds {engine.start_time}\n"
            )
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def now() -> float:
    return time.monotonic()
