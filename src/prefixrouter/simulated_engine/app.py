"""The HTTP face of the simulated engine: an aiohttp app that answers like vLLM.

``create_app(config)`` returns an :class:`aiohttp.web.Application` serving one
model from one simulated :class:`~prefixrouter.sim.engine.EngineModel`, driven
in real time by :class:`~prefixrouter.simulated_engine.runtime.EngineRuntime`.
Prompts are tokenized for real (:mod:`prefixrouter.tokenization`, chat template
first), so token counts, block boundaries and cache hits are those a router in
token mode computes; the output is filler text of exactly ``max_tokens`` tokens.

Endpoints:

* OpenAI: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE
  with ``stream``; usage with ``prompt_tokens_details.cached_tokens``; the SSE
  usage chunk only with ``stream_options.include_usage``), ``GET /v1/models``.
* vLLM: ``GET /health``, ``GET /ping``, ``GET /metrics``, ``GET /load``,
  ``GET /version``, ``POST /tokenize``, ``POST /detokenize``,
  ``POST /reset_prefix_cache``, ``POST /v1/chat/completions/render`` and
  ``POST /v1/completions/render`` (vllm-router's cache-aware policy calls them).
* SGLang, for sglang-router's worker discovery: ``GET /server_info``,
  ``/get_server_info``, ``/model_info``, ``/get_model_info``; the tokenizer
  path they report is a local Hugging Face style folder, so the router loads
  it instead of trying to download one.

Prefix cache keys: the prompt's chained block hashes
(:func:`~prefixrouter.core.hashing.hash_token_blocks`) seeded by
``CacheNamespace(model)``, or ``CacheNamespace(model, tenant=cache_salt)`` when
the request carries vLLM's ``cache_salt``: different salts never share blocks.

Streaming: the first token (after the role chunk, for chat) is written when
the engine's ``FirstToken`` fires. The engine coalesces decode steps and emits
no per-token events, so later tokens are paced one per estimated decode step
(:meth:`EngineRuntime.token_interval`), the last one held back until the
engine's ``Completed``; whatever is left then is flushed at once. Completion
time and usage are therefore exact; token spacing is an estimate.

A client that disconnects gets nothing more; its engine request runs on (the
engine model has no abort; see ``runtime.py``). Nothing is logged per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from prefixrouter import __version__
from prefixrouter.core.hashing import hash_token_blocks
from prefixrouter.core.types import CacheNamespace, WorkerId
from prefixrouter.sim.engine import EngineModel
from prefixrouter.simulated_engine.config import EngineServerConfig
from prefixrouter.simulated_engine.kv_publisher import KvEventPublisher
from prefixrouter.simulated_engine.metrics import CONTENT_TYPE, EngineMetrics
from prefixrouter.simulated_engine.protocol import (
    ApiError,
    ChunkWriter,
    Kind,
    bad_request,
    chat_messages,
    check_model,
    completion_prompt,
    full_response,
    length_error,
    parse_json_object,
    parse_options,
    render_result,
    usage,
)
from prefixrouter.simulated_engine.runtime import EngineRuntime, RequestHandle
from prefixrouter.tokenization import (
    ChatTemplateError,
    Tokenizer,
    hf_tokenizer_dir,
    load_tokenizer,
    render_chat,
)

log = logging.getLogger(__name__)

FILLER_TEXT = (
    " the value of this result is returned to the caller when the list is empty and"
    " the data for each item in the file is ready to use"
)
"""Output tokens cycle through this text's tokens (every one decodes to ASCII on its own)."""
OFFLOAD_CHARS = 64_000
"""Prompts longer than this are tokenized in a thread, off the event loop."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """OpenAI-shaped errors; never a traceback in a response."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.Response(status=exc.status, body=exc.body(), content_type="application/json")
    except web.HTTPException:
        raise
    except Exception:
        log.exception("internal error serving %s %s", request.method, request.path)
        err = ApiError(500, "Internal server error.", "InternalServerError")
        return web.Response(status=500, body=err.body(), content_type="application/json")


