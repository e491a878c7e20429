"""prefixrouter as Envoy's endpoint picker, end to end, in both body modes.

One fleet for the module: three simulated engines, one ``prefixrouter epp``
(two tenants that must not share cache, keyed), and two real Envoys on the
shipped bootstrap in front of it, one with ``FULL_DUPLEX_STREAMED`` bodies
(the extension's mode) and one with ``BUFFERED``. A client speaking the
OpenAI API talks to Envoy only; the picker's books are read on its HTTP port,
and its gRPC side is also spoken to directly (health, the subset hint).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixrouter.epp import protocol
from tests.admin_client import decisions
from tests.epp.fleet import (
    MODES,
    Stack,
    chat_body,
    client,
    ext_proc_headers,
    metric_lines,
    post,
    start_stack,
)

KEYS = {"team-a": "sk-team-a", "team-b": "sk-team-b"}
COLD = 50
"""Cached tokens of a question whose document was not reused (the system prompt's first block)."""
WARM = 200
"""Cached tokens of a question whose document was (a document is about 900 tokens)."""
TENANCY: dict[str, Any] = {
    "api_keys": {key: tenant for tenant, key in KEYS.items()},
    "tenants": {t: {"share_cache": False} for t in KEYS},
    "salt_secret": "epp-test-secret",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("epp-envoy"), 3, **TENANCY) as s:
        yield s


def _doc(tag: str) -> str:
    return f"Document {tag}. " + " ".join(
        f"clause {tag}-{i} says the rate is {i}." for i in range(60)
    )


@pytest.mark.parametrize("mode", MODES)
async def test_the_official_openai_sdk_through_envoy(stack: Stack, mode: str) -> None:
    # The client a user has: the official SDK, pointed at Envoy, never at the picker.
    import openai

    sdk = openai.AsyncOpenAI(
        base_url=stack.envoys[mode].url + "/v1", api_key=KEYS["team-a"], max_retries=0, timeout=60
    )
    async with sdk:
        chat = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"sdk {mode}"}], max_tokens=4
        )
        assert chat.choices[0].message.content and chat.usage is not None
        chunks = [
            c
            async for c in await sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"sdk stream {mode}"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None
        comp = await sdk.completions.create(model="tiny", prompt=f"sdk {mode}:", max_tokens=4)
        assert comp.choices[0].text and comp.usage is not None
        streamed = [
            c
            async for c in await sdk.completions.create(
                model="tiny", prompt=f"sdk stream {mode}:", max_tokens=4, stream=True
            )
        ]
        assert "".join(c.choices[0].text for c in streamed if c.choices)
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert unknown.value.status_code == 404


@pytest.mark.parametrize("mode", MODES)
async def test_unary_and_streamed_chat_and_completions(stack: Stack, mode: str) -> None:
    url = stack.envoys[mode].url
    async with client() as s:
        unary = await post(s, url, chat_body(f"hello in {mode}"))
        assert unary.status == 200, unary.body
        assert (
            unary.text
            and unary.usage is not None
            and unary.worker in {e.name for e in stack.engines}
        )
        assert unary.headers.get("x-request-id", "").startswith("pr-")

        streamed = await post(s, url, chat_body(f"stream in {mode}", stream=True))
        assert streamed.status == 200 and streamed.done and streamed.text
        # The picker asked the engine for the usage chunk; the client did not, so it is dropped.
        assert streamed.usage is None

        asked = await post(
            s,
            url,
            chat_body(f"usage in {mode}", stream=True, stream_options={"include_usage": True}),
        )
        assert asked.status == 200 and asked.done and asked.usage is not None

        comp = {"model": "tiny", "prompt": f"Complete this in {mode}:", "max_tokens": 4}
        done = await post(s, url, comp, path="/v1/completions")
        assert done.status == 200 and done.text and done.usage is not None
        streamed_comp = await post(s, url, {**comp, "stream": True}, path="/v1/completions")
        assert streamed_comp.status == 200 and streamed_comp.done and streamed_comp.text


@pytest.mark.parametrize("mode", MODES)
async def test_a_repeated_document_sticks_to_one_engine_with_cached_tokens(
    stack: Stack, mode: str
) -> None:
    url = stack.envoys[mode].url
    doc = _doc(f"sticky-{mode}")
    async with client() as s:
        answers = [
            await post(s, url, chat_body(f"{doc}\n\nQuestion {i}?", stream=i % 2 == 1))
            for i in range(4)
        ]
    assert all(a.status == 200 for a in answers)
    assert len({a.worker for a in answers}) == 1
    # Streams report their cache reuse too: the picker asked for the usage chunk.
    # A streamed answer's usage is dropped for the client, so read the picker's log.
    # (At most the shared system prompt's first block is cached on a first question.)
    assert answers[0].cached < COLD and answers[2].cached > WARM
    records = await decisions(stack.picker.http, [a.headers["x-request-id"] for a in answers])
    cached = [r["actual_cached_tokens"] for r in records]
    assert cached[0] < COLD and all(c > WARM for c in cached[1:]), cached
    # A stream's time to first token (the picker's first response chunk) is fed back.
    assert [r["stream"] for r in records] == [False, True, False, True]
    assert all(r["ttft_ms"] > 0 for r in records[1::2])
    assert all(r["ttft_ms"] is None for r in records[::2])


async def test_tenants_do_not_share_cache(stack: Stack) -> None:
    url = stack.envoys["FULL_DUPLEX_STREAMED"].url
    doc = _doc("tenancy")

    def as_(tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}

    async with client() as s:
        a1 = await post(s, url, chat_body(f"{doc}\nQ1"), headers=as_("team-a"))
        a2 = await post(s, url, chat_body(f"{doc}\nQ2"), headers=as_("team-a"))
        b1 = await post(s, url, chat_body(f"{doc}\nQ1"), headers=as_("team-b"))
        anon = await post(s, url, chat_body(f"{doc}\nQ1"))
    assert [a.status for a in (a1, a2, b1, anon)] == [200] * 4
    assert a2.cached > WARM  # team-a's own cache
    # The same document, already cached for team-a, is cold for team-b and anonymous
    # clients: the picker injected team-a's cache_salt, so the engine keeps it apart.
    assert b1.cached == 0 and anon.cached < COLD


@pytest.mark.parametrize("mode", MODES)
async def test_bad_requests_get_openai_errors(stack: Stack, mode: str) -> None:
    url = stack.envoys[mode].url
    async with client() as s:
        unknown = await post(s, url, {**chat_body("hi"), "model": "no-such-model"})
        bad_json = await post(s, url, b'{"model": "tiny", "messages": [')
        bad_field = await post(s, url, {**chat_body("hi"), "max_tokens": "lots"})
        bad_key = await post(s, url, chat_body("hi"), headers={"Authorization": "Bearer nope"})
    assert unknown.status == 404 and unknown.body["error"]["code"] == "model_not_found"
    assert bad_json.status == 400 and bad_json.body["error"]["code"] == "invalid_json"
    assert bad_field.status == 400 and bad_field.body["error"]["param"] == "max_tokens"
    assert bad_key.status == 401 and bad_key.body["error"]["type"] == "authentication_error"


async def test_the_pickers_metrics_and_decision_log_are_the_gateways(stack: Stack) -> None:
    url = stack.envoys["FULL_DUPLEX_STREAMED"].url
    async with client() as s:
        ok = await post(s, url, chat_body(_doc("books")))
        async with s.get(stack.picker.http + "/health") as r:
            assert r.status == 200
    assert ok.status == 200
    rid = ok.headers["x-request-id"]
    (record,) = await decisions(stack.picker.http, [rid])
    assert record["selected_worker"] == ok.worker and record["status"] == 200
    assert record["prompt_tokens"] == ok.usage["prompt_tokens"]  # type: ignore[index]
    done = await metric_lines(stack.picker.http, "prefixrouter_requests_total")
    assert any(f'worker="{ok.worker}"' in line and 'status="200"' in line for line in done)
    assert any('status="404"' in line for line in done)  # the refusals are counted too
    assert await metric_lines(stack.picker.http, "prefixrouter_input_tokens_total")


async def test_grpc_health_names_and_the_subset_hint(stack: Stack) -> None:
    target = f"127.0.0.1:{stack.picker.grpc_port}"
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", protocol.EXT_PROC_SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        stub = pb_grpc.ExternalProcessorStub(channel)
        only = stack.engines[2]
        picked = await _pick(stub, [f"127.0.0.1:{only.port}"], _doc("subset"))
        assert picked.WhichOneof("response") == "request_body"
        mutation = picked.request_body.response.header_mutation
        dest = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        assert dest[protocol.DESTINATION] == f"127.0.0.1:{only.port}"
        md = picked.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
        assert md.fields[protocol.DESTINATION].string_value == dest[protocol.DESTINATION]
        # No worker of the subset: a 503, as the protocol asks.
        refused = await _pick(stub, ["10.255.0.1:8000"], _doc("subset"))
        assert refused.WhichOneof("response") == "immediate_response"
        assert refused.immediate_response.status.code == 503


async def _pick(stub: Any, subset: list[str], content: str) -> pb.ProcessingResponse:
    """Play Envoy in BUFFERED mode for one request carrying a subset hint; return the pick."""
    import orjson
    from google.protobuf import struct_pb2

    hint = struct_pb2.Struct()
    hint.fields[protocol.SUBSET].list_value.extend(subset)
    meta = base_pb2.Metadata()
    meta.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(hint)
    body = orjson.dumps(chat_body(content))
    headers = ext_proc_headers({":path": "/v1/chat/completions"})
    messages = [
        pb.ProcessingRequest(request_headers=headers, metadata_context=meta),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    call = stub.Process()
    await call.write(messages[0])
    first = await call.read()
    if first.WhichOneof("response") == "immediate_response":
        call.cancel()
        return first
    await call.write(messages[1])
    answer = await call.read()
    call.cancel()
    return answer


@pytest.mark.parametrize("mode", MODES)
async def test_a_long_prompt_goes_through(stack: Stack, mode: str) -> None:
    # Past the gateway's off-loop parse size (256 KiB): parsed on the parse thread.
    long_doc = _doc(f"long-{mode}") * 62  # about 270 KiB, 90,000 tokens
    async with client() as s:
        answer = await post(s, stack.envoys[mode].url, chat_body(long_doc, max_tokens=1))
    assert answer.status == 200, answer.body
    assert answer.usage is not None and answer.usage["prompt_tokens"] > 50_000


async def test_a_fallback_that_served_takes_the_pick_back(stack: Stack) -> None:
    """The data plane reports another endpoint served: the pick did no prefill there."""
    from google.protobuf import struct_pb2

    target = f"127.0.0.1:{stack.picker.grpc_port}"
    before = await metric_lines(stack.picker.http, "prefixrouter_retries_total")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(
            pb.ProcessingRequest(request_headers=ext_proc_headers({":path": "/v1/completions"}))
        )
        await call.read()
        body = b'{"model": "tiny", "prompt": "fallback served", "max_tokens": 1}'
        await call.write(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
        picked = await call.read()
        mutation = picked.request_body.response.header_mutation
        dest = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        other = next(f"127.0.0.1:{e.port}" for e in stack.engines
                     if f"127.0.0.1:{e.port}" != dest[protocol.DESTINATION])  # fmt: skip
        served = struct_pb2.Struct()
        served.fields[protocol.UPSTREAM_ADDRESS].string_value = other
        await call.write(
            pb.ProcessingRequest(
                response_headers=ext_proc_headers({":status": "200"}),
                attributes={protocol.EXT_PROC_ATTRIBUTES: served},
            )
        )
        answer = await call.read()
        # Not the picked worker's answer: no X-Prefixrouter-Worker on it.
        assert not answer.response_headers.response.header_mutation.set_headers
        call.cancel()
    after = await metric_lines(stack.picker.http, "prefixrouter_retries_total")
    assert any('status="fallback"' in line for line in after) and after != before


@pytest.mark.parametrize("mode", MODES)
async def test_other_paths_go_to_a_ready_engine_as_they_are(stack: Stack, mode: str) -> None:
    url = stack.envoys[mode].url
    async with client() as s:
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
        # A body on a path the picker does not route by: streamed through unchanged.
        tokens = await post(s, url, {"model": "tiny", "prompt": "hello world"}, path="/tokenize")
    assert tokens.status == 200 and tokens.body["tokens"]
