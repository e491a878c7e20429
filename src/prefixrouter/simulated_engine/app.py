"""The HTTP face of the simulated engine: an aiohttp app that answers like vLLM.

``create_app(config)`` returns an :class:`aiohttp.web.Application` serving one
model from one simulated :class:`~prefixrouter.sim.engine.EngineModel`, driven
in real time by :class:`~prefixrouter.simulated_engine.runtime.EngineRuntime`.
Prompts are tokenized for real (:mod:`prefixrouter.tokenization`, chat template
first), so token counts, block boundaries and cache hits are those a router in
token mode computes; the output is filler text of exactly ``max_tokens`` tokens
(fewer with ``answer_tokens``: every answer then ends on its own there, as a
model's end of sequence, and a client's ``max_tokens`` is a cap).

Endpoints:

* OpenAI: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE
  with ``stream``; usage with ``prompt_tokens_details.cached_tokens``; the SSE
  usage chunk only with ``stream_options.include_usage``), ``GET /v1/models``.
* vLLM: ``GET /health``, ``GET /ping``, ``GET /metrics``, ``GET /load``,
  ``GET /version``, ``POST /tokenize``, ``POST /detokenize``,
  ``POST /reset_prefix_cache``, ``POST /v1/chat/completions/render`` and
  ``POST /v1/completions/render`` (vllm-router's cache-aware policy calls them).
* Fault injection, with ``--fault-injection`` only: ``GET`` and ``POST
  /admin/faults`` (:mod:`prefixrouter.simulated_engine.faults`).
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

A client that disconnects gets nothing more, and its engine request is
aborted, as vLLM aborts it: the handler (cancelled by aiohttp, or failing a
write) ends with :meth:`EngineRuntime.cancel`, which takes a waiting request out
of the queue at once and a running one out of the batch at the end of the
engine step in flight, freeing its slot and KV (see ``runtime.py``). Nothing is
logged per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from prefixrouter import __version__
from prefixrouter.core.hashing import hash_token_blocks
from prefixrouter.core.types import CacheNamespace, WorkerId
from prefixrouter.sim.engine import EngineModel
from prefixrouter.simulated_engine.config import EngineServerConfig
from prefixrouter.simulated_engine.faults import Faults, ServedLog, bad_usage, parse_faults
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
    LONG_TEXT_CHARS,
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
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _finish_reason(handle: RequestHandle, max_tokens: int) -> str:
    """``stop`` for an answer that ended before ``max_tokens``, else ``length`` (as vLLM)."""
    return "stop" if handle.output_tokens < max_tokens else "length"


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
                replay_endpoint=config.kv_replay_endpoint,
            )
            self.runtime.on_kv_events = self.publisher.publish
        self.started = int(time.time())
        self.in_flight = 0
        self._seeds: dict[str | None, int] = {None: CacheNamespace(config.model).seed}
        self._filler = [self.tokenizer.decode([t]) for t in self.tokenizer.encode(FILLER_TEXT)]
        self._hf_dir: str | None = None
        self.faults = Faults()
        self._fault_turn = 0
        self.served = ServedLog(config.served_log) if config.served_log else None

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
        """Token ids of ``text``; a long one on a thread, so ``/health`` and the
        streams in flight are answered meanwhile (the tokenizer releases the GIL
        for those, :data:`~prefixrouter.tokenization.tokenizer.LONG_TEXT_CHARS`).
        The engine model's timings start at the submit, after this: unchanged."""
        if len(text) < LONG_TEXT_CHARS:
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
            return await self._encode(_date_header(body, self.faults.template_clock) + text)
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

    def _fault(self) -> Faults | None:
        """The injected faults if they hit this request (one in ``every``), else None."""
        faults = self.faults
        if not faults.per_request:
            return None
        self._fault_turn += 1
        return faults if self._fault_turn % faults.every == 0 else None

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        served = self.served
        if served is None:
            resp, _ = await self._answer(request, kind, body, rid)
            return resp
        tag = body.get("user")
        served.event("recv", rid, tag=tag if isinstance(tag, str) else None)
        how = "gone"  # what a cancelled handler (the client left) leaves
        try:
            resp, how = await self._answer(request, kind, body, rid)
            return resp
        except ApiError:
            how = "error"
            raise
        finally:
            served.event("end", rid, how=how)

    def _answer_length(self, max_tokens: int) -> int:
        """Tokens the answer decodes: ``max_tokens``, or ``answer_tokens`` when fewer."""
        own = self.config.answer_tokens
        return min(max_tokens, own) if own is not None else max_tokens

    async def _answer(
        self, request: web.Request, kind: Kind, body: dict[str, Any], rid: str
    ) -> tuple[web.StreamResponse, str]:
        """Validate, run and answer one request; also how it ended (served log)."""
        model = check_model(body, self.config.model)
        opts = parse_options(body, kind)
        ids = await self.prompt_ids(body, kind)
        max_tokens = opts.max_tokens or self.config.default_max_tokens
        err = length_error(len(ids), max_tokens, self.max_model_len, self.length_hint)
        if err is not None:
            raise err
        fault = self._fault()
        if fault is not None and fault.status is not None:
            raise ApiError(fault.status, "Injected fault.", "InternalServerError")
        hashes = hash_token_blocks(self.seed(opts.cache_salt), ids, self.profile.block_size)
        if self.publisher is not None:
            self.publisher.remember(hashes, ids, opts.cache_salt)
        try:
            handle = self.runtime.submit(hashes, len(ids), self._answer_length(max_tokens))
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        created = int(time.time())
        self.in_flight += 1
        try:
            if opts.stream:
                writer = ChunkWriter(kind, rid, created, model, _finish_reason(handle, max_tokens))
                return await self._stream(request, handle, writer, rid, opts.include_usage, fault)
            done = await handle.done
            first = handle.first.result()
            text = "".join(self.filler(0, done.output_tokens))
            use = usage(len(ids), done.output_tokens, first.cached_tokens)
            if fault is not None and fault.bad_usage:
                use = bad_usage(len(ids), done.output_tokens)
            reason = _finish_reason(handle, max_tokens)
            raw = orjson.dumps(full_response(kind, rid, created, model, text, use, reason))
            how = "done"
            if fault is not None and (fault.malformed or fault.truncate):
                raw = b'{"id": "' + rid.encode() + b'", "choices": [{' if fault.malformed else raw
                raw, how = raw[: len(raw) // 2 or 1], "fault"
            if self.served is not None:
                self.served.event("first", rid)
            return web.Response(body=raw, content_type="application/json"), how
        finally:
            self.in_flight -= 1
            # Aborts the engine request if the client left before it completed
            # (handler cancelled, or a failed write); a no-op after completion.
            self.runtime.cancel(handle.request_id)

    async def _stream(
        self,
        request: web.Request,
        handle: RequestHandle,
        writer: ChunkWriter,
        rid: str,
        with_usage: bool,
        fault: Faults | None,
    ) -> tuple[web.StreamResponse, str]:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        n = handle.output_tokens
        # A truncated stream stops after half its tokens; a malformed one after its first event.
        stop = n
        if fault is not None and (fault.truncate or fault.malformed):
            stop = max(1, n // 2) if fault.truncate else 0
        how = "gone"
        try:
            first = await handle.first
            if n == 1:
                await handle.done
            head = writer.role() if writer.is_chat else b""
            if stop == 0:  # malformed: an event that is not JSON, then the end
                await resp.write(head + b'data: {"id": "' + rid.encode() + b'", "cho\n\n')
                self._first_written(rid)
                await resp.write_eof()
                return resp, "fault"
            await resp.write(head + writer.token(self.filler(0, 1)[0], n == 1))
            self._first_written(rid)
            sent = 1
            while sent < stop:
                if not handle.done.done() and sent < n - 1:
                    await asyncio.wait((handle.done,), timeout=self.runtime.token_interval())
                    if not handle.done.done():
                        await resp.write(writer.token(self.filler(sent, sent + 1)[0], False))
                        sent += 1
                        continue
                if stop < n:  # truncated: the tokens up to the cut, at once
                    await resp.write(
                        b"".join(writer.token(t, False) for t in self.filler(sent, stop))
                    )
                    break
                await handle.done
                rest = self.filler(sent, n)
                await resp.write(
                    b"".join(writer.token(t, sent + i == n - 1) for i, t in enumerate(rest))
                )
                sent = n
            if stop < n:  # truncated: a clean end of body, no usage, no [DONE]
                await resp.write_eof()
                return resp, "fault"
            use = usage(handle.prompt_tokens, n, first.cached_tokens)
            if fault is not None and fault.bad_usage:
                use = bad_usage(handle.prompt_tokens, n)
            tail = writer.usage(use) if with_usage else b""
            if self.served is not None:
                # Logged before the last bytes go out: a SIGKILL between them would
                # otherwise leave an answer the client got whole without its end
                # line, which the fault accounting reads as lost. A failing write
                # below still ends the request "gone" (the later line wins).
                self.served.event("end", rid, how="done")
            await resp.write(tail + ChunkWriter.DONE)
            await resp.write_eof()
            how = "done"
        except ConnectionError:
            pass  # the client went away: stop writing; _answer forgets the request
        return resp, how

    def _first_written(self, rid: str) -> None:
        if self.served is not None:
            self.served.event("first", rid)

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

    # ------------------------------------------------------- fault injection

    async def get_faults(self, request: web.Request) -> web.Response:
        """``GET /admin/faults`` (``--fault-injection``): the faults now on."""
        return _json(self.faults.to_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        """``POST /admin/faults`` (``--fault-injection``): replace the faults (``{}`` heals)."""
        faults = parse_faults(parse_json_object(await request.read()))
        self.faults = faults
        self._fault_turn = 0
        self.runtime.set_time_scale(self.config.time_scale / faults.slow)
        if self.publisher is not None:
            self.publisher.drop_next(faults.drop_kv_events)
        return _json(faults.to_dict())

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


def _date_header(body: dict[str, Any], clock: bool = False) -> str:
    """The date line a request's ``chat_template_kwargs.date_string`` puts ahead of the prompt.

    Llama 3.x's chat template writes ``Today Date: {{ date_string }}`` into
    the head of every prompt (vLLM passes ``chat_template_kwargs`` to it),
    which ends the engine's prefix reuse at the first token when it changes.
    This engine writes it the same way ("" when the request gives none).
    Without one, ``clock`` (the ``template_clock`` fault) writes the time
    now, as a template that calls ``strftime_now`` does.
    """
    kwargs = body.get("chat_template_kwargs")
    date = kwargs.get("date_string") if isinstance(kwargs, dict) else None
    if date is None:
        return f"Today Date: {datetime.now():%d %b %Y %H:%M:%S.%f}\n\n" if clock else ""
    if not isinstance(date, str):
        raise bad_request(
            "chat_template_kwargs.date_string: must be a string", "chat_template_kwargs"
        )
    return f"Today Date: {date}\n\n"


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

    replay: list[asyncio.Task[None]] = []

    async def _start(_app: web.Application) -> None:
        if server.publisher is not None and server.publisher.replay_endpoint is not None:
            replay.append(asyncio.create_task(server.publisher.serve_replay()))

    async def _stop(_app: web.Application) -> None:
        server.runtime.stop()
        for task in replay:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if server.publisher is not None:
            server.publisher.close()
        if server.served is not None:
            server.served.close()

    app.on_startup.append(_start)
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
    if config.fault_injection:
        app.router.add_get("/admin/faults", s.get_faults)
        app.router.add_post("/admin/faults", s.set_faults)
    return app
