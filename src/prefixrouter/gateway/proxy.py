"""Forwarding: route, send, retry before the first byte, stream, feed back.

Admission (steps 1-2 below) and settlement (step 4) are
:class:`~prefixrouter.gateway.flow.RequestFlow`'s, shared with the endpoint
picker (:mod:`prefixrouter.epp`); this module carries the bytes.

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
   (``Dispatcher.retry``) routes the same hashes among the workers not tried.
   The fleet controls (:mod:`.fleet`) steer it first: its rollout group's
   policy and pool, and its session's pin (``affinity.header``);
3. forward the body (re-serialized only to set ``cache_salt`` or to ask a
   stream for its usage chunk). An attempt is abandoned and the request
   routed again among the workers not yet tried, up to ``proxy.max_attempts``,
   only while nothing shows that the engine took it on: a worker that cannot
   be reached or closes the connection before answering, a *refusal* status
   (``proxy.retry_statuses``), a first-byte timeout, and for a stream, whose
   headers come at once (before the prefill), a failure before its first body
   byte. Once the engine has answered (a non-streamed answer's headers, which
   an engine sends with the whole answer; a stream's first body byte), the
   request never reaches a second worker: it may have been generated already,
   and a retry would generate it again. A non-streamed answer that then
   breaks is answered 502, one that times out 504 ``upstream_timeout``; a
   stream that breaks later, or ends without its ``[DONE]`` event, ends with
   an SSE ``error`` event. The client's response is started only when the
   first upstream byte is in hand.

   What the engine sent goes on as it sent it: SSE events as each arrives,
   whatever their line ends (:mod:`.sse`), a stream's content type with its
   parameters (a charset). A stream the engine answered with a whole JSON body (it
   ignored ``"stream": true``) is answered as a non-streamed answer is: the
   body as it came, its usage read, a 502 if it is not JSON, never an SSE
   event appended to it. An engine's error status that is passed on keeps
   the engine's end-to-end headers, ``Retry-After`` above all
   (:func:`_passed_headers`); the gateway's ``X-Request-Id`` and
   ``X-Prefixrouter-Worker`` replace the engine's.

   **Timeouts.** An attempt whose first body byte does not come within the
   *first-byte timeout* is abandoned (the engine aborts it) and retried
   elsewhere (unless the engine answered already: a non-streamed answer
   whose headers came gets a 504), and its worker is marked *suspect*: out of routing until a
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
   its prefill onto a second engine (:mod:`.upstream`).

   The total timeout (``proxy.request_timeout_s``) is never retried: the
   engine was working on the request, maybe for all that time. The client
   gets a 504 ``upstream_timeout`` when it expires (an SSE ``error`` event
   with code ``504`` once a stream has begun), not after ``max_attempts``
   times it. It marks no worker (a long generation on a live engine runs
   into it; a frozen one is caught by the timeouts above and its health
   checks), and a 504 does not count toward outlier ejection;
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
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from prefixrouter.core.dispatch import Admission
from prefixrouter.core.router import Decision
from prefixrouter.core.types import WorkerId
from prefixrouter.errors import NoWorkerAvailable, exception_text
from prefixrouter.gateway.access_log import RequestNote, note_of
from prefixrouter.gateway.controls import PRIORITY_HEADER, Ticket
from prefixrouter.gateway.errors import (
    JSON,
    BadRequest,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    UpstreamFailed,
    UpstreamTimeout,
    error_body,
    error_response,
    json_body,
    model_not_found,
    upstream_error_body,
)
from prefixrouter.gateway.fleet import Steer
from prefixrouter.gateway.flow import RequestFlow, Served
from prefixrouter.gateway.request_builder import CHAT, COMPLETIONS, BuiltRequest
from prefixrouter.gateway.sse import SseRelay, answer_usage
from prefixrouter.gateway.state import GatewayState
from prefixrouter.gateway.upstream import (
    FirstByteTimeout,
    StallTimeout,
    TotalTimeout,
    UpstreamResponse,
    forwarded_headers,
)
from prefixrouter.gateway.workers import CLIENT_GONE, Worker

log = logging.getLogger("prefixrouter.gateway")

PASSTHROUGH_PATHS = frozenset(
    (
        "/v1/embeddings", "/tokenize", "/detokenize",
        "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
    )
)  # fmt: skip
"""Engine endpoints relayed to one worker without prefix routing (:meth:`Proxy.passthrough`)."""

PASSTHROUGH = "passthrough"
"""The ``decision`` label of passthrough requests in ``prefixrouter_requests_total``."""

RESPONSES_PREFIX = "/v1/responses"
RESPONSES_NOT_ROUTED = (
    "the gateway does not route the Responses API (/v1/responses): vLLM keeps a"
    " response's state (previous_response_id, background responses, retrieval and"
    " cancel) in the memory of the one server that made it, so a follow-up routed to"
    " another replica would not find it. Send Responses API calls to one engine"
    " directly (its own base_url), or use /v1/chat/completions through the gateway."
)

# Connect failures are OSErrors; a broken connection is an UpstreamError (also one).
_UPSTREAM_ERRORS = (TimeoutError, OSError)
# A stream's upstream content types relayed as SSE ("": an engine that sends none).
_SSE_TYPES = frozenset(("text/event-stream", ""))
# Engine response headers an error answer does not pass on (_passed_headers).
_NOT_PASSED = frozenset(
    (
        "connection", "proxy-connection", "keep-alive", "te", "trailer", "transfer-encoding",
        "upgrade", "proxy-authenticate", "proxy-authorization",
        "content-length", "content-encoding", "content-type",
        "date", "server", "alt-svc", "set-cookie",
        "x-request-id", "x-prefixrouter-worker",
    )
)  # fmt: skip


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
        broke: The connection to the worker broke mid-answer (a crashed or
            killed engine does that to every stream it held): the worker is
            checked at once, out of routing until the check passes, instead
            of when the next request or poll reaches it; the failure still
            counts toward outlier ejection.
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
    broke: bool = False


@dataclass(slots=True)
class _Retry:
    """Why the previous attempts failed (for the final error)."""

    tried: list[WorkerId] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_refusal: Attempt | None = None
    # Every attempt so far timed out (504): the final answer is a 504 then.
    timed_out: bool = True

    def failed(self, worker: WorkerId, att: Attempt) -> None:
        """An attempt on ``worker`` failed before the engine answered."""
        self.tried.append(worker)
        self.errors.append(f"{worker}: {att.error}")
        self.timed_out = self.timed_out and att.status == 504
        if not att.unreachable:
            self.last_refusal = att

    def answer(self, hdrs: dict[str, str], expose: bool, log_name: str) -> web.Response | None:
        """The answer once no worker is left, if any was tried: the last refusal's
        own (its status kept), else a 502 naming every worker tried (504 if every
        attempt timed out; without ``expose``, their errors are in ``log_name``)."""
        refusal = self.last_refusal
        if refusal is not None and refusal.fallback is not None:
            return refusal.fallback
        if not self.tried:
            return None
        errors = self.errors
        detail = (
            "; ".join(errors)
            if expose
            else f"{len(errors)} tried; their errors are in the {log_name}"
        )
        failed = UpstreamTimeout if self.timed_out else UpstreamFailed
        return error_response(failed(f"no worker could serve the request ({detail})", headers=hdrs))


class Proxy:
    """The completion handlers of one gateway."""

    def __init__(self, state: GatewayState) -> None:
        self.st = state
        cfg = state.config
        self.max_body = cfg.server.max_body_bytes
        self.max_attempts = cfg.proxy.max_attempts
        self.retry_statuses = frozenset(cfg.proxy.retry_statuses)
        self.retry_after = str(cfg.proxy.retry_after_s)
        self.flow = RequestFlow(state)
        self.first_byte_floor = cfg.proxy.first_byte_timeout_floor_s
        self.first_byte_factor = cfg.proxy.first_byte_timeout_factor
        # Passthrough requests in flight per worker (the ledger counts only
        # routed completions): least-in-flight picking sees them too.
        self._relayed: dict[WorkerId, int] = {}

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
        built.note = note
        built.client_id = note.request_id  # the middleware's: the client's own id, if sane
        rid = built.reply_id
        note.request_id, note.stream = rid, built.stream
        try:
            try:
                await st.controls.wait(ticket)  # under overload: the priority queue
            except GatewayError as exc:
                # A request shed after waiting is logged with its wait, as the
                # queue-wait histogram counts it.
                note.queue_wait_s = ticket.waited_s
                st.metrics.request_done("", "none", exc.status)
                note.error = exc.code
                exc.headers["X-Request-Id"] = rid
                return error_response(exc)
            note.queue_wait_s = ticket.waited_s
            return await self._forward(request, built, path, t0)
        finally:
            if built.blocks is not None:  # parsed on the parse thread: a large body
                self.flow.release(built)

    async def _build(self, request: web.Request, kind: str) -> BuiltRequest:
        # A missing or unknown key is refused from the headers alone, before a
        # body of up to max_body_bytes is read and parsed for nothing.
        raw = await self._read_body(request)
        headers = request.headers
        return await self.flow.build(
            raw,
            kind,
            headers.get("Authorization"),
            headers.get("X-Tenant"),
            headers.get("X-Prefix-Class"),
        )

    async def _read_body(self, request: web.Request) -> bytes:
        """The request's body, once its headers passed (key, ``Content-Length``).

        Raises:
            Unauthorized: A missing or unknown key where one is required.
            PayloadTooLarge: Over ``server.max_body_bytes``.
            BadRequest: A body that could not be read (bad chunking, short body).
        """
        self.flow.check_headers(request.headers.get("Authorization"), request.content_length)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(
                f"request body exceeds the limit of {self.max_body} bytes"
            ) from None
        except (HttpProcessingError, RequestPayloadError) as exc:  # bad chunking, short body
            raise BadRequest(
                f"malformed request body ({type(exc).__name__})", code="invalid_body"
            ) from None

    # ------------------------------------------------------------------ passthrough

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """``POST`` to one of :data:`PASSTHROUGH_PATHS`: relayed to one worker, not routed.

        For a client that points one ``base_url`` at the gateway and uses an
        engine's other endpoints beside its completions (embeddings for RAG,
        tokenize, score, rerank). The rules:

        * the same tenant rules as a completion: the API key (401), a refused
          ``X-Tenant`` (403), the tenant's limits (429) and, under overload,
          the priority queue; the body limit (413);
        * the body must be a JSON object (400); its ``model``, when it names
          one, picks among the workers that list it (404 for a name no
          worker ever listed, 503 with ``Retry-After`` for one whose workers
          are all out of routing); without one, any routable worker will do;
          a worker reserved for other tenants is never picked;
        * of those, the one with the fewest requests in flight (the gateway's
          completions and relays, plus the engine's own queue): no prefix
          hashing, no index, no cost model, no decision-log record;
        * forwarded as it came, with the request id and trace context
          (:func:`~prefixrouter.gateway.upstream.forwarded_headers`), and
          retried on another worker under the completions' rules: only
          before the engine answered (unreachable, a refusal status in
          ``proxy.retry_statuses``, a 404 for the model, which also lists
          that worker's models again), up to ``proxy.max_attempts``;
        * the answer relayed as the engine sent it: status, body, content
          type, and an error's end-to-end headers.

        Counted in ``prefixrouter_requests_total`` with ``decision`` set to
        ``passthrough``, and in the access log (worker, tenant, status).
        """
        st = self.st
        st.requests_seen += 1
        note = note_of(request)
        headers = request.headers
        try:
            tenant = st.tenancy.tenant_of(headers.get("Authorization"), headers.get("X-Tenant"))
            note.tenant = tenant
            ticket = st.controls.acquire(tenant, headers.get(PRIORITY_HEADER))
        except GatewayError as exc:
            return self._relay_refused(note, exc)
        note.priority = ticket.priority
        try:
            try:
                raw = await self._read_body(request)
                model = _body_model(raw)
                await st.controls.wait(ticket)
            except GatewayError as exc:
                note.queue_wait_s = ticket.waited_s
                return self._relay_refused(note, exc)
            note.queue_wait_s = ticket.waited_s
            return await self._relay_request(request, raw, model, tenant)
        finally:
            st.controls.release(ticket)

    def _relay_refused(self, note: RequestNote, exc: GatewayError) -> web.Response:
        """A passthrough request refused before any worker was tried."""
        self.st.metrics.request_done("", PASSTHROUGH, exc.status)
        note.error = exc.code
        return error_response(exc)

    def _relay_worker(self, model: str | None, tenant: str, tried: list[WorkerId]) -> Worker | None:
        """The routable worker, not tried yet, that may take a passthrough request for
        ``model`` (any, when None) from ``tenant``, with the fewest requests in flight."""
        load = self.st.dispatch.load
        side = self._relayed
        best: Worker | None = None
        best_load = 0
        for w in self.st.registry.workers.values():
            if not w.routable or w.id in tried:
                continue
            # A worker that lists nothing may serve any model, as routing has it.
            models, adapters = w.models, w.adapters
            if (
                model is not None
                and (models or adapters)
                and model not in models
                and model not in adapters
            ):
                continue
            tenants = w.view.tenants
            if tenants is not None and tenant not in tenants:
                continue
            n = load(w.id).in_flight + side.get(w.id, 0) + w.foreign
            if best is None or n < best_load:
                best, best_load = w, n
        return best

    async def _relay_request(
        self, request: web.Request, raw: bytes, model: str | None, tenant: str
    ) -> web.StreamResponse:
        st = self.st
        upstream = st.upstream
        assert upstream is not None
        note = note_of(request)
        rid = note.request_id or st.builder.new_request_id()
        note.request_id = rid
        path = request.path
        fwd = forwarded_headers(
            rid, request.headers.get("traceparent"), request.headers.get("tracestate")
        )
        retry = _Retry()
        for _ in range(self.max_attempts):
            worker = self._relay_worker(model, tenant, retry.tried)
            if worker is None:
                break
            hdrs = {"X-Request-Id": rid}
            if st.config.server.expose_workers:
                hdrs["X-Prefixrouter-Worker"] = worker.id
            self._relayed[worker.id] = self._relayed.get(worker.id, 0) + 1
            try:
                att = await self._post_whole(worker, path, raw, None, fwd, hdrs)
            except asyncio.CancelledError:
                note.worker = worker.id
                raise
            except Exception as exc:  # a bug must not crash the gateway
                log.exception("passthrough failed for %s", rid)
                att = Attempt(error_response(exc), 500, error=exception_text(exc))
            finally:
                left = self._relayed[worker.id] - 1
                if left:
                    self._relayed[worker.id] = left
                else:
                    del self._relayed[worker.id]
            if att.response is not None:
                st.registry.observe(worker, att.status, suspect=att.suspect)
                if att.broke:
                    st.registry.mark_suspect(worker, att.error or "connection broke")
                st.metrics.request_done(worker.id, PASSTHROUGH, att.status)
                note.worker = worker.id
                if att.error is not None:
                    note.error = att.error
                return att.response
            # Failed before the engine answered: another worker may take it.
            self._worker_failed(worker, att)
            retry.failed(worker.id, att)
        resp = retry.answer({}, st.config.server.expose_workers, "access log")
        if resp is None:  # no worker was tried
            resp = self._relay_unserved(model)
        resp.headers["X-Request-Id"] = rid
        st.metrics.request_done("", PASSTHROUGH, resp.status)
        note.error = "; ".join(retry.errors) or (
            "model_not_found" if resp.status == 404 else "no_healthy_worker"
        )
        return resp

    def _relay_unserved(self, model: str | None) -> web.Response:
        """No worker could be tried: 404 for a model no worker lists, else 503."""
        if model is not None and not self.st.registry.serves(model):
            return error_response(model_not_found(model))
        what = f"model {model!r}" if model is not None else "this request"
        unavailable = ServiceUnavailable(
            f"no healthy worker can serve {what}", headers={"Retry-After": self.retry_after}
        )
        return error_response(unavailable)

    def responses_refused(self) -> web.Response:
        """``/v1/responses`` (any method, any sub-path): 404 saying why it is not routed."""
        self.st.metrics.request_done("", PASSTHROUGH, 404)
        return error_response(NotFound(RESPONSES_NOT_ROUTED, code="unsupported_endpoint"))

    def close(self) -> None:
        """Stop the parse thread (the application's cleanup)."""
        self.flow.close()

    async def _forward(
        self, request: web.Request, built: BuiltRequest, path: str, t0: float
    ) -> web.StreamResponse:
        st = self.st
        rr = built.routing
        rid = rr.request_id
        # Made only when an attempt fails: most requests succeed at once.
        retry: _Retry | None = None
        adm: Admission | None = None
        fleet = st.fleet
        header = fleet.session_header
        try:  # rollout group, pool and policy; the session's pin
            steer = fleet.steer(request.headers.get(header) if header else None, built)
        except GatewayError as exc:
            st.metrics.request_done("", "none", exc.status)
            return error_response(exc)
        # Built once: every attempt sends the same id and trace context.
        fwd = forwarded_headers(
            built.reply_id, request.headers.get("traceparent"), request.headers.get("tracestate")
        )
        for _ in range(self.max_attempts):
            try:
                adm = self.flow.admit(built, adm, st.registry.views(), steer, path)
            except NoWorkerAvailable as exc:
                return self._no_worker(built, retry, exc, adm, t0)
            except Exception as exc:  # a routing bug answers 500, never crashes the gateway
                log.exception("routing failed for %s", rid)
                st.metrics.request_done("", "none", 500)
                return error_response(exc)
            decision = adm.decision
            worker = st.registry.workers[decision.worker_id]
            try:
                # What a stream has relayed so far: a client that leaves after
                # the engine's usage chunk still leaves its feedback behind.
                progress = Attempt(None, CLIENT_GONE, error="client disconnected")
                first_byte_s = self._first_byte_timeout(decision, built)
                if built.stream:
                    att = await self._stream(
                        request, built, adm, worker, path, progress, first_byte_s, fwd
                    )
                else:
                    att = await self._unary(built, worker, path, first_byte_s, fwd)
            except asyncio.CancelledError:
                # A stream's client that left before the first upstream byte:
                # the engine, aborted now, has not prefilled it.
                progress.no_prefill = built.stream and not adm.first_token
                self._finish(built, adm, worker, progress, t0, retry, steer)
                raise
            except Exception as exc:  # a bug must not crash the gateway or leak load
                att = Attempt(error_response(exc), 500, error=exception_text(exc))
            if att.response is not None:
                try:
                    self._finish(built, adm, worker, att, t0, retry, steer)
                except Exception:  # bookkeeping must not cost the client its answer
                    log.exception("feedback failed for %s", rid)
                return att.response
            # Failed before the first byte: forget this attempt, try another worker.
            self._abandon(adm, worker, att)
            if retry is None:
                retry = _Retry()
            retry.failed(worker.id, att)
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

    def _answer_headers(self, built: BuiltRequest, worker: Worker) -> dict[str, str]:
        """The gateway's headers on a worker's answer: the request id, and the worker
        unless ``server.expose_workers`` is off."""
        if self.st.config.server.expose_workers:
            return {"X-Prefixrouter-Worker": worker.id, "X-Request-Id": built.reply_id}
        return {"X-Request-Id": built.reply_id}

    async def _unary(
        self,
        built: BuiltRequest,
        worker: Worker,
        path: str,
        first_byte_s: float | None,
        fwd: bytes,
    ) -> Attempt:
        hdrs = self._answer_headers(built, worker)
        payload = self.flow.payload(built, worker)
        return await self._post_whole(worker, path, payload, first_byte_s, fwd, hdrs)

    async def _post_whole(
        self,
        worker: Worker,
        path: str,
        body: bytes,
        first_byte_s: float | None,
        fwd: bytes,
        hdrs: dict[str, str],
    ) -> Attempt:
        """Send ``body`` to ``worker`` and read its answer whole (:meth:`_whole`'s rules).

        A failure before the engine answered is :func:`_failed` (retried elsewhere).
        """
        upstream = self.st.upstream
        assert upstream is not None
        try:
            resp = await upstream.post(worker.endpoint, path, body, first_byte_s, fwd)
        except _UPSTREAM_ERRORS as exc:
            return _failed(exc, hdrs)
        try:
            return await self._whole(resp, hdrs, worker)
        finally:
            resp.release()  # reused only if read to the end

    async def _whole(self, resp: UpstreamResponse, hdrs: dict[str, str], worker: Worker) -> Attempt:
        """Read an answer whole and answer it: a non-streamed one, or an error status.

        The engine has answered (status and headers are in): whatever happens
        to the body now, the request is not sent to another worker (see
        :func:`_cut`). Only an error status can still be retried, as a refusal.
        """
        status = resp.status
        try:
            body = await resp.read()
        except _UPSTREAM_ERRORS as exc:
            if status == 200:
                return _cut(exc, hdrs)
            body = b""  # still the engine's error: answered with its status
        if status != 200:
            return self._upstream_error(status, body, hdrs, resp.headers, worker)
        try:
            usage = answer_usage(orjson.loads(body))
        except orjson.JSONDecodeError:
            # Cut short or garbled: never pass it on as a 200 answer.
            msg = "upstream answered 200 with a body that is not JSON"
            err = error_body(msg, "upstream_error", "502")
            out = web.Response(body=err, status=502, content_type=JSON, headers=hdrs)
            return Attempt(out, 502, error="upstream sent invalid JSON")
        # The media type only (JSON is UTF-8 whatever a charset says): what
        # benchmarks/gateway_overhead.py's stand-in response offers, too.
        out = web.Response(
            body=body, status=200, content_type=resp.content_type or JSON, headers=hdrs
        )
        return Attempt(out, 200, ok=True, usage=usage)

    def _upstream_error(
        self,
        status: int,
        body: bytes,
        hdrs: dict[str, str],
        engine: dict[str, str],
        worker: Worker,
    ) -> Attempt:
        """An engine's error status, answered with its body and end-to-end headers.

        ``Retry-After`` above all: the client's SDK spaces its retries by it
        (see :func:`_passed_headers`). The body is passed through when it has
        OpenAI's shape, with the engine's JSON content type as sent, else
        wrapped into that shape (:func:`upstream_error_body`) as JSON.

        A 404 for the model (:func:`_model_missing`) from a worker the gateway
        routed that model to means its model list is stale (a restart with
        another model, an adapter unloaded): the worker is listed again
        (:meth:`WorkerRegistry.rediscover`) and the request is retried as a
        refusal is, on another worker serving the model: a 404 comes before
        any generation.
        """
        out_body = upstream_error_body(body, status)
        headers = _passed_headers(engine)
        headers.update(hdrs)  # the gateway's own headers win
        ctype = engine.get("content-type", "")
        passed = out_body is body and ctype.split(";", 1)[0].strip().lower() == JSON
        headers["Content-Type"] = ctype if passed else JSON
        out = web.Response(body=out_body, status=status, headers=headers)
        # An error status before any body byte: the engine did no prefill
        # (a 400 for a prompt past the context length, an overload refusal).
        if status in self.retry_statuses or (status == 404 and _model_missing(out_body)):
            if status == 404:
                self.st.registry.rediscover(worker)
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
        fwd: bytes,
    ) -> Attempt:
        st = self.st
        upstream = st.upstream
        assert upstream is not None
        t_send = st.clock()
        hdrs = self._answer_headers(built, worker)
        try:
            resp = await upstream.post(
                worker.endpoint, path, self.flow.payload(built, worker), first_byte_s, fwd
            )
        except _UPSTREAM_ERRORS as exc:
            return _failed(exc, hdrs)
        done = False
        try:
            if resp.status != 200:
                done = True  # released: the connection is reused if read to the end
                return await self._whole(resp, hdrs, worker)
            if resp.content_type not in _SSE_TYPES:
                # The engine ignored "stream": true and answered whole (JSON):
                # answered as it came, like a non-streamed answer, never with
                # an SSE error event appended to its JSON. An answer's headers
                # come with the answer: the prefill is done.
                done = True
                st.dispatch.first_token(adm, st.clock())
                return await self._whole(resp, hdrs, worker)
            try:
                first = await resp.readany()
            except _UPSTREAM_ERRORS as exc:
                # A stream's headers come before the prefill: no body byte yet
                # means the engine produced nothing, so this may be retried.
                return _failed(exc, hdrs)
            if not first:
                return Attempt(
                    None, 502, error="closed the stream before sending data", unreachable=True
                )
            ttft = st.clock() - t_send
            st.dispatch.first_token(adm, st.clock())
            out = web.StreamResponse(status=200, headers=hdrs)
            # The content type as the engine sent it (sse-starlette adds a charset).
            out.headers["Content-Type"] = resp.headers.get("content-type") or "text/event-stream"
            out.headers["Cache-Control"] = "no-cache"
            await out.prepare(request)
            # ---- bytes are reaching the client from here on: never retry ----
            progress.ttft_s = ttft
            to_client = built.usage_to_client(worker.config.usage_by_default)
            done, att = await self._relay(out, resp, first, to_client, ttft, progress)
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
        usage_to_client: bool,
        ttft: float,
        progress: Attempt,
    ) -> tuple[bool, Attempt]:
        relay = SseRelay(strip_usage=not usage_to_client)
        chunk = first
        cut: _Break | None = None
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
                    cut = _Break.of(exc)
                    break
            tail = relay.finish()
            if tail:
                await out.write(tail)
            if cut is None and not relay.done:
                # A clean end of body without [DONE]: the engine cut its answer
                # short; the client must not take it for a complete one.
                cut = _Break(502, "the stream ended before data: [DONE]")
            if cut is not None:
                msg = f"upstream stream {cut.what}: {cut.why}"
                # An event the break cut short is ended first (a blank line,
                # whatever its last line end), so the error is an event of its own.
                lead = b"\n\n" if tail else b""
                event = error_body(msg, "upstream_error", str(cut.status))
                await out.write(lead + b"data: " + event + b"\n\n")
            await out.write_eof()
        except ConnectionResetError:
            gone = Attempt(
                out, CLIENT_GONE, usage=relay.usage, ttft_s=ttft, error="client disconnected"
            )
            gone.ok = progress.ok  # the engine finished if its usage chunk came
            return False, gone
        if cut is not None:
            return False, Attempt(
                out, cut.status, usage=relay.usage, ttft_s=ttft, error=cut.why,
                suspect=cut.suspect, broke=cut.broke,
            )  # fmt: skip
        return True, Attempt(out, 200, ok=True, usage=relay.usage, ttft_s=ttft)

    # ------------------------------------------------------------------ bookkeeping

    def _abandon(self, adm: Admission, worker: Worker, att: Attempt) -> None:
        st = self.st
        # Abandoned before its first byte (refused, unreachable, broken):
        # nothing was prefilled there, so the routing is taken back and the
        # retry elsewhere leaves no phantom prefix on this worker.
        st.dispatch.reject(adm, st.clock())
        self._worker_failed(worker, att)

    def _worker_failed(self, worker: Worker, att: Attempt) -> None:
        """What an attempt that failed before the engine answered says of ``worker``
        (observed; unreachable: failed; silent: suspect), and the retry counted."""
        st = self.st
        st.registry.observe(worker, att.status, unreachable=att.unreachable, suspect=att.suspect)
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
        steer: Steer,
    ) -> None:
        served = Served(
            att.status, att.ok, att.usage, att.ttft_s, att.error, att.suspect, att.no_prefill,
            att.broke,
        )  # fmt: skip
        self.st.registry.observe(worker, att.status, suspect=att.suspect)
        tried = retry.tried if retry is not None else ()
        self.flow.finish(built, adm, worker, served, t0, tried, steer)

    def _no_worker(
        self,
        built: BuiltRequest,
        retry: _Retry | None,
        no_worker: str | NoWorkerAvailable,
        adm: Admission | None,
        t0: float,
    ) -> web.StreamResponse:
        """The answer when no (further) worker can take the request.

        The last refusal's own answer, else a 502 naming every worker tried
        (504 if every attempt timed out), else
        :meth:`RequestFlow.no_worker_error` (403 or 503).
        """
        why = str(no_worker)
        hdrs = {"X-Request-Id": built.reply_id}
        expose = self.st.config.server.expose_workers
        tried = retry.answer(hdrs, expose, "decision log") if retry is not None else None
        resp: web.Response
        if tried is not None:
            resp = tried
        else:
            resp = error_response(self.flow.no_worker_error(built, no_worker, hdrs))
        decision = adm.decision if adm is not None else None
        tier = decision.tier if decision is not None else "none"
        self.st.metrics.request_done("", tier, resp.status)
        if built.note is not None:
            built.note.error = why  # record() below names the attempts' errors instead
        if decision is not None:  # attempts were made: none is lost silently
            errors = "; ".join(retry.errors) if retry is not None else ""
            latency = self.st.clock() - t0
            self.flow.record(
                built,
                decision,
                resp.status,
                None,
                None,
                None,
                latency,
                tuple(retry.tried) if retry is not None else (),
                errors or why,
                len(retry.tried) if retry is not None else 0,
            )
        return resp


