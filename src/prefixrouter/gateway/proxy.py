"""Forwarding: route, send, retry before the first byte, stream, feed back.

Per request (``POST /v1/chat/completions`` or ``/v1/completions``):

1. read the body (413 past ``server.max_body_bytes``), parse it once (400 on
   invalid JSON), build the routing request (400 naming a bad field; 401 on a
   bad key where keys are required) and check the model (404);
2. ``Router.route`` over the prebuilt worker views with fresh in-flight
   figures (503 + ``Retry-After`` when no worker can serve); ``on_routed`` and
   the in-flight ledger record the speculative placement;
3. forward the body (re-serialized only to set ``cache_salt`` or to ask a
   stream for its usage chunk). A worker that cannot be reached, answers a
   *refusal* status (``proxy.retry_statuses``), or fails before its first body
   byte is abandoned and the request is routed again among the workers not yet
   tried, up to ``proxy.max_attempts``. The client's response is started only
   when the first upstream byte is in hand, and from then on nothing is
   retried: no request ever reaches a second worker after bytes reached the
   client. A stream that breaks later ends with an SSE ``error`` event;
4. at the end, feed back what the engine reported: ``usage.prompt_tokens``
   teaches the text-mode token estimator, ``prompt_tokens_details.cached_tokens``
   and the time to first byte go to ``Router.on_completed`` (confirming or
   correcting the index and calibrating the cost model); metrics and the
   decision log get one record. An attempt the engine did no prefill for
   goes to ``Router.on_rejected`` instead, which takes its routing back out
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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from prefixrouter.core.policy import Outcome
from prefixrouter.core.router import Decision
from prefixrouter.core.types import WorkerId
from prefixrouter.errors import NoWorkerAvailable
from prefixrouter.gateway.decision_log import RequestOutcome
from prefixrouter.gateway.errors import (
    JSON,
    BadRequest,
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
from prefixrouter.gateway.upstream import UpstreamResponse
from prefixrouter.gateway.workers import Worker

log = logging.getLogger("prefixrouter.gateway")

CLIENT_GONE = 499
# Connect failures are OSErrors; a broken connection is an UpstreamError (also one).
_UPSTREAM_ERRORS = (TimeoutError, OSError)


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
        fallback: A refusal's own error response, answered if no other worker succeeds.
        no_prefill: The engine cannot have prefilled the prompt (it answered
            an error status, or the client left before the first byte): the
            routing is taken back (``Router.on_rejected``).
    """

    response: web.StreamResponse | None
    status: int
    ok: bool = False
    usage: dict[str, Any] | None = None
    ttft_s: float | None = None
    error: str | None = None
    unreachable: bool = False
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
        try:
            built = await self._build(request, kind)
        except GatewayError as exc:
            st.metrics.request_done("", "none", exc.status)
            return error_response(exc)
        except Exception as exc:  # never crash: answer 500 in OpenAI's shape
            st.metrics.request_done("", "none", 500)
            return error_response(exc)
        return await self._forward(request, built, path, t0)

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
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"invalid JSON body: {exc}", code="invalid_json") from None
        headers = request.headers
        built = st.builder.build(
            body,
            raw,
            kind,
            # The scope's last argument is the body's cache_salt, which the builder validates.
            partial(st.tenancy.resolve, headers.get("Authorization"), headers.get("X-Tenant")),
            headers.get("X-Prefix-Class"),
        )
        if not st.registry.serves(built.model):
            raise NotFound(
                f"The model `{built.model}` does not exist.", code="model_not_found", param="model"
            )
        return built

    async def _forward(
        self, request: web.Request, built: BuiltRequest, path: str, t0: float
    ) -> web.StreamResponse:
        st = self.st
        rr = built.routing
        rid = rr.request_id
        # Made only when an attempt fails: most requests succeed at once.
        retry: _Retry | None = None
        decision: Decision | None = None
        for _ in range(self.max_attempts):
            views = st.registry.views()
            if retry is not None:
                tried = retry.tried
                views = [v for v in views if v.worker_id not in tried]
            now = st.clock()
            try:
                decision = st.router.route(rr, views, now)
            except NoWorkerAvailable as exc:
                return self._no_worker(built, retry, str(exc), decision, t0)
            except Exception as exc:  # a routing bug answers 500, never crashes the gateway
                log.exception("routing failed for %s", rid)
                st.metrics.request_done("", "none", 500)
                return error_response(exc)
            worker = st.registry.workers[decision.worker_id]
            st.router.on_routed(decision, now)
            est = decision.prompt_tokens
            st.ledger.on_routed(
                rid, worker.id, max(0, est - decision.predicted_cached_tokens), est, rr.max_tokens
            )
            if retry is None:
                if st.lint is not None:
                    # Observe mode: count what the linter finds, never change the body.
                    cls = decision.prefix_class
                    st.metrics.linted(cls, st.lint.observe(built.body, cls))
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
                if built.stream:
                    att = await self._stream(request, built, worker, path, progress)
                else:
                    att = await self._unary(built, worker, path)
            except asyncio.CancelledError:
                # A stream's client that left before the first upstream byte:
                # the engine, aborted now, has not prefilled it.
                progress.no_prefill = built.stream and not st.ledger.first_token_seen(rid)
                self._finish(built, decision, worker, progress, t0, retry)
                raise
            except Exception as exc:  # a bug must not crash the gateway or leak load
                att = Attempt(error_response(exc), 500, error=f"{type(exc).__name__}: {exc}")
            if att.response is not None:
                try:
                    self._finish(built, decision, worker, att, t0, retry)
                except Exception:  # bookkeeping must not cost the client its answer
                    log.exception("feedback failed for %s", rid)
                return att.response
            # Failed before the first byte: forget this attempt, try another worker.
            self._abandon(decision, worker, att)
            if retry is None:
                retry = _Retry()
            retry.tried.append(worker.id)
            retry.errors.append(f"{worker.id}: {att.error}")
            if not att.unreachable:
                retry.last_refusal = att
        return self._no_worker(built, retry, "every attempt failed", decision, t0)

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

    async def _unary(self, built: BuiltRequest, worker: Worker, path: str) -> Attempt:
        upstream = self.st.upstream
        assert upstream is not None
        try:
            resp = await upstream.post(worker.endpoint, path, self._payload(built, worker))
            try:
                body = await resp.read()
            finally:
                resp.release()
        except _UPSTREAM_ERRORS as exc:
            return Attempt(None, 502, error=_describe(exc), unreachable=True)
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
        worker: Worker,
        path: str,
        progress: Attempt,
    ) -> Attempt:
        st = self.st
        upstream = st.upstream
        assert upstream is not None
        t_send = st.clock()
        try:
            resp = await upstream.post(worker.endpoint, path, self._payload(built, worker))
        except _UPSTREAM_ERRORS as exc:
            return Attempt(None, 502, error=_describe(exc), unreachable=True)
        hdrs = {"X-Prefixrouter-Worker": worker.id, "X-Request-Id": built.routing.request_id}
        done = False
        try:
            if resp.status != 200:
                try:
                    body = await resp.read()
                except _UPSTREAM_ERRORS as exc:
                    return Attempt(None, 502, error=_describe(exc), unreachable=True)
                done = True
                return self._upstream_error(resp.status, body, hdrs)
            try:
                first = await resp.readany()
            except _UPSTREAM_ERRORS as exc:
                return Attempt(None, 502, error=_describe(exc), unreachable=True)
            if not first:
                return Attempt(
                    None, 502, error="closed the stream before sending data", unreachable=True
                )
            ttft = st.clock() - t_send
            st.ledger.on_first_token(built.routing.request_id)
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
                    break
            tail = relay.finish()
            if tail:
                await out.write(tail)
            if upstream_error is not None:
                msg = f"upstream stream broke: {upstream_error}"
                await out.write(b"data: " + error_body(msg, "upstream_error", "502") + b"\n\n")
            await out.write_eof()
        except ConnectionResetError:
            gone = Attempt(
                out, CLIENT_GONE, usage=relay.usage, ttft_s=ttft, error="client disconnected"
            )
            gone.ok = progress.ok  # the engine finished if its usage chunk came
            return False, gone
        if upstream_error is not None:
            return False, Attempt(out, 502, usage=relay.usage, ttft_s=ttft, error=upstream_error)
        return True, Attempt(out, 200, ok=True, usage=relay.usage, ttft_s=ttft)

    # ------------------------------------------------------------------ bookkeeping

    def _abandon(self, decision: Decision, worker: Worker, att: Attempt) -> None:
        st = self.st
        st.ledger.on_completed(decision.context.request.request_id)
        if not worker.removed:
            # Abandoned before its first byte (refused, unreachable, broken):
            # nothing was prefilled there, so the routing is taken back and
            # the retry elsewhere leaves no phantom prefix on this worker.
            st.router.on_rejected(decision, st.clock())
        if att.unreachable:
            st.registry.mark_failed(worker, att.error or "unreachable")
        st.metrics.retried(worker.id, str(att.status))

    def _finish(
        self,
        built: BuiltRequest,
        decision: Decision,
        worker: Worker,
        att: Attempt,
        t0: float,
        retry: _Retry | None,
    ) -> None:
        st = self.st
        now = st.clock()
        st.ledger.on_completed(built.routing.request_id)
        prompt, cached = usage_figures(att.usage)
        ok = att.ok
        if not worker.removed:
            if ok and cached is not None:
                miss = st.router.on_completed(decision, Outcome(cached, att.ttft_s, True), now)
                last = st.note_served(worker.id, decision.prefix_key, now)
                if miss and last is not None:
                    st.metrics.eviction_observed(now - last)
            elif att.no_prefill:
                st.router.on_rejected(decision, now)
            else:
                # No report of reuse (or a failure): nothing to confirm or correct.
                st.router.on_completed(decision, Outcome(0, att.ttft_s, ok=False), now)
        if ok and prompt:
            if built.text_chars:
                st.router.hasher.estimator.observe(built.text_chars, prompt)
            if cached is not None:
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
        why: str,
        decision: Decision | None,
        t0: float,
    ) -> web.StreamResponse:
        """The answer when no (further) worker can take the request."""
        hdrs = {"X-Request-Id": str(built.routing.request_id)}
        refusal = retry.last_refusal if retry is not None else None
        resp: web.Response
        if refusal is not None and refusal.fallback is not None:
            resp = refusal.fallback  # the upstream's own error keeps its status
        elif retry is not None and retry.tried:
            detail = "; ".join(retry.errors)
            resp = error_response(
                UpstreamFailed(f"no worker could serve the request ({detail})", headers=hdrs)
            )
        else:
            resp = error_response(
                ServiceUnavailable(
                    f"no healthy worker can serve model {built.model!r}: {why}",
                    headers={"Retry-After": self.retry_after, **hdrs},
                )
            )
        tier = decision.tier if decision is not None else "none"
        self.st.metrics.request_done("", tier, resp.status)
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


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
