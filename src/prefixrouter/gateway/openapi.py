"""``GET /openapi.json``: the OpenAPI 3.1 document of the gateway's own endpoints.

One owner per fact: the paths and methods come from the application's router
(:func:`openapi_document` walks it, so a route cannot be served undocumented:
a route without an entry in :data:`OPERATIONS` raises, and the tests check
both directions); request schemas are built from the definitions the parsers
use:

* completion bodies from :mod:`prefixrouter.prompt.request` and
  :mod:`prefixrouter.prompt.render` (the roles, the token-id bound, the
  content rules of the gateway's mode: text mode renders any content part,
  token mode takes text parts only), exactly as strict as they are: a body
  the schema accepts passes the gateway's validation (the engine may still
  refuse it: a prompt past its context), and one it refuses is a 400;
* ``POST /admin/workers`` from :class:`~prefixrouter.gateway.config.WorkerConfig`'s
  own JSON schema (pydantic), since the handler validates with that model;
* headers: ``X-Priority`` (:mod:`.controls`), ``X-Prefix-Class``
  (:class:`~prefixrouter.core.types.PrefixClass`) and, where the gateway
  trusts it, ``X-Tenant``;
* every error: :data:`ERROR_SCHEMA`, the shape :mod:`.errors` writes.

The document depends on the configuration (routing mode, trusted headers),
so each gateway serves its own, built once at startup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from prefixrouter import __version__
from prefixrouter.core.types import PrefixClass
from prefixrouter.gateway.config import GatewayConfig, WorkerConfig
from prefixrouter.gateway.controls import PRIORITY_HEADER, PRIORITY_MAX, PRIORITY_MIN
from prefixrouter.gateway.dashboard.routes import DASHBOARD_PATH
from prefixrouter.gateway.errors import JSON
from prefixrouter.prompt.classify import PREFIX_CLASS_HEADER
from prefixrouter.prompt.render import OPENAI_ROLES, TEXT_PART_FIELDS
from prefixrouter.prompt.request import MAX_TOKEN_ID

OPENAPI_PATH = "/openapi.json"
CATCH_ALL = "/{tail}"
"""The route that answers 404/405 for everything else: not an endpoint, not documented."""

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
"""OpenAI's error body, as :func:`prefixrouter.gateway.errors.error_body` writes it."""

_REF = "#/components/schemas/"
_POSITIVE_OR_NULL = {"type": ["integer", "null"], "minimum": 1}
_TOKEN_IDS = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}


def _options_properties() -> dict[str, Any]:
    """The fields :func:`prefixrouter.prompt.request.request_options` reads."""
    return {
        "model": {"type": "string", "minLength": 1},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": ["boolean", "null"]}},
        },
        "max_tokens": _POSITIVE_OR_NULL,
        "max_completion_tokens": _POSITIVE_OR_NULL,
        "cache_salt": {"type": ["string", "null"]},
        "lora_path": {"description": "SGLang's adapter; a non-empty string names it"},
    }


def _chat_schema(text_only: bool) -> dict[str, Any]:
    """``messages`` and ``tools`` as :func:`prefixrouter.prompt.render.render_chat` reads them."""
    if text_only:  # token mode: the text-only template's rules, media routed before it
        text_types = sorted(t for t, f in TEXT_PART_FIELDS.items() if f == "text")
        other_text = {t: f for t, f in TEXT_PART_FIELDS.items() if f != "text"}
        part: dict[str, Any] = {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "object",
                    "required": ["text"],
                    "properties": {
                        "type": {"enum": text_types},
                        "text": {"type": "string"},
                    },
                },
                *(
                    {
                        "type": "object",
                        "required": ["type", field],
                        "properties": {"type": {"const": kind}, field: {"type": "string"}},
                    }
                    for kind, field in sorted(other_text.items())
                ),
                {  # media: an image, audio, a video, a file...
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"not": {"enum": sorted(TEXT_PART_FIELDS)}}},
                },
            ]
        }
        tool_calls: dict[str, Any] = {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["function"],
                "properties": {
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    }
                },
            },
        }
        tool: dict[str, Any] = {"type": "object"}
    else:  # text mode: anything that is not text renders as a placeholder
        part, tool_calls, tool = {}, {}, {}
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            # Any role, as vLLM hands any to the template (OpenAI's are examples).
            "role": {"type": "string", "minLength": 1, "examples": sorted(OPENAI_ROLES)},
            "content": {"type": ["string", "null", "array"], "items": part},
            "tool_calls": tool_calls,
        },
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_options_properties(),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "tools": {"type": ["array", "null"], "items": tool},
            # What :func:`prefixrouter.prompt.request.template_options` reads.
            "add_generation_prompt": {"type": ["boolean", "null"]},
            "continue_final_message": {"type": ["boolean", "null"]},
            "documents": {"type": ["array", "null"], "items": {"type": "object"}},
            "chat_template_kwargs": {"type": ["object", "null"]},
            "chat_template": {"type": ["string", "null"]},
        },
    }


