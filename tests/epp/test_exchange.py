"""The exchange in process, where Envoy cannot show it: fallbacks and the buffered mutations."""

from __future__ import annotations

from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from prefixrouter.epp import protocol
from prefixrouter.epp.exchange import Exchange
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.flow import RequestFlow
from prefixrouter.gateway.state import GatewayState, build_state
from tests.epp.fleet import chat_body, ext_proc_headers

WORKERS = [f"127.0.0.1:{9100 + i}" for i in range(3)]


def _state(**extra: object) -> GatewayState:
    st = build_state(
        config_from_dict({"workers": [{"url": f"http://{w}"} for w in WORKERS], **extra})
    )
    for w in st.registry.workers.values():
        w.healthy = True  # no health checks run in process
    return st


async def _pick(ex: Exchange, body: bytes, **headers: str) -> pb.ProcessingResponse:
    await ex.on(
        pb.ProcessingRequest(
            request_headers=ext_proc_headers({":path": "/v1/chat/completions", **headers})
        )
    )  # BUFFERED: answered
    (answer,) = await ex.on(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    return answer


def _set(answer: pb.ProcessingResponse) -> dict[str, str]:
    mutation = answer.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_fallbacks_follow_the_pick_in_the_metadata() -> None:
    st = _state()
    ex = Exchange(st, RequestFlow(st), fallbacks=2)
    answer = await _pick(ex, orjson.dumps(chat_body("fallbacks")))
    dest = _set(answer)[protocol.DESTINATION]
    md = answer.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
    listed = md.fields[protocol.DESTINATION].string_value.split(",")
    assert len(listed) == 3 and set(listed) == set(WORKERS)
    assert ex.picked is not None
    chosen = st.registry.workers[ex.picked.adm.decision.worker_id]
    assert listed[0] == dest == f"127.0.0.1:{chosen.endpoint.port}"  # the pick first, alone
    ex.close()


async def test_a_buffered_body_is_replaced_only_when_it_must_change() -> None:
    st = _state(api_keys={"sk-a": "a"}, tenants={"a": {"share_cache": False}}, salt_secret="s")
    flow = RequestFlow(st)
    plain = orjson.dumps(chat_body("unchanged"))
    kept = await _pick(Exchange(st, flow), plain)
    assert not kept.request_body.response.HasField("body_mutation")
    assert "content-length" not in _set(kept)
    salted = await _pick(Exchange(st, flow), plain, authorization="Bearer sk-a")
    body = salted.request_body.response.body_mutation.body
    assert orjson.loads(body)["cache_salt"]  # the tenant's salt, injected
    assert _set(salted)["content-length"] == str(len(body))
    streamed = await _pick(Exchange(st, flow), orjson.dumps(chat_body("s", stream=True)))
    sent = orjson.loads(streamed.request_body.response.body_mutation.body)
    assert sent["stream_options"] == {"include_usage": True}


async def test_a_tenant_over_its_limit_gets_429_and_its_ticket_back_when_the_stream_ends() -> None:
    st = _state(api_keys={"sk-a": "a"}, tenants={"a": {"max_in_flight": 1}})
    flow = RequestFlow(st)
    first = Exchange(st, flow)
    await _pick(first, orjson.dumps(chat_body("one")), authorization="Bearer sk-a")
    assert first.picked is not None  # routed, in flight
    (refused,) = await Exchange(st, flow).on(
        pb.ProcessingRequest(
            request_headers=ext_proc_headers(
                {":path": "/v1/chat/completions", "authorization": "Bearer sk-a"}
            )
        )
    )
    answer = refused.immediate_response
    assert answer.status.code == 429
    assert any(h.header.key.lower() == "retry-after" for h in answer.headers.set_headers)
    assert orjson.loads(answer.body)["error"]["code"] == "too_many_in_flight"
    first.close()  # the stream ended: the tenant may send again
    again = Exchange(st, flow)
    await _pick(again, orjson.dumps(chat_body("two")), authorization="Bearer sk-a")
    assert again.picked is not None
    again.close()


async def test_a_pick_tells_the_flow_the_requests_path_for_the_routers_own_copy() -> None:
    # A decision that asks for a proactive copy has it sent to the request's own
    # API path (RequestFlow.admit's `path`): a completions body to /v1/completions.
    st = _state()
    flow = RequestFlow(st)
    paths: list[str] = []
    admit = flow.admit

    def recording(*args: Any, **kwargs: Any) -> Any:
        paths.append(args[4] if len(args) > 4 else kwargs.get("path", "/v1/chat/completions"))
        return admit(*args, **kwargs)

    flow.admit = recording  # type: ignore[method-assign]
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "Clause 1. " * 50, "max_tokens": 4}),
        ("/v1/chat/completions", chat_body("a question")),
    ):
        ex = Exchange(st, flow)
        await ex.on(pb.ProcessingRequest(request_headers=ext_proc_headers({":path": path})))
        await ex.on(
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True)
            )
        )
        assert ex.picked is not None
        ex.close()
    assert paths == ["/v1/completions", "/v1/chat/completions"]


async def _headers_only(st: GatewayState, headers: dict[str, str]) -> pb.ProcessingResponse:
    """The answer to request headers that end the request (no body follows)."""
    msg = ext_proc_headers(headers)
    msg.end_of_stream = True
    (answer,) = await Exchange(st, RequestFlow(st)).on(pb.ProcessingRequest(request_headers=msg))
    return answer


