"""``GET /openapi.json``: every route documented and nothing else; the body schemas as
strict as the parser (a body passes the schema exactly when the gateway accepts it)."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.gateway.app import create_app
from prefixrouter.gateway.config import GatewayConfig, config_from_dict
from prefixrouter.gateway.errors import BadRequest
from prefixrouter.gateway.openapi import ERROR_SCHEMA, OPERATIONS, openapi_document, routes
from prefixrouter.gateway.request_builder import CHAT, COMPLETIONS, RequestBuilder
from prefixrouter.gateway.tenancy import TenantScope
from tests.gateway.helpers import gateway_env, run


def _documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}


def test_every_route_is_documented_and_every_operation_is_a_route() -> None:
    config = GatewayConfig()
    app = create_app(config)
    served = set(routes(app))
    assert served == set(OPERATIONS)  # no undocumented route, no stale entry
    assert _documented(openapi_document(app, config)) == served
    assert ("POST", "/v1/chat/completions") in served and ("GET", "/openapi.json") in served


def test_a_new_route_without_documentation_fails_the_build() -> None:
    config = GatewayConfig()
    app = create_app(config)

    async def handler(request: Any) -> Any:
        raise AssertionError

    app.router.add_get("/v1/secret", handler)
    with pytest.raises(KeyError):
        openapi_document(app, config)


def test_the_gateway_serves_its_document() -> None:
    async def main() -> None:
        async with gateway_env(1) as env:
            r = await env.client.get("/openapi.json")
            assert r.status == 200 and r.content_type == "application/json"
            doc = await r.json()
            assert doc == orjson.loads(orjson.dumps(openapi_document(env.client.app, env.config)))
            assert doc["openapi"] == "3.1.0"
            ops = doc["paths"]["/v1/chat/completions"]["post"]
            assert {"$ref": "#/components/parameters/priority"} in ops["parameters"]
            assert ops["responses"]["default"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"
            }
            assert "tenant" not in doc["components"]["parameters"]  # X-Tenant not trusted

    run(main)


def test_health_answers_only_what_the_document_says() -> None:
    """``/health`` is liveness: 200 with no healthy worker too, and the document says so."""

    async def main() -> None:
        from aiohttp.test_utils import TestClient, TestServer

        config = GatewayConfig()  # no worker can take requests
        async with TestClient(TestServer(create_app(config))) as client:
            r = await client.get("/health")
            body = await r.json()
            doc = await (await client.get("/openapi.json")).json()
        assert (r.status, body["status"]) == (200, "no_healthy_worker")
        assert set(doc["paths"]["/health"]["get"]["responses"]) - {"default"} == {"200"}

    run(main)


def test_errors_the_gateway_writes_match_the_error_schema() -> None:
    async def main() -> None:
        async with gateway_env(1) as env:
            validator = jsonschema_rs.validator_for(ERROR_SCHEMA)
            for r in (
                await env.client.post("/v1/chat/completions", data=b"{"),
                await env.client.get("/nowhere"),
                await env.client.delete("/health"),
                await env.client.get("/admin/workers"),
            ):
                assert r.status >= 400
                assert validator.is_valid(await r.json()), await r.text()

    run(main)


# ---------------------------------------------------------------- as strict as the parser

ABSENT = object()
MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "system", "content": None},
    {"role": "assistant", "content": "", "tool_calls": "x"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
    {"role": "user", "content": [{"text": 5}]},
    {"role": "user", "content": [7]},
    {"role": "wizard", "content": "x"},
    {"role": "", "content": "x"},
    {"content": "x"},
    {"role": "user", "content": 5},
    {"role": "user", "content": {"text": "x"}},
    "just a string",
]
FIELDS: dict[str, list[Any]] = {
    "model": ["tiny", "", 5, None, ABSENT],
    "stream": [True, False, None, "yes", ABSENT],
    "stream_options": [ABSENT, None, {}, {"include_usage": True}, {"include_usage": None}, []],
    "max_tokens": [ABSENT, None, 1, 0, "8", True, -3],
    "max_completion_tokens": [ABSENT, None, 4, 0, "4"],
    "cache_salt": [ABSENT, None, "s", 7],
}
CHAT_FIELDS = {
    "messages": [MESSAGES[:4], ABSENT, [], "hi", None, *([m] for m in MESSAGES)],
    "tools": [ABSENT, None, [], [{"type": "function"}], {"a": 1}, [5]],
}
PROMPTS = [
    "x", ABSENT, None, "", [], ["a", "b"], ["a", 1], [1, 2], [0, 2**32 - 1], [1, -2], [2**32],
    [[1], [2]], [[1], "x"], [[]], [True], 5, {"a": 1},
]  # fmt: skip


def _body(draw: st.DrawFn, fields: dict[str, list[Any]]) -> dict[str, Any]:
    """A valid body (every field's first value) with up to three fields drawn anew.

    Each field's values mix what the parser takes and what it refuses, so a
    body is valid or not by one or two fields: the cases that tell a schema
    as strict as the parser from a looser or a stricter one.
    """
    chosen = {name: values[0] for name, values in fields.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        chosen[name] = draw(st.sampled_from(fields[name]))
    return {k: v for k, v in chosen.items() if v is not ABSENT}


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    return _body(draw, {**FIELDS, **CHAT_FIELDS})


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    return _body(draw, {**FIELDS, "prompt": PROMPTS})


def _accepted(body: Any, kind: str) -> bool:
    builder = RequestBuilder(config_from_dict({}), frozenset)
    try:
        builder.build(body, orjson.dumps(body), kind, lambda salt: TenantScope("", "", None), None)
    except BadRequest:
        return False
    return True


def _validator(component: str) -> Any:
    config = GatewayConfig()
    doc = openapi_document(create_app(config), config)
    return jsonschema_rs.validator_for(doc["components"]["schemas"][component])


CHAT_SCHEMA = _validator("ChatCompletionRequest")
COMPLETION_SCHEMA = _validator("CompletionRequest")


@settings(max_examples=200, deadline=None)
@given(chat_bodies())
def test_chat_schema_accepts_exactly_what_the_parser_accepts(body: dict[str, Any]) -> None:
    assert CHAT_SCHEMA.is_valid(body) == _accepted(body, CHAT), body


@settings(max_examples=150, deadline=None)
@given(completion_bodies())
def test_completion_schema_accepts_exactly_what_the_parser_accepts(body: dict[str, Any]) -> None:
    assert COMPLETION_SCHEMA.is_valid(body) == _accepted(body, COMPLETIONS), body


@pytest.mark.parametrize("body", [[], "x", 5, None])
def test_a_body_that_is_no_object_fails_both(body: Any) -> None:
    assert not CHAT_SCHEMA.is_valid(body) and not _accepted(body, CHAT)
