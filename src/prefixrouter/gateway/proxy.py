"""Forwarding: route, send, retry before the first byte, stream, feed back.

Per request (``POST /v1/chat/completions`` or ``/v1/completions``):

1. from the headers alone, the tenant (401 on a bad key where keys are
   required, 403 on a refused ``X-Tenant``) and its limits (429 with
   ``Retry-After``, :mod:`.controls`); then read the body (413 past
   ``server.max_body_bytes``; 408 when it comes too slowly, :mod:`.server`),
   parse it once (400 on invalid JSON), build the routing request (400 naming
   a bad field) and check the model (404); under overload, wait in the
   priority queue (503 ``overloaded`` when shed). Bodies of ``OFF_LOOP_BODY_BYTES`` and
   more are parsed (a long token-id prompt in slices, :mod:`.body`), built and
   hashed into blocks on a worker thread, so a large one does not stall the
   event loop;
2. ``Dispatcher.admit`` routes over the prebuilt worker views with fresh
   in-flight figures (503 + ``Retry-After`` when no worker can serve), records
   the speculative placement and counts the request in flight; a retry
   (``Dispatcher.retry``) routes the same hashes among the workers not tried;
3. forward the body (re-serialized only to set ``cache_salt`` or to ask a
   stream for its usage chunk). A worker that cannot be reached, answers a
   *refusal* status (``proxy.retry_statuses``), or fails before its first body
   byte is abandoned and the request is routed again among the workers not yet
   tried, up to ``proxy.max_attempts``. The client's response is started only
   when the first upstream byte is in hand, and from then on nothing is
   retried: no request ever reaches a second worker after bytes reached the
   client. A stream that breaks later ends with an SSE ``error`` event;

   **Timeouts.** An attempt whose first body byte does not come within the
   *first-byte timeout* is abandoned (the engine aborts it) and retried
   elsewhere, and its worker is marked *suspect*: out of routing until a
   health check, run at once, passes (a frozen engine fails it and is marked
   down; a merely slow one is back within milliseconds). The timeout is
   ``proxy.first_byte_timeout_factor`` times the predicted wait, at least
   ``proxy.first_byte_timeout_floor_s``. For a stream the wait is the
   predicted TTFT. A non-streamed answer arrives whole at the end, so its wait
   is the TTFT plus the predicted decode of ``max_tokens``; without a
   prediction (a policy without the cost model) or without a ``max_tokens``
   (the engine may generate up to the context length) it has no first-byte
   timeout, since a floor meant for TTFTs would cut long generations. After
   the first byte, a stream silent for ``proxy.stall_timeout_s`` ends with an
   SSE ``error`` event (code ``504``), the upstream request is closed (the
   engine aborts it) and the worker is marked suspect. Both timeouts cut
   only a *silent* worker: past its deadline, a request whose worker sent
   bytes on another connection or passed a health check within the window
   (at least a poll interval plus a check) waits on, since a request queued
   behind others on a live engine is slow, not lost, and a retry would copy
   its prefill onto a second engine (:mod:`.upstream`);
4. at the end, feed back what the engine reported: ``usage.prompt_tokens``
   teaches the text-mode token estimator, ``prompt_tokens_details.cached_tokens``
   and the time to first byte go to ``Dispatcher.complete`` (confirming or
   correcting the index and calibrating the cost model); metrics and the
   decision log get one record. An attempt the engine did no prefill for
   goes to ``Dispatcher.reject`` instead, which takes its routing back out
   of the index: every abandoned attempt (refusal, unreachable, failure
   before the first byte), an upstream error status answered to the client
   (a 400 for a prompt past the context length), and a stream whose client
   left before the first upstream byte. A non-streaming request whose client
   left keeps its routing: the engine may have prefilled it.

A client that disconnects cancels the handler (aiohttp handler cancellation):
the upstream response is closed, which makes the engine abort the request, and
the request is recorded with status 499.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from prefixrouter.core.dispatch import Admission
from prefixrouter.core.policy import Outcome
from prefixrouter.core.router import Decision
from prefixrouter.core.types import WorkerId
from prefixrouter.errors import NoWorkerAvailable
from prefixrouter.gateway import body as large_json
from prefixrouter.gateway.access_log import note_of
from prefixrouter.gateway.controls import PRIORITY_HEADER, Ticket
from prefixrouter.gateway.decision_log import RequestOutcome
from prefixrouter.gateway.errors import (
    JSON,
    BadRequest,
    Forbidden,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    UpstreamFailed,
    error_body,
    error_response,
    upstream_error_body,
)
from prefixrouter.gateway.request_builder import CHAT, COMPLETIONS, BuiltRequest
from prefixrouter.gateway.sse import SseRelay, usage_figures
from prefixrouter.gateway.state import GatewayState
from prefixrouter.gateway.tenancy import TenantScope
from prefixrouter.gateway.upstream import FirstByteTimeout, StallTimeout, UpstreamResponse
from prefixrouter.gateway.workers import Worker

log = logging.getLogger("prefixrouter.gateway")

CLIENT_GONE = 499
# Bodies from this size up are parsed and built (orjson, validation, token
# ids) on one worker thread, not on the event loop: a 7.8 MB body of token
# ids takes about 0.2 s of CPU, which on the loop stalls every other request
# and /health with it. One thread, not several: orjson holds the GIL for a
# whole parse, so each concurrent parse is one more holder the loop thread
# must wait behind. Below this size the hand-off (about 50 us) would cost more
# than the parse it moves. Even so, one orjson call holds the GIL for the whole
# parse (0.1 s for 7.5 MB of token ids), which the loop thread needs too: the
# thread parses a long prompt array in slices (:mod:`.body`) and hashes the
# prompt's blocks (20-40 ms for 75,000 blocks) where it can be preempted.
OFF_LOOP_BODY_BYTES = 256 * 1024
# Connect failures are OSErrors; a broken connection is an UpstreamError (also one).
_UPSTREAM_ERRORS = (TimeoutError, OSError)
_DUMP_SLICE = 32_768
"""Token ids serialized per orjson call by :func:`_pack_token_ids` (well under a millisecond)."""


@dataclass(slots=True)
class Attempt:
    """How one attempt on one worker ended.

    Attributes:
        response: The response for the client (None: retry elsewhere).
        status: HTTP status the client got (or the upstream's, for a refusal).
        ok: The engine completed the request.
        usage: The engine's ``usage`` object, if it sent one.
        ttft_s: Time to the first upstream body byte of a stream.
        error: What went wrong.
        unreachable: The worker could not be reached (take it out of routing).
        suspect: The worker went silent (first-byte or stall timeout): out of
            routing until a health check passes.
        fallback: A refusal's own error response, answered if no other worker succeeds.
        no_prefill: The engine cannot have prefilled the prompt (it answered
            an error status, or the client left before the first byte): the
            routing is taken back (``Dispatcher.reject``).
    """

    response: web.StreamResponse | None
    status: int
    ok: bool = False
    usage: dict[str, Any] | None = None
    ttft_s: float | None = None
    error: str | None = None
    unreachable: bool = False
    suspect: bool = False
    fallback: web.Response | None = None
    no_prefill: bool = False


@dataclass(slots=True)
class _Retry:
    """Why the previous attempts failed (for the final error)."""

    tried: list[WorkerId] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_refusal: Attempt | None = None


class Proxy:
    """The completion handlers of one gateway."""

    def __init__(self, state: GatewayState) -> None:
        self.st = state
        cfg = state.config
        self.max_body = cfg.server.max_body_bytes
        self.max_attempts = cfg.proxy.max_attempts
        self.retry_statuses = frozenset(cfg.proxy.retry_statuses)
        self.retry_after = str(cfg.proxy.retry_after_s)
        self._pool: ThreadPoolExecutor | None = None
        self.first_byte_floor = cfg.proxy.first_byte_timeout_floor_s
        self.first_byte_factor = cfg.proxy.first_byte_timeout_factor

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._handle(request, CHAT, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._handle(request, COMPLETIONS, "/v1/completions")

    # ------------------------------------------------------------------ steps

    async def _handle(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        st = self.st
        st.requests_seen += 1
        t0 = st.clock()
        note = note_of(request)
        headers = request.headers
        try:
            # Who asks, and may they now: from the headers alone, before a body
            # of up to max_body_bytes is read and parsed for nothing (a missing
            # or unknown key, a tenant over its limits).
            tenant = st.tenancy.tenant_of(headers.get("Authorization"), headers.get("X-Tenant"))
            note.tenant = tenant
            ticket = st.controls.acquire(tenant, headers.get(PRIORITY_HEADER))
        except GatewayError as exc:
            st.metrics.request_done("", "none", exc.status)
            note.error = exc.code
            return error_response(exc)
        note.priority = ticket.priority
        try:
            return await self._admitted(request, kind, path, t0, ticket)
        finally:
            st.controls.release(ticket)

    async def _admitted(
        self, request: web.Request, kind: str, path: str, t0: float, ticket: Ticket
    ) -> web.StreamResponse:
        """A request past its tenant's limits: build, wait under overload, forward."""
        st = self.st
        note = note_of(request)
        try:
            built = await self._build(request, kind)
        except GatewayError as exc:
            st.metrics.request_done("", "none", exc.status)
            note.error = exc.code
            return error_response(exc)
        except Exception as exc:  # never crash: answer 500 in OpenAI's shape
            st.metrics.request_done("", "none", 500)
            note.error = "internal_error"
            return error_response(exc)
        rid = built.routing.request_id
        built.note = note
        note.request_id, note.stream = rid, built.stream
        try:
            try:
                await st.controls.wait(ticket)  # under overload: the priority queue
            except GatewayError as exc:
                st.metrics.request_done("", "none", exc.status)
                note.error = exc.code
                exc.headers["X-Request-Id"] = rid
                return error_response(exc)
            note.queue_wait_s = ticket.waited_s
            return await self._forward(request, built, path, t0)
        finally:
            if built.blocks is not None:  # parsed on the parse thread: a large body
                self._release(built)

    async def _build(self, request: web.Request, kind: str) -> BuiltRequest:
        st = self.st
        length = request.content_length
        if length is not None and length > self.max_body:
            raise PayloadTooLarge(
                f"request body of {length} bytes exceeds the limit of {self.max_body} bytes"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(
                f"request body exceeds the limit of {self.max_body} bytes"
            ) from None
        except (HttpProcessingError, RequestPayloadError) as exc:  # bad chunking, short body
            raise BadRequest(
                f"malformed request body ({type(exc).__name__})", code="invalid_body"
            ) from None
        headers = request.headers
        parse = partial(
            self._parse,
            raw,
            kind,
            # The scope's last argument is the body's cache_salt, which the builder validates.
            partial(st.tenancy.resolve, headers.get("Authorization"), headers.get("X-Tenant")),
            headers.get("X-Prefix-Class"),
        )
        if len(raw) < OFF_LOOP_BODY_BYTES:
            built = parse()
        else:
            built = await asyncio.get_running_loop().run_in_executor(
                self._parse_pool(), partial(parse, large=True)
            )
        if not st.registry.serves(built.model):
            if built.blocks is not None:
                self._release(built)
            raise NotFound(
                f"The model `{built.model}` does not exist.", code="model_not_found", param="model"
            )
        return built

    def _parse(
        self,
        raw: bytes,
        kind: str,
        scope_of: Callable[[str | None], TenantScope],
        prefix_class: str | None,
        large: bool = False,
    ) -> BuiltRequest:
        """Parse and validate a body: CPU only, safe on the parse thread (reads shared state).

        A ``large`` body (on the parse thread) is parsed by :func:`.body.loads`
        and its prompt hashed here too: ``Dispatcher.hash`` changes no state
        (text mode reads the learned chars-per-token, a float attribute that
        the loop thread replaces whole; two reads may straddle one update, a
        difference of one observation's weight), and ``_forward`` hands the
        blocks to ``Dispatcher.admit``.
        """
        try:
            body = large_json.loads(raw) if large else orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"invalid JSON body: {exc}", code="invalid_json") from None
        built = self.st.builder.build(body, raw, kind, scope_of, prefix_class)
        if large:
            built.blocks = self.st.dispatch.hash(built.routing)
            _pack_token_ids(built)
        return built

    def _release(self, built: BuiltRequest) -> None:
        """Free a large request's parsed body on the parse thread, not the loop.

        A million token ids are a million int objects: freeing them took the
        loop about 10 ms a body. Called once the request is answered, when
        nothing reads its body or routing request again.
        """
        self._parse_pool().submit(_drop_parsed, built)

    def _parse_pool(self) -> ThreadPoolExecutor:
        """The parse thread (made on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefixrouter-parse")
        return self._pool

    def close(self) -> None:
        """Stop the parse thread (the application's cleanup)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _forward(
        self, request: web.Request, built: BuiltRequest, path: str, t0: float
    ) -> web.StreamResponse:
        st = self.st
        rr = built.routing
        rid = rr.request_id
        # Made only when an attempt fails: most requests succeed at once.
        retry: _Retry | None = None
        adm: Admission | None = None
        dispatch = st.dispatch
        for _ in range(self.max_attempts):
            views = st.registry.views()
            now = st.clock()
            try:
                # A retry reuses the first attempt's hashes, on a worker not tried yet.
                if adm is None:
                    adm = dispatch.admit(rr, views, now, built.blocks)
                else:
                    adm = dispatch.retry(adm, views, now)
            except NoWorkerAvailable as exc:
                return self._no_worker(built, retry, exc, adm, t0)
            except Exception as exc:  # a routing bug answers 500, never crashes the gateway
                log.exception("routing failed for %s", rid)
                st.metrics.request_done("", "none", 500)
                return error_response(exc)
            decision = adm.decision
            worker = st.registry.workers[decision.worker_id]
            if retry is None:
                if st.lint is not None:
                    # Observe mode: lint the prompt rendered for routing; never change the body.
                    cls = decision.prefix_class
                    st.metrics.linted(cls, st.lint.observe(built.prompt, cls))
                chosen = decision.chosen
                terms = chosen.terms if chosen is not None else None
                st.metrics.routed(
                    decision.tier,
                    terms.queue_wait_s if terms is not None else None,
                    decision.warm_abandoned,
                    decision.prefix_class,
                )
            try:
                # What a stream has relayed so far: a client that leaves after
                # the engine's usage chunk still leaves its feedback behind.
                progress = Attempt(None, CLIENT_GONE, error="client disconnected")
                first_byte_s = self._first_byte_timeout(decision, built)
                if built.stream:
                    att = await self._stream(
                        request, built, adm, worker, path, progress, first_byte_s
                    )
                else:
                    att = await self._unary(built, worker, path, first_byte_s)
            except asyncio.CancelledError:
                # A stream's client that left before the first upstream byte:
                # the engine, aborted now, has not prefilled it.
                progress.no_prefill = built.stream and not adm.first_token
                self._finish(built, adm, worker, progress, t0, retry)
                raise
            except Exception as exc:  # a bug must not crash the gateway or leak load
                att = Attempt(error_response(exc), 500, error=f"{type(exc).__name__}: {exc}")
            if att.response is not None:
                try:
                    self._finish(built, adm, worker, att, t0, retry)
                except Exception:  # bookkeeping must not cost the client its answer
                    log.exception("feedback failed for %s", rid)
                return att.response
            # Failed before the first byte: forget this attempt, try another worker.
            self._abandon(adm, worker, att)
            if retry is None:
                retry = _Retry()
            retry.tried.append(worker.id)
            retry.errors.append(f"{worker.id}: {att.error}")
            if not att.unreachable:
                retry.last_refusal = att
        return self._no_worker(built, retry, "every attempt failed", adm, t0)

    def _first_byte_timeout(self, decision: Decision, built: BuiltRequest) -> float | None:
        """How long this attempt may wait for its first body byte (None: no limit).

        See the module docstring: a multiple of the predicted wait, with a floor.
        """
        floor = self.first_byte_floor
        if floor is None:
            return None
        stream = built.stream
        if not stream and not _output_bounded(built.body):
            # The engine generates up to the context length: no prediction holds.
            return None
        chosen = decision.chosen
        terms = chosen.terms if chosen is not None else None
        if terms is None:
            return floor if stream else None
        wait = terms.ttft_s if stream else terms.ttft_s + terms.decode_s
        return max(floor, self.first_byte_factor * wait)

    def _payload(self, built: BuiltRequest, worker: Worker) -> bytes:
        salt = built.scope.cache_salt
        if salt is not None and not worker.config.supports_cache_salt:
            salt = None
        inject = built.stream and not built.client_wants_usage
        if salt is None and not inject:
            return built.raw
        body = dict(built.body)
        if salt is not None:
            body["cache_salt"] = salt
        if inject:
            opts = body.get("stream_options")
            body["stream_options"] = {
                **(opts if isinstance(opts, dict) else {}),
                "include_usage": True,
            }
        return orjson.dumps(body)

    async def _unary(
        self, built: BuiltRequest, worker: Worker, path: str, first_byte_s: float | None
    ) -> Attempt:
        upstream = self.st.upstream
        assert upstream is not None
        try:
            resp = await upstream.post(
                worker.endpoint, path, self._payload(built, worker), first_byte_s
            )
            try:
                body = await resp.read()
            finally:
                resp.release()
        except _UPSTREAM_ERRORS as exc:
            return _failed(exc)
        status = resp.status
        ctype = resp.content_type or JSON
        hdrs = {"X-Prefixrouter-Worker": worker.id, "X-Request-Id": built.routing.request_id}
        if status == 200:
            usage = None
            try:
                data = orjson.loads(body)
                usage = data.get("usage") if isinstance(data, dict) else None
            except orjson.JSONDecodeError:
                pass
            resp_out = web.Response(body=body, status=200, content_type=ctype, headers=hdrs)
            return Attempt(resp_out, 200, ok=True, usage=usage if isinstance(usage, dict) else None)
        return self._upstream_error(status, body, hdrs)

    def _upstream_error(self, status: int, body: bytes, hdrs: dict[str, str]) -> Attempt:
        out = web.Response(
            body=upstream_error_body(body, status), status=status, content_type=JSON, headers=hdrs
        )
        # An error status before any body byte: the engine did no prefill
        # (a 400 for a prompt past the context length, an overload refusal).
        if status in self.retry_statuses:
            # A refusal: try another worker; if none succeeds, the client gets this one.
            return Attempt(None, status, error=f"answered {status}", fallback=out, no_prefill=True)
        return Attempt(out, status, error=f"upstream answered {status}", no_prefill=True)

    async def _stream(
        self,
        request: web.Request,
        built: BuiltRequest,
        adm: Admission,
        worker: Worker,
        path: str,
        progress: Attempt,
        first_byte_s: float | None,
    ) -> Attempt:
        st = self.st
        upstream = st.upstream
        assert upstream is not None
        t_send = st.clock()
        try:
            resp = await upstream.post(
                worker.endpoint, path, self._payload(built, worker), first_byte_s
            )
        except _UPSTREAM_ERRORS as exc:
            return _failed(exc)
        hdrs = {"X-Prefixrouter-Worker": worker.id, "X-Request-Id": built.routing.request_id}
        done = False
        try:
            if resp.status != 200:
                try:
                    body = await resp.read()
                except _UPSTREAM_ERRORS as exc:
                    return _failed(exc)
                done = True
                return self._upstream_error(resp.status, body, hdrs)
            try:
                first = await resp.readany()
            except _UPSTREAM_ERRORS as exc:
                return _failed(exc)
            if not first:
                return Attempt(
                    None, 502, error="closed the stream before sending data", unreachable=True
                )
            ttft = st.clock() - t_send
            st.dispatch.first_token(adm)
            out = web.StreamResponse(status=200, headers=hdrs)
            out.content_type = resp.content_type or "text/event-stream"
            out.headers["Cache-Control"] = "no-cache"
            await out.prepare(request)
            # ---- bytes are reaching the client from here on: never retry ----
            progress.ttft_s = ttft
            done, att = await self._relay(out, resp, first, built, ttft, progress)
            return att
        finally:
            if done:
                resp.release()
            else:
                resp.close()  # an unfinished upstream request: the engine aborts it

    async def _relay(
        self,
        out: web.StreamResponse,
        resp: UpstreamResponse,
        first: bytes,
        built: BuiltRequest,
        ttft: float,
        progress: Attempt,
    ) -> tuple[bool, Attempt]:
        relay = SseRelay(strip_usage=not built.client_wants_usage)
        chunk = first
        upstream_error: str | None = None
        stalled = False
        try:
            while chunk:
                data = relay.feed(chunk)
                if relay.usage is not None and progress.usage is None:
                    # The usage chunk comes last: the engine has finished.
                    progress.usage, progress.ok = relay.usage, True
                if data:
                    await out.write(data)
                try:
                    chunk = await resp.readany()
                except _UPSTREAM_ERRORS as exc:
                    upstream_error = _describe(exc)
                    stalled = isinstance(exc, StallTimeout)
                    break
            tail = relay.finish()
            if tail:
                await out.write(tail)
            if upstream_error is not None:
                what, code = ("stalled", "504") if stalled else ("broke", "502")
                msg = f"upstream stream {what}: {upstream_error}"
                await out.write(b"data: " + error_body(msg, "upstream_error", code) + b"\n\n")
            await out.write_eof()
        except ConnectionResetError:
            gone = Attempt(
                out, CLIENT_GONE, usage=relay.usage, ttft_s=ttft, error="client disconnected"
            )
            gone.ok = progress.ok  # the engine finished if its usage chunk came
            return False, gone
        if upstream_error is not None:
            status = 504 if stalled else 502
            return False, Attempt(
                out, status, usage=relay.usage, ttft_s=ttft, error=upstream_error, suspect=stalled
            )
        return True, Attempt(out, 200, ok=True, usage=relay.usage, ttft_s=ttft)

    # ------------------------------------------------------------------ bookkeeping

    def _abandon(self, adm: Admission, worker: Worker, att: Attempt) -> None:
        st = self.st
        # Abandoned before its first byte (refused, unreachable, broken):
        # nothing was prefilled there, so the routing is taken back and the
        # retry elsewhere leaves no phantom prefix on this worker.
        st.dispatch.reject(adm, st.clock())
        if att.unreachable:
            st.registry.mark_failed(worker, att.error or "unreachable")
        elif att.suspect:
            st.registry.mark_suspect(worker, att.error or "timed out")
        st.metrics.retried(worker.id, str(att.status))

    def _finish(
        self,
        built: BuiltRequest,
        adm: Admission,
        worker: Worker,
        att: Attempt,
        t0: float,
        retry: _Retry | None,
    ) -> None:
        st = self.st
        dispatch = st.dispatch
        decision = adm.decision
        now = st.clock()
        if att.suspect:  # the stream stalled after its first byte
            st.registry.mark_suspect(worker, att.error or "stalled")
        prompt, cached = usage_figures(att.usage)
        ok = att.ok
        # Text mode: the engine's token count for the prompt's characters
        # teaches characters per token (first, inside complete(), which then
        # converts the cached tokens at the estimate; and peers learn it too).
        chars, tokens = (built.text_chars, prompt) if ok and prompt and built.text_chars else (0, 0)
        # A removed worker's admission settles without feedback (the dispatcher
        # knows); its prefix is not noted as served either.
        if ok and cached is not None:
            answer = Outcome(cached, att.ttft_s, True)
            miss = dispatch.complete(adm, answer, now, prompt_chars=chars, prompt_tokens=tokens)
            if not worker.removed:
                last = st.note_served(worker.id, decision.prefix_key, now)
                if miss and last is not None:
                    st.metrics.eviction_observed(now - last, decision.prefix_class)
        elif att.no_prefill:
            if chars:
                dispatch.observe_prompt_tokens(chars, tokens, adm)
            dispatch.reject(adm, now)
        else:
            # No report of reuse (or a failure): nothing to confirm or correct.
            dispatch.complete(
                adm, Outcome(0, att.ttft_s, ok=False), now, prompt_chars=chars, prompt_tokens=tokens
            )
        if ok and prompt and cached is not None:
            st.metrics.usage(
                built.model,
                worker.config.pool,
                decision.prefix_class,
                prompt,
                cached,
                decision.predicted_cached_tokens,
                att.ttft_s,
            )
        st.metrics.request_done(worker.id, decision.tier, att.status)
        self._log(
            built,
            decision,
            att.status,
            cached,
            prompt,
            att.ttft_s,
            now - t0,
            retry,
            att.error,
            1 if retry is None else len(retry.tried) + 1,
        )

    def _log(
        self,
        built: BuiltRequest,
        decision: Decision,
        status: int,
        cached: int | None,
        prompt: int | None,
        ttft_s: float | None,
        latency_s: float,
        retry: _Retry | None,
        error: str | None,
        attempts: int,
    ) -> None:
        note = built.note
        if note is not None:
            note.worker, note.tier, note.status = decision.worker_id, decision.tier, status
            note.cached_tokens, note.prompt_tokens, note.ttft_s = cached, prompt, ttft_s
            note.error = error
        self.st.decisions.record(
            decision,
            RequestOutcome(
                model=built.model,
                tenant=built.scope.tenant,
                status=status,
                actual_cached_tokens=cached,
                prompt_tokens=prompt,
                ttft_s=ttft_s,
                latency_s=latency_s,
                attempts=attempts,
                retried_from=() if retry is None else tuple(retry.tried),
                stream=built.stream,
                error=error,
                ts=time.time(),
            ),
        )

    def _no_worker(
        self,
        built: BuiltRequest,
        retry: _Retry | None,
        no_worker: str | NoWorkerAvailable,
        adm: Admission | None,
        t0: float,
    ) -> web.StreamResponse:
        """The answer when no (further) worker can take the request.

        When the tenant filter removed workers the message says so: "no
        healthy worker" would send an operator looking at the wrong thing.
        A 403 when no worker that is down could serve the tenant either (no
        worker is configured for it: retrying cannot help), else a 503 (the
        tenant's own workers are down).
        """
        why = str(no_worker)
        hdrs = {"X-Request-Id": str(built.routing.request_id)}
        refusal = retry.last_refusal if retry is not None else None
        filtered = no_worker.filtered if isinstance(no_worker, NoWorkerAvailable) else {}
        resp: web.Response
        if refusal is not None and refusal.fallback is not None:
            resp = refusal.fallback  # the upstream's own error keeps its status
        elif retry is not None and retry.tried:
            detail = "; ".join(retry.errors)
            resp = error_response(
                UpstreamFailed(f"no worker could serve the request ({detail})", headers=hdrs)
            )
        elif "tenant" in filtered.values():
            tenant = built.routing.tenant
            who = f"tenant {tenant!r}" if tenant else "requests without a tenant"
            reasons = ", ".join(f"{w}: {f}" for w, f in sorted(filtered.items()))
            msg = f"no worker serves {who} for model {built.model!r} ({reasons})"
            # Only a worker that is down could still serve it later (one of
            # another model or pool never will): retrying cannot help without one.
            if "health" not in filtered.values():
                resp = error_response(Forbidden(msg, code="tenant_not_served", headers=hdrs))
            else:
                resp = error_response(
                    ServiceUnavailable(msg, headers={"Retry-After": self.retry_after, **hdrs})
                )
        else:
            resp = error_response(
                ServiceUnavailable(
                    f"no healthy worker can serve model {built.model!r}: {why}",
                    headers={"Retry-After": self.retry_after, **hdrs},
                )
            )
        decision = adm.decision if adm is not None else None
        tier = decision.tier if decision is not None else "none"
        self.st.metrics.request_done("", tier, resp.status)
        if built.note is not None:
            built.note.error = why  # _log below names the attempts' errors instead
        if decision is not None:  # attempts were made: none is lost silently
            errors = "; ".join(retry.errors) if retry is not None else ""
            latency = self.st.clock() - t0
            self._log(
                built,
                decision,
                resp.status,
                None,
                None,
                None,
                latency,
                retry,
                errors or why,
                len(retry.tried) if retry is not None else 0,
            )
        return resp


def _output_bounded(body: dict[str, Any]) -> bool:
    """Whether the client bounded the output (``max_tokens`` or ``max_completion_tokens``)."""
    return body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None


def _failed(exc: BaseException) -> Attempt:
    """An attempt that failed before its first byte: retried on another worker.

    A first-byte timeout makes the worker suspect (it may only be slow); any
    other failure means it could not be reached.
    """
    if isinstance(exc, FirstByteTimeout):
        return Attempt(None, 504, error=_describe(exc), suspect=True)
    return Attempt(None, 502, error=_describe(exc), unreachable=True)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _pack_token_ids(built: BuiltRequest) -> None:
    """Hold a large prompt of token ids as packed bytes, not a list of int objects.

    A list is a container the cyclic garbage collector walks element by
    element, and a young one is walked at every young collection: with a
    million ids alive through a request, the collections that routing's
    allocations trigger took up to 84 ms each on the event loop (measured
    with 8 such bodies in flight). An ``array("I")`` (the ids are checked to
    be in ``[0, 2^32)``) is walked in O(1) and is what the hasher packs
    anyway; the body keeps the ids as a pre-serialized JSON fragment, dumped
    in slices (each a short C call, so the loop thread gets the GIL between
    them), for the rare re-serialization (:meth:`Proxy._payload`).
    """
    tokens = built.routing.tokens
    same_list = built.body.get("prompt") is tokens  # not a flattened list of lists
    if not isinstance(tokens, list) or not same_list:
        return
    pieces = [
        orjson.dumps(tokens[lo : lo + _DUMP_SLICE])[1:-1]
        for lo in range(0, len(tokens), _DUMP_SLICE)
    ]
    built.body["prompt"] = orjson.Fragment(b"[" + b",".join(pieces) + b"]")
    built.routing.tokens = array("I", tokens)
    _clear_in_slices(tokens)


def _clear_in_slices(items: list[Any]) -> None:
    """Empty a long list from its end, a slice per C call (freeing a million ints takes ~10 ms)."""
    while items:
        del items[-_DUMP_SLICE:]


def _drop_parsed(built: BuiltRequest) -> None:
    """Empty the containers that hold a parsed body's values (on the parse thread)."""
    tokens = built.routing.tokens
    if isinstance(tokens, list):
        _clear_in_slices(tokens)
    built.body.clear()