async def test_the_path_is_read_as_the_engine_reads_it_and_keys_hold_on_every_other_path() -> None:
    # Before: '/v1/chat/%63ompletions' matched no API path, went through without the
    # key check, and the engine (which decodes the path) served it as a chat completion.
    st = _state(require_api_key=True, api_keys={"sk-a": "a"})
    (encoded,) = await Exchange(st, RequestFlow(st)).on(
        pb.ProcessingRequest(request_headers=ext_proc_headers({":path": "/v1/chat/%63ompletions"}))
    )
    assert encoded.immediate_response.status.code == 401
    # An engine's own endpoint: the gateway's key rule too; the model list stays open.
    tokenize = {":method": "POST", ":path": "/tokenize"}
    assert (await _headers_only(st, tokenize)).immediate_response.status.code == 401
    keyed = await _headers_only(st, {**tokenize, "authorization": "Bearer sk-a"})
    assert protocol.DESTINATION in {
        h.header.key for h in keyed.request_headers.response.header_mutation.set_headers
    }
    for models in ("/v1/models", "/v1/models/tiny"):
        listed = await _headers_only(st, {":method": "GET", ":path": models})
        assert not listed.HasField("immediate_response"), models


async def test_a_completion_request_without_a_body_gets_the_gateways_400() -> None:
    st = _state()
    answer = await _headers_only(st, {":path": "/v1/chat/completions"})
    assert answer.immediate_response.status.code == 400
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == "invalid_json"


async def test_envoys_503_makes_the_worker_suspect_only_when_envoy_dialled_it() -> None:
    """Envoy's ``response.code_details`` says whether it dialled the endpoint and failed.

    ``no_healthy_upstream`` (a destination the cluster would not take: the
    endpoint was never dialled) made the worker suspect, flapping it with
    every request; an engine's own 503 never did. A data plane that sends
    no details: Envoy's plain-text 503 from the endpoint it dialled does.
    """
    from google.protobuf import struct_pb2

    st = _state()
    flow = RequestFlow(st)

    async def answered(content_type: str, details: str | None) -> Exchange:
        ex = Exchange(st, flow)
        picked = _set(await _pick(ex, orjson.dumps(chat_body(f"{content_type} {details}"))))
        attrs = struct_pb2.Struct()
        attrs.fields[protocol.UPSTREAM_ADDRESS].string_value = picked[protocol.DESTINATION]
        if details is not None:
            attrs.fields[protocol.CODE_DETAILS].string_value = details
        msg = ext_proc_headers({":status": "503", "content-type": content_type})
        await ex.on(
            pb.ProcessingRequest(
                response_headers=msg, attributes={protocol.EXT_PROC_ATTRIBUTES: attrs}
            )
        )
        ex.close()
        return ex

    engine = await answered("application/json", "via_upstream")  # overloaded, say
    assert engine.picked is not None and not engine.picked.worker.suspect
    never = await answered("application/json", "no_healthy_upstream")
    assert never.picked is not None and not never.picked.worker.suspect
    refused = "upstream_reset_before_response_started{remote_connection_failure}"
    envoy = await answered("application/json", refused)
    assert envoy.picked is not None and envoy.picked.worker.suspect
    views = {v.worker_id: v for v in st.registry.views()}
    assert not views[envoy.picked.worker.id].healthy  # out of routing until a check passes
    # No details: Envoy's own answer is plain text, an engine's JSON.
    quiet_engine = await answered("application/json", None)
    assert quiet_engine.picked is not None and not quiet_engine.picked.worker.suspect
    quiet_envoy = await answered("text/plain", None)
    assert quiet_envoy.picked is not None and quiet_envoy.picked.worker.suspect


def test_readiness_is_able_to_pick_not_a_worker_ready() -> None:
    """Readiness (gRPC and HTTP) is the protocol's: serving picks; shutdown ends it.

    No ready worker keeps the picker ready: it answers 503 JSON with
    ``Retry-After`` itself, better than the gateway's empty 500 without it.
    """
    from prefixrouter.epp.server import Lifecycle, picker_admin

    st = _state()
    life = Lifecycle()
    admin = picker_admin(st, life)
    assert admin.readiness() == (True, {"status": "ready"})
    for w in st.registry.workers.values():
        w.ready = False
    assert admin.readiness() == (True, {"status": "ready"})
    life.draining = True
    assert admin.readiness() == (False, {"status": "shutting_down"})


async def test_a_stream_answered_with_one_json_body_is_read_as_a_whole_answer() -> None:
    """An engine that ignored ``stream``: its usage is read, its body passes unchanged."""
    st = _state()
    ex = Exchange(st, RequestFlow(st))
    await _pick(ex, orjson.dumps(chat_body("json for a stream", stream=True)))
    headers = ext_proc_headers({":status": "200", "content-type": "application/json"})
    await ex.on(pb.ProcessingRequest(response_headers=headers))
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
    body = orjson.dumps({"choices": [{"message": {"content": "ok"}}], "usage": usage})
    (answer,) = await ex.on(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    assert not answer.response_body.response.body_mutation.body  # unchanged
    assert ex.usage == usage  # was None: read as SSE, the answer counted as a failure
    ex.close()