def _completion_schema() -> dict[str, Any]:
    """``prompt`` as :func:`prefixrouter.prompt.request.completion_prompts` reads it."""
    prompt = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
            {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
            {"type": "array", "minItems": 1, "items": {"type": "array", "items": _TOKEN_IDS}},
        ]
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {**_options_properties(), "prompt": prompt},
    }


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {JSON: {"schema": schema}}}


def _ok(description: str, schema: dict[str, Any] | None = None, media: str = JSON) -> Any:
    return {"description": description, "content": {media: {"schema": schema or {}}}}


_ERRORS = {"default": {"description": "An error", **_json_body({"$ref": _REF + "Error"})}}
_COMPLETION_OK = {
    "description": "The engine's answer (JSON), or its stream (server-sent events)",
    "content": {JSON: {"schema": {"type": "object"}}, "text/event-stream": {"schema": {}}},
}
_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}


@dataclass(frozen=True, slots=True)
class Operation:
    """One documented endpoint (what OpenAPI says beyond its path and method)."""

    summary: str
    responses: dict[str, Any]
    body: str | None = None  # a component schema's name
    parameters: tuple[str, ...] = ()  # component parameters' names
    admin: bool = False
    tags: tuple[str, ...] = field(default=())


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        "Route a chat completion to the worker that answers first",
        {"200": _COMPLETION_OK},
        body="ChatCompletionRequest",
        parameters=("priority", "prefix_class", "tenant"),
        tags=("openai",),
    ),
    ("POST", "/v1/completions"): Operation(
        "Route a completion to the worker that answers first",
        {"200": _COMPLETION_OK},
        body="CompletionRequest",
        parameters=("priority", "prefix_class", "tenant"),
        tags=("openai",),
    ),
    ("GET", "/v1/models"): Operation(
        "The models the workers serve",
        {"200": _ok("The models", {"type": "object", "required": ["object", "data"]})},
        tags=("openai",),
    ),
    ("GET", "/v1/models/{model}"): Operation(
        "One model the workers serve (404 model_not_found for any other)",
        {"200": _ok("The model", {"type": "object", "required": ["id", "object"]})},
        parameters=("model_id",),
        tags=("openai",),
    ),
    ("GET", "/health"): Operation(
        "Liveness: 200 while the process serves; the body's status says whether a worker "
        "can take requests (ok or no_healthy_worker)",
        {"200": _ok("Serving", _STATUS)},
        tags=("operations",),
    ),
    ("GET", "/ready"): Operation(
        "Readiness: a cluster replica answers 503 until it has replayed its peers' facts",
        {"200": _ok("Ready", _STATUS), "503": _ok("Replaying", _STATUS)},
        tags=("operations",),
    ),
    ("GET", "/metrics"): Operation(
        "Prometheus metrics",
        {"200": _ok("Text exposition format", {"type": "string"}, "text/plain")},
        tags=("operations",),
    ),
    ("GET", OPENAPI_PATH): Operation(
        "This document", {"200": _ok("OpenAPI 3.1", {"type": "object"})}, tags=("operations",)
    ),
    ("GET", "/admin/workers"): Operation(
        "Every worker's state",
        {"200": _ok("The workers", {"type": "object", "required": ["workers"]})},
        admin=True,
    ),
    ("POST", "/admin/workers"): Operation(
        "Add a worker (answers after its first health check)",
        {"201": _ok("The worker's state", {"type": "object"})},
        body="WorkerConfig",
        admin=True,
    ),
    ("DELETE", "/admin/workers/{id}"): Operation(
        "Drain a worker, wait for its requests, remove it",
        {"200": _ok("What the drain left", {"type": "object"})},
        parameters=("worker_id", "drain_timeout"),
        admin=True,
    ),
    ("GET", "/admin/decisions"): Operation(
        "The newest decision-log records",
        {"200": _ok("Records", {"type": "object", "required": ["decisions"]})},
        parameters=("limit",),
        admin=True,
    ),
    ("GET", "/admin/process"): Operation(
        "The gateway's pid, CPU seconds and request count",
        {"200": _ok("Figures", {"type": "object", "required": ["pid"]})},
        admin=True,
    ),
    ("GET", DASHBOARD_PATH): Operation(
        "The live dashboard (an HTML page; its data needs the admin key, 403 where none is set)",
        {"200": _ok("The page", {"type": "string"}, "text/html")},
        tags=("dashboard",),
    ),
    ("GET", DASHBOARD_PATH + "/static/{name}"): Operation(
        "One of the dashboard's own assets (script, style sheet)",
        {"200": _ok("The asset", {"type": "string"}, "text/plain")},
        parameters=("asset_name",),
        tags=("dashboard",),
    ),
    ("GET", DASHBOARD_PATH + "/events"): Operation(
        "The dashboard's live feed: one server-sent event a second (it does not end)",
        {"200": _ok("The event stream", {"type": "string"}, "text/event-stream")},
        admin=True,
        tags=("dashboard",),
    ),
    ("GET", DASHBOARD_PATH + "/snapshot"): Operation(
        "The dashboard's figures now, as one JSON document",
        {"200": _ok("The snapshot", {"type": "object"})},
        admin=True,
        tags=("dashboard",),
    ),
}
"""Every endpoint's documentation, keyed by (method, aiohttp path)."""


