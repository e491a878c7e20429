"""The exception -> OpenAI error mapping drawn in ``gateway/errors.py``, and over HTTP.

Protocol errors (what aiohttp's parser rejects) and method mismatches go
through a real gateway on loopback and raw sockets.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from prefixrouter.errors import ConfigError, NoWorkerAvailable, UnknownNameError
from prefixrouter.gateway.errors import (
    BadRequest,
    Conflict,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    Unauthorized,
    UpstreamFailed,
    UpstreamTimeout,
    error_response,
    upstream_error_body,
)
from tests.gateway.served import BOUND_S, HOST, gateway, status_and_json


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (BadRequest("x", code="invalid_json"), 400, "invalid_request_error", "invalid_json"),
        (Unauthorized("x"), 401, "authentication_error", "invalid_api_key"),
        (NotFound("x", code="model_not_found"), 404, "invalid_request_error", "model_not_found"),
        (MethodNotAllowed("x"), 405, "invalid_request_error", "method_not_allowed"),
        (RequestTimeout("x"), 408, "invalid_request_error", "request_timeout"),
        (Conflict("x"), 409, "invalid_request_error", "conflict"),
        (PayloadTooLarge("x"), 413, "invalid_request_error", "request_too_large"),
        (ServiceUnavailable("x"), 503, "service_unavailable", "no_healthy_worker"),
        (UpstreamFailed("x"), 502, "upstream_error", "upstream_unreachable"),
        (UpstreamTimeout("x"), 504, "upstream_error", "upstream_timeout"),
        (NoWorkerAvailable("x"), 503, "service_unavailable", "no_healthy_worker"),
        (ConfigError("x"), 400, "invalid_request_error", "invalid_config"),
        (UnknownNameError("policy", "p", []), 404, "invalid_request_error", "not_found"),
        (RuntimeError("boom"), 500, "internal_error", "internal_error"),
    ],
)
def test_mapping(exc: BaseException, status: int, type_: str, code: str) -> None:
    resp = error_response(exc, retry_after_s=3)
    assert resp.status == status and resp.content_type == "application/json"
    assert resp.body is not None
    err = orjson.loads(resp.body)["error"]  # type: ignore[arg-type]
    assert (err["type"], err["code"]) == (type_, code) and err["message"]
    if isinstance(exc, NoWorkerAvailable):
        assert resp.headers["Retry-After"] == "3"
    if isinstance(exc, RuntimeError):
        assert "boom" not in err["message"]  # no internals leak


def test_upstream_bodies_keep_or_get_the_openai_shape() -> None:
    openai = orjson.dumps({"error": {"message": "m", "type": "t", "param": None, "code": "x"}})
    assert upstream_error_body(openai, 400) == openai
    # vLLM's current shape has the status as an integer code (found by the fuzzer).
    vllm = orjson.dumps({"error": {"message": "m", "type": "t", "param": 3, "code": 400}})
    err = orjson.loads(upstream_error_body(vllm, 400))["error"]
    assert err == {"message": "m", "type": "t", "param": None, "code": "400"}
    old = orjson.dumps(
        {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    )
    err = orjson.loads(upstream_error_body(old, 400))["error"]
    assert err == {"message": "bad", "type": "BadRequestError", "param": None, "code": "400"}
    err = orjson.loads(upstream_error_body(b"Internal Server Error", 500))["error"]
    assert err["message"] == "Internal Server Error" and err["code"] == "500"
    err = orjson.loads(upstream_error_body(b"", 502))["error"]
    assert err["message"] == "upstream answered 502"


SECRET = "sk-live-do-not-log-me"
CLOSE = b"Connection: close\r\n\r\n"


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(request)
    try:
        async with asyncio.timeout(BOUND_S):
            return await reader.read()
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (  # one header over max_header_bytes (8190)
            f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}"
            + "x" * 9000
            + "\r\n\r\n",
            431,
            "header_too_large",
        ),
        (  # a request line over max_request_line_bytes
            f"GET /{SECRET}{'a' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n",
            414,
            "request_line_too_long",
        ),
        (  # more than max_headers (128)
            "GET /health HTTP/1.1\r\nHost: x\r\n"
            + "".join(f"X-{SECRET}-{i}: v\r\n" for i in range(200))
            + "\r\n",
            431,
            "too_many_headers",
        ),
        (f"{SECRET}\r\n\r\n", 400, "bad_request_line"),
    ],
)
async def test_protocol_errors_are_openai_shaped_and_log_no_traceback(
    request_bytes: str, status: int, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with gateway({}) as (port, _):
        got, body, head = status_and_json(await _raw(port, request_bytes.encode()))
    assert (got, body["error"]["code"]) == (status, code)
    assert body["error"]["type"] == "invalid_request_error"
    assert b"application/json" in head
    assert SECRET not in orjson.dumps(body).decode()
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert SECRET not in record.getMessage()


async def test_wrong_method_is_405_with_allow_and_unknown_path_404() -> None:
    async with gateway({}) as (port, _):
        post = await _raw(
            port, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n" + CLOSE
        )
        get = await _raw(port, b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + CLOSE)
        missing = await _raw(port, b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n" + CLOSE)
    status, body, head = status_and_json(post)
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert b"\r\nAllow: GET, HEAD\r\n" in head
    status, _, head = status_and_json(get)
    assert status == 405 and b"\r\nAllow: POST\r\n" in head
    status, body, _ = status_and_json(missing)
    assert status == 404 and body["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/chat/completions", 400, "invalid_body"),  # read: the error is the client's answer
        ("/admin/workers", 403, "admin_api_disabled"),  # answered without reading the body
    ],
)
async def test_a_body_that_is_not_its_content_encoding_logs_no_traceback(
    path: str, status: int, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    body = b'{"model":"tiny","messages":[{"role":"user","content":"x"}]}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\n"
    )
    async with gateway({}) as (port, _):
        got, data, _ = status_and_json(await _raw(port, head.encode() + CLOSE + body))
        await asyncio.sleep(0.1)  # aiohttp's drain after the answer would log now
    assert (got, data["error"]["code"]) == (status, code)
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert "Unhandled exception" not in record.getMessage()
