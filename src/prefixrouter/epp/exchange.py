"""One HTTP request through Envoy, as the endpoint picker sees it: one ext_proc stream.

Envoy opens one ``Process`` stream per HTTP request and sends, in order, the
request headers, the request body (in chunks, or whole), then the response
headers and the response body. An :class:`Exchange` answers each message:

1. **request headers**: the key is checked and the declared length bounded
   from the headers alone (401/413 as an ImmediateResponse at once, as the
   gateway refuses them before reading a body). The path is read as the
   engine will read it, percent-escapes decoded (:func:`api_path`): else
   ``/v1/chat/%63ompletions`` would pass as "another path", unchecked, and
   the engine would serve it as a chat completion. A request for another
   path (``GET /v1/models``, an engine's own endpoints) is sent to the
   least-loaded ready worker, with the key checked where keys are in force
   (only the model list is open, as the gateway's); a completion request
   without a body is answered as the gateway answers an empty body. With a
   ``BUFFERED`` body Envoy waits for this answer before sending the body,
   so it is answered at once (no change); in ``FULL_DUPLEX_STREAMED`` mode
   the body follows without waiting and the answer is held until the pick;
2. **request body**, once whole (the chunk with ``end_of_stream``; the one
   message of a ``BUFFERED`` body; or, for an HTTP/2 request that ends with
   trailers, the body read when the **request trailers** come): admission
   exactly as the gateway's
   (:class:`~prefixrouter.gateway.flow.RequestFlow`: parse, tenant, model,
   route), over the workers the subset hint allows. The answer names the
   endpoint (the header; the ``envoy.lb`` metadata with ``--fallbacks``
   after it, :mod:`.protocol`) and
   carries the body as the worker must get it (``cache_salt`` for a tenant
   that must not share cache, ``stream_options.include_usage`` for a
   stream), with its new ``Content-Length``. Any refusal is the gateway's
   OpenAI-style error as an ImmediateResponse with the gateway's status
   (400, 401, 403, 404, 413, 429, 503);
3. **response headers**: the status and the endpoint that served (when it
   is not the one picked, a fallback served: the pick is taken back and no
   usage is fed back for it, since its worker's prefill is unknown). The
   gateway's ``X-Prefixrouter-Worker`` and ``X-Request-Id`` are added.
   Envoy's own 503 after it dialled the endpoint and failed (its
   ``response.code_details``) makes the picked worker suspect, out of
   routing until a health check passes; a 503 for an endpoint Envoy never
   dialled (``no_healthy_upstream``) does not;
4. **response body**: the first chunk is the time to first token of a
   stream (measured from the pick: the engine's queue, prefill and Envoy's
   forwarding); a stream runs through the gateway's
   :class:`~prefixrouter.gateway.sse.SseRelay`, which reads the usage chunk
   and drops it when the client did not ask for it; a whole answer's usage
   is read at its end. At the end of the body the request is settled as the
   gateway settles it (``Dispatcher.complete`` or ``reject``, metrics,
   decision log).

A stream that ends before its request was settled (the client left, Envoy
gave up) settles as the gateway's client-gone case: status 499, and for a
stream without its first byte, ``reject`` (the engine aborted before prefill).
The ext_proc stream ends the same way when the engine's connection broke
mid-answer, so 499 also counts those: the picker cannot tell them apart from
the stream alone (Envoy sends no message saying why it closed it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import unquote

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from prefixrouter.core.dispatch import Admission
from prefixrouter.epp import protocol
from prefixrouter.errors import NoWorkerAvailable
from prefixrouter.gateway.controls import PRIORITY_HEADER, Ticket
from prefixrouter.gateway.errors import GatewayError, PayloadTooLarge, as_gateway_error, error_body
from prefixrouter.gateway.fleet import Steer
from prefixrouter.gateway.flow import RequestFlow, Served
from prefixrouter.gateway.request_builder import CHAT, COMPLETIONS, BuiltRequest
from prefixrouter.gateway.sse import SseRelay, json_usage
from prefixrouter.gateway.state import GatewayState
from prefixrouter.gateway.workers import Worker

log = logging.getLogger("prefixrouter.epp")

KINDS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}
OPEN_PATHS = ("/v1/models",)
"""Paths that need no key (the gateway answers them without one): these and below."""
CLIENT_GONE = 499
_JSON = {"content-type": "application/json"}
_UNARY_USAGE_MAX = 4 * 1024 * 1024
"""A whole answer longer than this is not kept for its usage (the gateway never sees one)."""

Responses = list[pb.ProcessingResponse]


@dataclass(slots=True)
class Picked:
    """Where a request went, for its response path."""

    built: BuiltRequest
    adm: Admission
    worker: Worker
    t_routed: float
    steer: Steer | None = None


class Exchange:
    """The state of one ext_proc stream (module docstring)."""

    def __init__(self, state: GatewayState, flow: RequestFlow, fallbacks: int = 0) -> None:
        self.st = state
        self.flow = flow
        self.fallbacks = fallbacks
        self.t0 = state.clock()
        self.headers: protocol.Headers = {}
        self.ticket: Ticket | None = None  # the tenant's limits, taken at the headers
        self.full_duplex_request = False
        self.full_duplex_response = False
        self.buffered_request = False  # BUFFERED: the one body message is the whole body
        self.body = bytearray()
        self.subset: list[str] | None = None
        self.picked: Picked | None = None
        self.status = 0
        self.relay: SseRelay | None = None
        self.answer = bytearray()
        self.ttft_s: float | None = None
        self.usage: dict[str, object] | None = None
        self.settled = False
        self.done = False
        self.kind: str | None = None
        self.path = ""  # the request's API path (a proactive copy goes to the same one)

    # ------------------------------------------------------------------ dispatch

    async def on(self, req: pb.ProcessingRequest) -> Responses:
        """Answer one message (possibly with none yet, or several)."""
        which = req.WhichOneof("request")
        if req.HasField("protocol_config"):
            cfg = req.protocol_config
            self.full_duplex_request = cfg.request_body_mode == protocol.FULL_DUPLEX
            self.full_duplex_response = cfg.response_body_mode == protocol.FULL_DUPLEX
            self.buffered_request = cfg.request_body_mode == protocol.BUFFERED
        elif which == "request_headers":
            _no_protocol_config()
        if which == "request_headers":
            return await self._request_headers(req)
        if which == "request_body":
            return await self._request_body(req.request_body)
        if which == "response_headers":
            return self._response_headers(req)
        if which == "response_body":
            return self._response_body(req.response_body)
        if which == "request_trailers":
            return await self._request_trailers()
        if which == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    # ------------------------------------------------------------------ request

    async def _request_headers(self, req: pb.ProcessingRequest) -> Responses:
        self.st.requests_seen += 1
        self.headers = h = protocol.read_headers(req.request_headers)
        self.subset = protocol.subset_hint(req)
        path = api_path(h.get(":path", ""))
        self.kind = KINDS.get(path) if h.get(":method", "POST") == "POST" else None
        self.path = path
        if self.kind is None and not _open(path):
            try:  # an engine's own endpoint: no routing, but the gateway's key rule
                self.st.tenancy.check_key(h.get("authorization"))
            except GatewayError as exc:
                return [self._refuse(exc)]
        if self.kind is not None:
            length = h.get("content-length")
            try:
                self.flow.check_headers(
                    h.get("authorization"), int(length) if length and length.isdigit() else None
                )
                # The tenant's limits, from the headers alone as the gateway's
                # (429 with Retry-After); the ticket is given back in close().
                tenant = self.st.tenancy.tenant_of(h.get("authorization"), h.get("x-tenant"))
                self.ticket = self.st.controls.acquire(tenant, h.get(PRIORITY_HEADER.lower()))
            except GatewayError as exc:
                return [self._refuse(exc)]
        if self.kind is None:
            # Another path: nothing to route by; its body, if any, goes as it is.
            return self._pass_through()
        if req.request_headers.end_of_stream:
            return await self._pick(b"")  # no body: the gateway's answer to an empty one
        if self.full_duplex_request:
            return []  # answered with the pick, once the body is in
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    def _pass_through(self) -> Responses:
        """Any other request: the least-loaded ready worker, no prefix routing and no books."""
        ready = [w for w in self._allowed_workers() if w.healthy and not w.draining]
        if not ready:
            return [self._refuse(as_gateway_error(NoWorkerAvailable("no ready worker", {})))]
        best = min(ready, key=lambda w: self.st.dispatch.load(w.id).in_flight)
        dest = _destination(best)
        return [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(
                        header_mutation=protocol.header_mutation({protocol.DESTINATION: dest})
                    )
                ),
                dynamic_metadata=protocol.destination_metadata(dest),
            )
        ]

    def _allowed_workers(self) -> list[Worker]:
        workers = list(self.st.registry.workers.values())
        if self.subset is None:
            return workers
        allowed = set(self.subset)
        return [w for w in workers if _destination(w) in allowed]

    async def _request_body(self, body: pb.HttpBody) -> Responses:
        if self.kind is None:  # a pass-through request's body goes as it is
            if self.full_duplex_request:  # a streamed body comes back chunk by chunk
                return [_streamed_body(body.body, body.end_of_stream)]
            return [_continue_body()]
        self.body += body.body
        if len(self.body) > self.flow.max_body:
            limit = self.flow.max_body
            exc = PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            return [self._refuse(exc)]
        # BUFFERED: Envoy sends the whole body in one message, without end_of_stream
        # when trailers follow (HTTP/2): that message is the body, picked on now.
        if not body.end_of_stream and not self.buffered_request:
            return [] if self.full_duplex_request else [_continue_body()]
        raw, self.body = bytes(self.body), bytearray()
        return await self._pick(raw)

    async def _request_trailers(self) -> Responses:
        """The request's trailers: its body ended without ``end_of_stream`` on a body chunk.

        An HTTP/2 request may end with trailers: then no body chunk carries
        ``end_of_stream`` and the trailers end the body. A completion request
        not yet picked is picked now on the body read so far; else Envoy would
        forward it with no endpoint (fail closed: a 503 route; fail open: the
        pool's round robin, past every rule of the picker). In
        ``FULL_DUPLEX_STREAMED`` mode the headers' and the body's answers go
        before the trailers' (Envoy expects them in that order).
        """
        trailers = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        if self.kind is None or self.picked is not None or self.done:
            return [trailers]
        raw, self.body = bytes(self.body), bytearray()
        answers = await self._pick(raw, trailers=True)
        if self.done:  # refused: the ImmediateResponse ends the request
            return answers
        return [*answers, trailers]

    async def _pick(self, raw: bytes, trailers: bool = False) -> Responses:
        """Route the whole body ``raw``; the answer names the endpoint (module docstring).

        ``trailers``: the request's trailers follow (a streamed body then does not end here).
        """
        st = self.st
        h = self.headers
        assert self.kind is not None
        try:
            built = await self.flow.build(
                raw, self.kind, h.get("authorization"), h.get("x-tenant"), h.get("x-prefix-class")
            )
        except Exception as exc:  # GatewayError: its status; anything else: 500
            if not isinstance(exc, GatewayError):
                log.exception("admission failed")
            return [self._refuse(as_gateway_error(exc))]
        if self.ticket is not None:
            try:  # under overload: the priority queue (503 overloaded when shed), as the gateway's
                await st.controls.wait(self.ticket)
            except GatewayError as exc:
                self._release(built)
                return [self._refuse(exc)]
        fleet = st.fleet
        header = fleet.session_header
        try:  # rollout group, pool and policy; the session's pin (as the gateway's)
            steer = fleet.steer(h.get(header.lower()) if header else None, built)
        except GatewayError as exc:
            self._release(built)
            return [self._refuse(exc)]
        views = st.registry.views()
        if self.subset is not None:
            allowed = {w.id for w in self._allowed_workers()}
            views = [v for v in views if v.worker_id in allowed]
        try:
            adm = self.flow.admit(built, None, views, steer, self.path)
        except NoWorkerAvailable as exc:
            rid = {"x-request-id": str(built.routing.request_id)}
            why: str | NoWorkerAvailable = exc
            if not views:
                why = "no endpoint of the subset hint is a worker"
            self._release(built)
            return [self._refuse(self.flow.no_worker_error(built, why, rid))]
        except Exception as exc:  # a routing bug answers 500, never crashes the picker
            log.exception("routing failed for %s", built.routing.request_id)
            self._release(built)
            return [self._refuse(as_gateway_error(exc))]
        worker = st.registry.workers[adm.decision.worker_id]
        payload = self.flow.payload(built, worker)
        self.picked = Picked(built, adm, worker, st.clock(), steer)
        # The header holds the pick alone (what ORIGINAL_DST can route on); the metadata
        # the pick and its fallbacks, for a data plane that retries down a list (protocol).
        dest = _destination(worker)
        set_headers = {protocol.DESTINATION: dest}
        mutated = payload is not built.raw
        if mutated or self.full_duplex_request:
            set_headers["content-length"] = str(len(payload))
        mutation = protocol.header_mutation(set_headers)
        md = protocol.destination_metadata(
            protocol.join_endpoints([dest, *self._fallbacks(adm, worker)])
        )
        if self.full_duplex_request:
            return [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(
                        response=pb.CommonResponse(header_mutation=mutation)
                    ),
                    dynamic_metadata=md,
                ),
                _streamed_body(payload, not trailers),
            ]
        common = pb.CommonResponse(header_mutation=mutation)
        if mutated:
            common.body_mutation.body = payload
        return [
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=md
            )
        ]

    def _fallbacks(self, adm: Admission, chosen: Worker) -> list[str]:
        """Up to ``fallbacks`` more endpoints, the policy's next-best candidates first."""
        if self.fallbacks <= 0:
            return []
        ranked = sorted(
            (c for c in adm.decision.candidates if c.worker_id != chosen.id),
            key=lambda c: c.terms.ttft_s if c.terms is not None else c.score,
        )
        workers = self.st.registry.workers
        return [
            _destination(workers[c.worker_id])
            for c in ranked[: self.fallbacks]
            if c.worker_id in workers
        ]

    def _refuse(self, exc: GatewayError) -> pb.ProcessingResponse:
        """The gateway's OpenAI-style error, as Envoy's answer to the client; counted and done."""
        self.done = True
        self.settled = True
        picked = self.picked
        return refusal(self.st, exc, picked.adm.decision.tier if picked is not None else "none")

    # ------------------------------------------------------------------ response

    def _response_headers(self, req: pb.ProcessingRequest) -> Responses:
        h = protocol.read_headers(req.response_headers)
        status = h.get(":status", "0")
        self.status = int(status) if status.isdigit() else 0
        picked = self.picked
        add: dict[str, str] = {}
        if picked is not None:
            served = protocol.served_endpoint(req)
            if self.status == 503 and _dialled_and_failed(req, h):
                # Envoy's own answer: it dialled the picked endpoint and could not reach
                # it. Out of routing until a check passes, checked now, as the gateway
                # does with a worker gone silent; else the next requests meet the same
                # dead endpoint until the next scheduled check.
                self.st.registry.mark_suspect(picked.worker, "unreachable through Envoy")
            if served is not None and served != _destination(picked.worker):
                self._fallback_served(picked, served)
            else:
                add = {"x-request-id": str(picked.built.routing.request_id)}
                if self.st.config.server.expose_workers:
                    add["x-prefixrouter-worker"] = picked.worker.id
                event_stream = h.get("content-type", "").startswith("text/event-stream")
                if self.status == 200 and picked.built.stream and event_stream:
                    # An engine that answers a stream with one JSON body (it
                    # ignored "stream") is read as a whole answer, as the gateway does.
                    default = picked.worker.config.usage_by_default
                    to_client = picked.built.usage_to_client(default)
                    self.relay = SseRelay(strip_usage=not to_client)
        common = pb.CommonResponse(header_mutation=protocol.header_mutation(add)) if add else None
        resp = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))
        if req.response_headers.end_of_stream:
            self._settle()
        return [resp]

    def _fallback_served(self, picked: Picked, served: str) -> None:
        """A fallback endpoint served: the pick did no prefill; nothing is known of the other."""
        st = self.st
        st.dispatch.reject(picked.adm, st.clock())
        st.metrics.retried(picked.worker.id, "fallback")
        self.settled = True
        log.info(
            "%s: served by fallback %s, not %s",
            picked.built.routing.request_id,
            served,
            picked.worker.id,
        )
        self._release(picked.built)

    def _response_body(self, body: pb.HttpBody) -> Responses:
        picked = self.picked
        chunk = body.body
        out = chunk
        if picked is not None and not self.settled:
            if self.ttft_s is None and chunk:
                self.ttft_s = self.st.clock() - picked.t_routed
                if picked.built.stream:
                    self.st.dispatch.first_token(picked.adm, self.st.clock())
            if self.relay is not None:
                out = self.relay.feed(chunk)
                if body.end_of_stream:
                    out += self.relay.finish()
                self.usage = self.relay.usage
            elif self.status == 200 and len(self.answer) + len(chunk) <= _UNARY_USAGE_MAX:
                self.answer += chunk
        if body.end_of_stream:
            self._settle()
        if self.full_duplex_response:
            return [_streamed_body(out, body.end_of_stream, response=True)]
        common = pb.CommonResponse()
        if out != chunk:
            common.body_mutation.body = out
        return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))]

    # ------------------------------------------------------------------ settlement

    def _settle(self) -> None:
        """The response is complete: feed back what the engine reported."""
        self.done = True
        picked = self.picked
        if picked is None or self.settled:
            self.settled = True  # a pass-through request: nothing to feed back
            return
        self.settled = True
        built = picked.built
        ok = self.status == 200
        if ok and self.relay is None:
            self.usage = json_usage(bytes(self.answer))
        served = Served(
            self.status,
            ok=ok and (self.relay is None or self.usage is not None),
            usage=self.usage if ok else None,
            ttft_s=self.ttft_s if built.stream else None,
            error=None if ok else f"upstream answered {self.status}",
            # An error status before any body byte: the engine did no prefill.
            no_prefill=not ok,
        )
        try:
            self.flow.finish(built, picked.adm, picked.worker, served, self.t0, (), picked.steer)
        except Exception:  # bookkeeping must not cost the client its answer
            log.exception("feedback failed for %s", built.routing.request_id)
        self._release(built)

    def close(self) -> None:
        """The stream ended: settle a request it left unsettled (the client left, Envoy gave up).

        The tenant's ticket (its in-flight count and overload slot) is given back here,
        however the request ended.
        """
        if self.ticket is not None:
            self.st.controls.release(self.ticket)
            self.ticket = None
        picked = self.picked
        if picked is None or self.settled:
            return
        self.settled = True
        built = picked.built
        gone = Served(
            CLIENT_GONE,
            ok=self.relay is not None and self.usage is not None,
            usage=self.usage,
            ttft_s=self.ttft_s if built.stream else None,
            error="client disconnected",
            # A stream whose client left before the first byte: the engine, aborted, did no prefill.
            no_prefill=built.stream and not picked.adm.first_token,
        )
        try:
            self.flow.finish(built, picked.adm, picked.worker, gone, self.t0, (), picked.steer)
        except Exception:
            log.exception("feedback failed for %s", built.routing.request_id)
        self._release(built)

    def _release(self, built: BuiltRequest) -> None:
        if built.blocks is not None:  # parsed on the parse thread: a large body
            self.flow.release(built)