class EngineServer:
    """Everything one engine server holds: config, tokenizer, engine, runtime, metrics.

    Args:
        config: What to serve.
        tokenizer: Tokenizer to use (default: loaded from ``config.tokenizer``).
        clock: Wall clock for the runtime (monotonic seconds).
    """

    def __init__(
        self,
        config: EngineServerConfig,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer)
        self.profile = config.engine_profile()
        self.max_model_len = config.effective_max_model_len
        self.length_hint = config.length_hint()
        self.engine = EngineModel(
            WorkerId(f"engine-{config.engine_id}"),
            self.profile,
            emit_events=config.kv_events_endpoint is not None,
        )
        self.metrics = EngineMetrics(self.engine, config.model, config.engine_id, config.time_scale)
        self.runtime = EngineRuntime(self.engine, config.time_scale, self.metrics, clock)
        self.publisher: KvEventPublisher | None = None
        if config.kv_events_endpoint is not None:
            self.publisher = KvEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_topic or f"kv@{config.engine_id}",
                self.profile.block_size,
                max_blocks=4 * self.profile.kv_blocks,
            )
            self.runtime.on_kv_events = self.publisher.publish
        self.started = int(time.time())
        self.in_flight = 0
        self._seeds: dict[str | None, int] = {None: CacheNamespace(config.model).seed}
        self._filler = [self.tokenizer.decode([t]) for t in self.tokenizer.encode(FILLER_TEXT)]
        self._hf_dir: str | None = None

    # ---------------------------------------------------------------- helpers

    def seed(self, cache_salt: str | None) -> int:
        """Hash seed of a request's cache namespace (the salt is the tenant)."""
        seed = self._seeds.get(cache_salt)
        if seed is None:
            if len(self._seeds) > 4096:  # bounded: salts can be per request
                self._seeds = {None: self._seeds[None]}
            seed = self._seeds[cache_salt] = CacheNamespace(
                self.config.model, tenant=cache_salt or ""
            ).seed
        return seed

    def filler(self, start: int, stop: int) -> list[str]:
        """Text of output tokens ``start`` to ``stop - 1``."""
        pieces = self._filler
        n = len(pieces)
        return [pieces[i % n] for i in range(start, stop)]

    async def _encode(self, text: str) -> list[int]:
        if len(text) <= OFFLOAD_CHARS:
            return self.tokenizer.encode(text)
        return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, text)

    async def prompt_ids(self, body: dict[str, Any], kind: Kind) -> list[int]:
        """Token ids of a request's prompt (chat: the template first).

        Raises:
            ApiError: 400 for malformed messages or out-of-vocabulary token ids.
        """
        if kind == "chat":
            messages = chat_messages(body)
            tools = body.get("tools")
            gen = body.get("add_generation_prompt", True)
            try:
                text = render_chat(messages, tools, add_generation_prompt=bool(gen))
            except ChatTemplateError as exc:
                param = "tools" if str(exc).startswith("tools") else "messages"
                raise bad_request(str(exc), param) from None
            return await self._encode(text)
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            return await self._encode(prompt)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary (size {vocab}).", "prompt")
        return prompt

    def hf_dir(self) -> str:
        """A local tokenizer folder to report to SGLang-style probes."""
        if self._hf_dir is None:
            given = self.config.tokenizer
            if given is None:
                self._hf_dir = str(hf_tokenizer_dir())
            else:
                path = Path(given).expanduser().resolve()
                self._hf_dir = str(path if path.is_dir() else path.parent)
        return self._hf_dir

    # ------------------------------------------------------------- generation

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        model = check_model(body, self.config.model)
        opts = parse_options(body, kind)
        ids = await self.prompt_ids(body, kind)
        max_tokens = opts.max_tokens or self.config.default_max_tokens
        err = length_error(len(ids), max_tokens, self.max_model_len, self.length_hint)
        if err is not None:
            raise err
        hashes = hash_token_blocks(self.seed(opts.cache_salt), ids, self.profile.block_size)
        if self.publisher is not None:
            self.publisher.remember(hashes, ids, opts.cache_salt)
        try:
            handle = self.runtime.submit(hashes, len(ids), max_tokens)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        self.in_flight += 1
        try:
            if opts.stream:
                writer = ChunkWriter(kind, rid, created, model)
                return await self._stream(request, handle, writer, opts.include_usage)
            done = await handle.done
            first = handle.first.result()
            text = "".join(self.filler(0, done.output_tokens))
            use = usage(len(ids), done.output_tokens, first.cached_tokens)
            return _json(full_response(kind, rid, created, model, text, use))
        finally:
            self.in_flight -= 1
            self.runtime.cancel(handle.request_id)

    async def _stream(
        self, request: web.Request, handle: RequestHandle, writer: ChunkWriter, with_usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        n = handle.output_tokens
        try:
            first = await handle.first
            if n == 1:
                await handle.done
            head = writer.role() if writer.is_chat else b""
            await resp.write(head + writer.token(self.filler(0, 1)[0], n == 1))
            sent = 1
            while sent < n:
                if not handle.done.done() and sent < n - 1:
                    await asyncio.wait((handle.done,), timeout=self.runtime.token_interval())
                    if not handle.done.done():
                        await resp.write(writer.token(self.filler(sent, sent + 1)[0], False))
                        sent += 1
                        continue
                await handle.done
                rest = self.filler(sent, n)
                await resp.write(
                    b"".join(writer.token(t, sent + i == n - 1) for i, t in enumerate(rest))
                )
                sent = n
            tail = (
                writer.usage(usage(handle.prompt_tokens, n, first.cached_tokens))
                if with_usage
                else b""
            )
            await resp.write(tail + ChunkWriter.DONE)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away: stop writing; _generate forgets the request
        return resp

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._generate(request, "completion")

    # ------------------------------------------------------------ vLLM extras

    async def _render(self, request: web.Request, kind: Kind) -> web.Response:
        body = parse_json_object(await request.read())
        model = check_model(body, self.config.model)
        opts = parse_options(body, kind)
        ids = await self.prompt_ids(body, kind)
        max_tokens = opts.max_tokens or self.config.default_max_tokens
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        item = render_result(rid, model, ids, max_tokens, opts.cache_salt)
        return _json(item if kind == "chat" else [item])

    async def chat_render(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render``: the token ids vLLM would run."""
        return await self._render(request, "chat")

    async def completions_render(self, request: web.Request) -> web.Response:
        """``POST /v1/completions/render``: a list with one rendered prompt."""
        return await self._render(request, "completion")

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize``: ``{"count", "max_model_len", "tokens"}`` for a prompt or messages."""
        body = parse_json_object(await request.read())
        check_model(body, self.config.model)
        if "messages" in body:
            ids = await self.prompt_ids(body, "chat")
        elif isinstance(body.get("prompt"), str):
            ids = await self._encode(body["prompt"])
        else:
            raise bad_request("Field required: 'prompt' (a string) or 'messages'.", "prompt")
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
        }
        out["token_strs"] = (
            [self.tokenizer.id_to_token(t) for t in ids] if body.get("return_token_strs") else None
        )
        return _json(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize``: ``{"prompt"}`` for ``{"tokens"}``."""
        body = parse_json_object(await request.read())
        check_model(body, self.config.model)
        tokens = body.get("tokens")
        vocab = self.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise bad_request(f"'tokens' must be a list of token ids below {vocab}.", "tokens")
        return _json({"prompt": self.tokenizer.decode(tokens)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """``POST /reset_prefix_cache``: empty the engine's prefix cache."""
        self.runtime.reset_cache()
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 while serving."""
        return web.Response(status=200)

    async def load(self, request: web.Request) -> web.Response:
        """``GET /load`` (vLLM): requests the API server is handling."""
        return _json({"server_load": self.in_flight})

    async def version(self, request: web.Request) -> web.Response:
        """``GET /version``."""
        return _json({"version": f"prefixrouter-engine-{__version__}"})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text with vLLM's names."""
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one served model."""
        card = {
            "id": self.config.model,
            "object": "model",
            "created": self.started,
            "owned_by": "vllm",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return _json({"object": "list", "data": [card]})

    # ------------------------------------------------------- SGLang discovery

    async def server_info(self, request: web.Request) -> web.Response:
        """``GET /server_info``, ``/get_server_info``: SGLang's shape, the fields routers read."""
        prof = self.profile
        path = self.hf_dir()
        info = {
            "model_path": path,
            "tokenizer_path": path,
            "served_model_name": self.config.model,
            "dp_size": 1,
            "tp_size": 1,
            "pp_size": 1,
            "page_size": prof.block_size,
            "context_length": self.max_model_len,
            "max_total_num_tokens": prof.kv_blocks * prof.block_size,
            "max_running_requests": prof.max_num_seqs,
            "chunked_prefill_size": prof.max_batched_tokens,
            "max_req_input_len": self.max_model_len - 1,
            "is_embedding": False,
            "skip_tokenizer_init": False,
            "disaggregation_mode": "null",
            "version": f"prefixrouter-engine-{__version__}",
            "internal_states": [
                {"load": self.engine.num_running + self.engine.num_waiting, "dp_rank": 0}
            ],
        }
        return _json(info)

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info`` and ``/get_model_info`` (SGLang's shape)."""
        path = self.hf_dir()
        return _json(
            {
                "model_path": path,
                "tokenizer_path": path,
                "served_model_name": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )


SERVER_KEY = web.AppKey("simulated_engine", EngineServer)
"""Where :func:`create_app` keeps the :class:`EngineServer` (tests read it)."""


def create_app(
    config: EngineServerConfig,
    *,
    tokenizer: Tokenizer | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """Build the engine server's aiohttp application.

    Run it with ``handler_cancellation=True`` (``web.run_app``/``AppRunner``) so
    that a client disconnect cancels the waiting handler; the test server does.

    Args:
        config: What to serve.
        tokenizer: Tokenizer to use (default: loaded from ``config.tokenizer``).
        clock: Wall clock for the engine runtime (monotonic seconds).

    Returns:
        The application; its :class:`EngineServer` is ``app[SERVER_KEY]``.
    """
    server = EngineServer(config, tokenizer, clock)
    app = web.Application(middlewares=[_errors], client_max_size=256 * 2**20)
    app[SERVER_KEY] = server

    async def _stop(_app: web.Application) -> None:
        server.runtime.stop()
        if server.publisher is not None:
            server.publisher.close()

    app.on_cleanup.append(_stop)
    s = server
    app.router.add_post("/v1/chat/completions", s.chat_completions)
    app.router.add_post("/v1/completions", s.completions)
    app.router.add_post("/v1/chat/completions/render", s.chat_render)
    app.router.add_post("/v1/completions/render", s.completions_render)
    app.router.add_get("/v1/models", s.models)
    app.router.add_post("/tokenize", s.tokenize)
    app.router.add_post("/detokenize", s.detokenize)
    app.router.add_post("/reset_prefix_cache", s.reset_prefix_cache)
    app.router.add_get("/health", s.health)
    app.router.add_get("/ping", s.health)
    app.router.add_get("/load", s.load)
    app.router.add_get("/version", s.version)
    app.router.add_get("/metrics", s.metrics_endpoint)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, s.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, s.model_info)
    return app
