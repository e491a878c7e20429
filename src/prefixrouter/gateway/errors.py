"""OpenAI-shaped error responses, and which exception becomes which status.

Every error the gateway answers has OpenAI's shape, so OpenAI client libraries
raise their usual exceptions::

    {"error": {"message": "...", "type": "...", "param": "...", "code": "..."}}

Mapping (exception -> HTTP status, ``type``, ``code``)::

    PrefixRouterError
    ├── GatewayError                 raised by the gateway's own handlers
    │   ├── BadRequest               400  invalid_request_error  invalid_json | missing_field
    │   │                                                         | invalid_field  (param = field)
    │   ├── Unauthorized             401  authentication_error   invalid_api_key
    │   ├── Forbidden                403  permission_error       admin_api_disabled
    │   │                                                         | tenant_header_refused
    │   │                                                         | tenant_not_served
    │   ├── NotFound                 404  invalid_request_error  model_not_found | not_found
    │   │                                                         | unsupported_endpoint
    │   ├── MethodNotAllowed         405  invalid_request_error  method_not_allowed  (+ Allow)
    │   ├── RequestTimeout           408  invalid_request_error  request_timeout  (slow body)
    │   ├── Conflict                 409  invalid_request_error  conflict  (id or topic taken)
    │   ├── PayloadTooLarge          413  invalid_request_error  request_too_large
    │   ├── TooManyRequests          429  rate_limit_error       rate_limit_exceeded
    │   │                                                         | too_many_in_flight
    │   │                                                           (+ Retry-After)
    │   ├── ServiceUnavailable       503  service_unavailable    no_healthy_worker  (+ Retry-After)
    │   │   └── Overloaded           503  service_unavailable    overloaded  (shed; + Retry-After)
    │   └── UpstreamFailed           502  upstream_error         upstream_unreachable
    │       └── UpstreamTimeout      504  upstream_error         upstream_timeout
    ├── RoutingError
    │   └── NoWorkerAvailable        503  service_unavailable    no_healthy_worker  (+ Retry-After)
    ├── ConfigError                  400  invalid_request_error  invalid_config  (admin API input)
    └── UnknownNameError             404  invalid_request_error  not_found
    anything else                    500  internal_error         internal_error  (never a traceback)

Requests the HTTP parser rejects (a malformed request, a request line or
header over its limit, too many headers) and connections past the cap are
answered in the same shape by :mod:`prefixrouter.gateway.server` (400, 414,
431, 503 ``too_many_connections``); a path that exists under another method
gets 405 with ``Allow`` (``method_not_allowed``).

Upstream failures: an upstream that cannot be reached, refuses
(``proxy.retry_statuses``) or breaks before its first byte makes the request
try another worker; only when none is left does the client see the last
refusal's own answer (status kept) or a 502 ``upstream_unreachable`` that
names every worker tried and why (a 504 ``upstream_timeout`` when every
attempt timed out: the gateway gave up waiting). A stream that breaks after
bytes reached the client ends with an SSE ``data: {"error": ...}`` event
(never a retry).

An upstream engine's own error keeps its status: its body is passed through
when it already has the OpenAI shape and wrapped into it otherwise
(:func:`upstream_error_body`); vLLM's older ``{"object": "error", "message",
"type", "code"}`` shape is converted, and so is its ``{"error": {...}}`` whose
``code`` is the status as an integer (OpenAI's is a string or null: the
fuzzer found clients being handed ``"code": 400``).

Why the integer ``code`` is not kept as vLLM sends it: OpenAI's error object
has ``code`` as a string or null, and so does the gateway's published
schema (``/openapi.json``). openai-python and openai-node copy the field
without checking it, but typed clients decode it into a string field
(``Option<String>`` in Rust's async-openai, ``String?`` in Dart, ``*string``
in several Go clients): an integer there fails the decode of the whole error,
and the client reports a parse failure instead of the engine's message. The
string ``"400"`` is read by every one of them, and the status itself is
unchanged. The gateway's own errors have always had string codes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from prefixrouter.errors import (
    ConfigError,
    NoWorkerAvailable,
    PrefixRouterError,
    UnknownNameError,
)

JSON = "application/json"


class GatewayError(PrefixRouterError):
    """An error the gateway answers with an OpenAI-shaped body.

    Attributes:
        status: HTTP status.
        type: OpenAI error ``type``.
        code: OpenAI error ``code``.
        param: The offending request field, if any.
        headers: Extra response headers (``Retry-After``).
        close: Close the connection after the answer (the request was not read whole).
    """

    status = 500
    close = False
    type = "internal_error"
    code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = headers or {}


class BadRequest(GatewayError):
    """400: invalid JSON, a missing field or a field of the wrong type or value."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_field"