def refusal(st: GatewayState, exc: GatewayError, tier: str = "none") -> pb.ProcessingResponse:
    """``exc`` as the gateway's OpenAI-style error, Envoy's answer to the client; counted."""
    st.metrics.request_done("", tier, exc.status)
    body = error_body(exc.message, exc.type, exc.code, exc.param)
    return protocol.immediate(exc.status, body, {**_JSON, **exc.headers})


def _dialled_and_failed(req: pb.ProcessingRequest, headers: protocol.Headers) -> bool:
    """Whether Envoy's 503 says it dialled the picked endpoint and failed.

    Envoy's ``response.code_details`` tells (the shipped bootstrap asks for
    it): ``upstream_reset_before_response_started{...}`` is a connect
    failure or reset. ``no_healthy_upstream`` (the endpoint was never
    dialled: a destination the cluster would not take, no host) says
    nothing about the worker. A data plane that sends no details: Envoy's
    plain-text answer with the endpoint it dialled known (an engine's 503
    is JSON).
    """
    details = protocol.code_details(req)
    if details:
        return details.startswith(protocol.DIALLED_AND_FAILED)
    plain = headers.get("content-type", "").startswith("text/plain")
    return plain and protocol.served_endpoint(req) is not None


_warned_no_config = False


def _no_protocol_config() -> None:
    """Say once that the data plane sends no ``protocol_config``.

    The body modes are read from it: without it the picker answers as for
    ``BUFFERED``/``STREAMED``, which breaks a ``FULL_DUPLEX_STREAMED``
    stream (Envoy sends it since 1.33; another data plane may not).
    """
    global _warned_no_config
    if not _warned_no_config:
        _warned_no_config = True
        log.warning(
            "the data plane sent no protocol_config: assuming non-duplex body modes; "
            "a FULL_DUPLEX_STREAMED stream will break (use an Envoy that sends it)"
        )


def api_path(raw: str) -> str:
    """The API path of ``:path`` as an engine's HTTP server routes it: the query cut,
    percent-escapes decoded (``/v1/chat/%63ompletions`` is ``/v1/chat/completions``)."""
    return unquote(raw.split("?", 1)[0])


def _open(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPEN_PATHS)


def _continue_body() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


def _streamed_body(data: bytes, end: bool, response: bool = False) -> pb.ProcessingResponse:
    """A ``FULL_DUPLEX_STREAMED`` body chunk: what Envoy forwards in place of the one it sent."""
    common = pb.CommonResponse(
        body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=end)
        )
    )
    if response:
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def _destination(worker: Worker) -> str:
    """The worker as Envoy's ``ORIGINAL_DST`` cluster needs it: ``IP:PORT``."""
    ep = worker.endpoint
    return protocol.endpoint_text(ep.host, ep.port)
