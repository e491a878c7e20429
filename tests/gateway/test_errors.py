"""The exception -> OpenAI error mapping drawn in ``gateway/errors.py``."""

from __future__ import annotations

import orjson
import pytest

from prefixrouter.errors import ConfigError, NoWorkerAvailable, UnknownNameError
from prefixrouter.gateway.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    UpstreamFailed,
    error_response,
    upstream_error_body,
)


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (BadRequest("x", code="invalid_json"), 400, "invalid_request_error", "invalid_json"),
        (Unauthorized("x"), 401, "authentication_error", "invalid_api_key"),
        (NotFound("x", code="model_not_found"), 404, "invalid_request_error", "model_not_found"),
        (Conflict("x"), 409, "invalid_request_error", "conflict"),
        (PayloadTooLarge("x"), 413, "invalid_request_error", "request_too_large"),
        (ServiceUnavailable("x"), 503, "service_unavailable", "no_healthy_worker"),
        (UpstreamFailed("x"), 502, "upstream_error", "upstream_unreachable"),
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
    openai = orjson.dumps({"error": {"message": "m", "type": "t", "param": None, "code": 400}})
    assert upstream_error_body(openai, 400) == openai
    old = orjson.dumps(
        {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    )
    err = orjson.loads(upstream_error_body(old, 400))["error"]
    assert err == {"message": "bad", "type": "BadRequestError", "param": None, "code": "400"}
    err = orjson.loads(upstream_error_body(b"Internal Server Error", 500))["error"]
    assert err["message"] == "Internal Server Error" and err["code"] == "500"
    err = orjson.loads(upstream_error_body(b"", 502))["error"]
    assert err["message"] == "upstream answered 502"