class Unauthorized(GatewayError):
    """401: a missing or unknown API key where one is required."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    """403: not allowed whoever asks (an admin API with no key configured, a refused tenant)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    """404: an unknown model or object."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


def model_not_found(model: str) -> NotFound:
    """404 for a model no worker serves, in OpenAI's words (``code`` ``model_not_found``,
    ``param`` ``model``): a completion that names it, ``GET /v1/models/{model}``."""
    return NotFound(f"The model `{model}` does not exist.", code="model_not_found", param="model")


class Conflict(GatewayError):
    """409: the object exists (adding a worker whose id or KV-event topic is taken)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class MethodNotAllowed(GatewayError):
    """405: the path exists under other methods; carries ``Allow``."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(GatewayError):
    """408: the request did not arrive in time (``limits.body_*timeout_s``)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    close = True


def json_body(raw: bytes, loads: Callable[[bytes], Any] = orjson.loads) -> Any:
    """A request body's JSON value (``loads``: the parser, e.g. the large-body one).

    Raises:
        BadRequest: Not JSON (``invalid_json``, orjson's message with its position).
    """
    try:
        return loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}", code="invalid_json") from None


class PayloadTooLarge(GatewayError):
    """413: the body is larger than ``server.max_body_bytes``.

    Every message names the setting (appended here, whoever raises it: the
    Content-Length check, the body read, the endpoint picker), so a client
    whose request is refused learns what an operator would have to raise;
    the raiser's message gives the limit in bytes.
    """

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            f"{message} (the gateway's server.max_body_bytes setting)",
            code=code,
            param=param,
            headers=headers,
        )


class TooManyRequests(GatewayError):
    """429: the tenant is over its rate or in-flight limit; carries ``Retry-After``."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ServiceUnavailable(GatewayError):
    """503: no healthy worker can take the request; carries ``Retry-After``."""

    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"


class Overloaded(ServiceUnavailable):
    """503: the gateway is full and shed the request (queue full or waited too long)."""

    code = "overloaded"


class UpstreamFailed(GatewayError):
    """502: every attempted worker failed before answering."""

    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamFailed):
    """504: every attempted worker timed out before answering (a gateway timeout,
    not a worker that could not be reached)."""

    status = 504
    code = "upstream_timeout"


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """The OpenAI error JSON."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def as_gateway_error(exc: BaseException, retry_after_s: int = 1) -> GatewayError:
    """The :class:`GatewayError` any exception is answered as (the module docstring's mapping).

    The HTTP proxy answers it with :func:`error_response`; the endpoint picker
    (:mod:`prefixrouter.epp`) as an ext_proc ImmediateResponse.
    """
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, NoWorkerAvailable):
        return ServiceUnavailable(str(exc), headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, ConfigError):
        return BadRequest(str(exc), code="invalid_config")
    if isinstance(exc, UnknownNameError):
        return NotFound(str(exc))
    return GatewayError(f"internal error: {type(exc).__name__}")


def error_response(exc: BaseException, retry_after_s: int = 1) -> web.Response:
    """The response for any exception, following the mapping in the module docstring."""
    err = as_gateway_error(exc, retry_after_s)
    body = error_body(err.message, err.type, err.code, err.param)
    resp = web.Response(status=err.status, body=body, content_type=JSON, headers=err.headers)
    if err.close:
        resp.force_close()
    return resp


def _openai_shaped(err: dict[str, Any]) -> bool:
    """``message`` and ``type`` strings, ``param`` and ``code`` strings or null."""
    return (
        isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and isinstance(err.get("param"), str | None)
        and isinstance(err.get("code"), str | None)
    )


def upstream_error_body(body: bytes, status: int) -> bytes:
    """An upstream error body in OpenAI's shape (passed through when it already is)."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            if _openai_shaped(err):
                return body
            data = err  # vLLM's {"error": {..., "code": 400}}: code an integer
        if "message" in data:  # or vLLM's older {"object": "error", ...}
            code = data.get("code")
            return error_body(
                str(data["message"]),
                str(data.get("type") or "upstream_error"),
                str(code) if code is not None else str(status),
                data.get("param") if isinstance(data.get("param"), str) else None,
            )
    text = body.decode("utf-8", "replace").strip()[:500] or f"upstream answered {status}"
    return error_body(text, "upstream_error", str(status))