def _body_model(raw: bytes) -> str | None:
    """A passthrough body's ``model`` (None: it names none).

    Raises:
        BadRequest: The body is not a JSON object, or its ``model`` is not a string.
    """
    body = json_body(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model: must be a string", param="model")
    return model


def _output_bounded(body: dict[str, Any]) -> bool:
    """Whether the client bounded the output (``max_tokens`` or ``max_completion_tokens``)."""
    return body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None


def _failed(exc: BaseException, hdrs: dict[str, str]) -> Attempt:
    """An attempt that failed before the engine answered: retried on another worker.

    A first-byte timeout makes the worker suspect (it may only be slow); any
    other failure means it could not be reached (502). The total timeout is
    the exception: it is answered (:func:`_cut`), never retried.
    """
    if isinstance(exc, TotalTimeout):
        return _cut(exc, hdrs)
    if isinstance(exc, FirstByteTimeout):
        return Attempt(None, 504, error=exception_text(exc), suspect=True)
    status = 504 if isinstance(exc, TimeoutError) else 502
    return Attempt(None, status, error=exception_text(exc), unreachable=True)


def _cut(exc: BaseException, hdrs: dict[str, str]) -> Attempt:
    """The answer to a request the engine had already taken on: never sent elsewhere.

    The engine answered (status and headers in hand) and then broke or went
    silent, or the total timeout expired: it may have generated the whole
    answer, and a retry would generate it again. The client gets a 502 (the
    connection broke: the worker is checked at once, and the failure counts
    toward outlier ejection) or a 504 ``upstream_timeout``. A first-byte or
    stall timeout marks the worker suspect. The total timeout marks nothing:
    it measures the request (a long generation), not the worker, and a
    frozen worker is caught by the first-byte and stall timeouts and its
    health checks; a 504 does not count toward outlier ejection either.
    """
    cut = _Break.of(exc)
    if cut.status == 504:
        msg = f"the worker's answer timed out ({cut.why})"
        resp = error_response(UpstreamTimeout(msg, headers=hdrs))
        return Attempt(resp, 504, error=cut.why, suspect=cut.suspect)
    body = error_body(f"upstream answer broke: {cut.why}", "upstream_error", "502")
    out = web.Response(body=body, status=502, content_type=JSON, headers=hdrs)
    return Attempt(out, 502, error=cut.why, broke=cut.broke)


@dataclass(frozen=True, slots=True)
class _Break:
    """How an answer the engine had begun ended early, and what that says of the worker.

    A timeout is a 504; ``suspect`` when the worker went silent (the
    first-byte or stall timeout), not for the total timeout, which measures
    the request. Anything else is a 502; ``broke`` when the connection broke
    (it counts toward outlier ejection).
    """

    status: int
    why: str
    suspect: bool = False
    broke: bool = False

    @property
    def what(self) -> str:
        """What happened, in a word or two: timed out, stalled (went silent) or broke."""
        if self.status == 504:
            return "stalled" if self.suspect else "timed out"
        return "broke"

    @classmethod
    def of(cls, exc: BaseException) -> _Break:
        why = exception_text(exc)
        if isinstance(exc, TimeoutError):
            return cls(504, why, suspect=isinstance(exc, FirstByteTimeout | StallTimeout))
        return cls(502, why, broke=isinstance(exc, ConnectionError))


def _model_missing(body: bytes) -> bool:
    """Whether an engine's 404 body (in OpenAI's shape) says the model does not exist.

    OpenAI's ``code`` ``model_not_found``; vLLM's ``type`` ``NotFoundError``
    (its only 404 on a route it serves is an unknown model; its ``code`` is the
    status), or any error whose ``param`` is ``model``. A 404 for the path
    itself (FastAPI's ``{"detail": "Not Found"}``, wrapped) is none of these.
    """
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    if not isinstance(err, dict):
        return False
    return (
        err.get("code") == "model_not_found"
        or err.get("type") == "NotFoundError"
        or err.get("param") == "model"
    )


def _passed_headers(engine: dict[str, str]) -> dict[str, str]:
    """The engine's end-to-end headers an error answer passes on (names in lower case).

    Not passed: hop-by-hop headers (RFC 9110 7.6.1, and any the engine's
    ``Connection`` names), the framing the gateway redoes (``Content-Length``,
    ``Content-Encoding``: the body may be rewritten), what belongs to the
    engine's server rather than to the answer (``Date``, ``Server``,
    ``Alt-Svc``, and ``Set-Cookie``: the gateway forwards no cookie back), and
    the gateway's own ``X-Request-Id`` and ``X-Prefixrouter-Worker``.
    ``Content-Type`` is set by the caller.
    """
    drop = _NOT_PASSED
    named = engine.get("connection")
    if named:
        drop = drop | {name.strip().lower() for name in named.split(",")}
    return {name: value for name, value in engine.items() if name not in drop}