def _parameters(config: GatewayConfig) -> dict[str, Any]:
    lo, hi = PRIORITY_MIN, PRIORITY_MAX
    params: dict[str, Any] = {
        "priority": {
            "name": PRIORITY_HEADER,
            "in": "header",
            "description": f"Lower this request's priority ({lo} to {hi}; capped at the "
            "tenant's): under overload higher goes first",
            "schema": {"type": "string", "pattern": r"^[+-]?(0{0,2}[0-9]|0?[1-9][0-9]|100)$"},
        },
        "prefix_class": {
            "name": PREFIX_CLASS_HEADER,
            "in": "header",
            "description": "State the request's prefix class instead of inferring it",
            "schema": {"enum": [c.value for c in PrefixClass]},
        },
        "worker_id": {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
        "model_id": {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}},
        "asset_name": {
            "name": "name",
            "in": "path",
            "required": True,
            "schema": {"type": "string", "pattern": "^[A-Za-z0-9._-]+$"},
        },
        "drain_timeout": {
            "name": "timeout",
            "in": "query",
            "description": "Seconds to wait for the worker's requests (default: "
            "proxy.drain_timeout_s)",
            "schema": {"type": "number"},
        },
        "limit": {
            "name": "limit",
            "in": "query",
            "schema": {"type": "string", "pattern": "^[0-9]+$"},
        },
    }
    if config.trust_tenant_header:
        params["tenant"] = {
            "name": "X-Tenant",
            "in": "header",
            "description": "The tenant of a request without a key (set by the proxy in front)",
            "schema": {"type": "string"},
        }
    return params


def _worker_schema(components: dict[str, Any]) -> None:
    schema = WorkerConfig.model_json_schema(ref_template=_REF + "{model}")
    components.update(schema.pop("$defs", {}))
    components["WorkerConfig"] = schema


def _operation_id(method: str, path: str) -> str:
    """``post_v1_chat_completions``, ``delete_admin_workers_id``."""
    words = path.replace("{", "").replace("}", "").replace(".", "_").strip("/").split("/")
    return "_".join([method.lower(), *words])


def openapi_document(app: web.Application, config: GatewayConfig) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes.

    Raises:
        KeyError: A route has no entry in :data:`OPERATIONS` (a new route must be documented).
    """
    params = _parameters(config)
    schemas: dict[str, Any] = {
        "Error": ERROR_SCHEMA,
        "ChatCompletionRequest": _chat_schema(text_only=config.routing.mode == "token"),
        "CompletionRequest": _completion_schema(),
    }
    _worker_schema(schemas)
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes(app):
        op = OPERATIONS[(method, path)]
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": _operation_id(method, path),
            "responses": {**op.responses, **_ERRORS},
            "tags": list(op.tags or ("admin",)),
        }
        names = [p for p in op.parameters if p in params]
        if names:
            entry["parameters"] = [{"$ref": "#/components/parameters/" + n} for n in names]
        if op.body is not None:
            entry["requestBody"] = {"required": True, **_json_body({"$ref": _REF + op.body})}
        if op.admin:
            entry["security"] = [{"adminKey": []}]
        elif op.tags == ("openai",):
            entry["security"] = [{"apiKey": []}, {}]
        paths.setdefault(path, {})[method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "prefixrouter gateway",
            "version": __version__,
            "description": "A prefix-aware router in front of OpenAI-compatible engines.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "parameters": params,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "A tenant's key"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "The admin key"},
            },
        },
    }


def routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route the application serves, the catch-all left out."""
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter") or ""
        if path == CATCH_ALL or route.method == "HEAD":
            continue
        out.append((route.method, path))
    return out


def openapi_handler(config: GatewayConfig) -> Any:
    """The handler of ``GET /openapi.json`` (the document is built on the first call)."""
    cached: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        if not cached:
            cached.append(orjson.dumps(openapi_document(request.app, config)))
        return web.Response(body=cached[0], content_type=JSON)

    return handler
