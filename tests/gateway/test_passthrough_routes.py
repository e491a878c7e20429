"""Engine endpoints relayed without routing (embeddings, tokenize, score, rerank), the
refused Responses API, and the 413 that names its setting."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tests.gateway.fakes import FakeEngine, make_app
from tests.gateway.helpers import gateway_env, run


def _engine_app(engine: FakeEngine, seen: list[tuple[str, dict[str, Any], str]]) -> web.Application:
    """A fake engine that also serves the pooling and tokenizer endpoints.

    ``seen`` gets (path, body, X-Request-Id) per call. It answers 503 (a
    refusal) while ``engine.status`` is 503, and 404 for a model it does not serve.
    """
    app = make_app(engine)

    async def other(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        seen.append((request.path, body, request.headers.get("X-Request-Id", "")))
        if engine.status != 200:
            err = {"error": {"message": "busy", "type": "x", "param": None, "code": 503}}
            return web.json_response(err, status=engine.status, headers={"Retry-After": "7"})
        model = body.get("model")
        if model is not None and model != engine.model:
            err = {
                "error": {
                    "message": f"The model `{model}` does not exist.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            }
            return web.json_response(err, status=404)
        if request.path == "/tokenize":
            return web.json_response({"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096})
        return web.json_response(
            {"object": "list", "data": [{"embedding": [0.5]}], "engine": id(engine)},
            headers={"X-Engine": "yes"},
        )

    for path in ("/v1/embeddings", "/tokenize", "/detokenize", "/v1/score", "/rerank"):
        app.router.add_post(path, other)
    return app


def test_embeddings_and_tokenize_are_relayed() -> None:
    async def main() -> None:
        seen: list[tuple[str, dict[str, Any], str]] = []
        engines = [FakeEngine(), FakeEngine(model="other")]
        async with gateway_env(apps=[_engine_app(e, seen) for e in engines]) as env:
            body = {"model": "tiny", "input": ["a", "b"], "encoding_format": "float"}
            r = await env.client.post(
                "/v1/embeddings", json=body, headers={"X-Request-Id": "emb-1"}
            )
            assert r.status == 200, await r.text()
            assert (await r.json())["data"] == [{"embedding": [0.5]}]
            assert r.headers["X-Request-Id"] == "emb-1"
            assert r.headers["X-Prefixrouter-Worker"] == "w0"  # the one serving tiny
            assert seen[-1] == ("/v1/embeddings", body, "emb-1")
            # No model: any worker will do.
            r = await env.client.post("/tokenize", json={"prompt": "hello"})
            assert r.status == 200 and (await r.json())["count"] == 3
            assert seen[-1][2] == r.headers["X-Request-Id"]  # the gateway's id
            for path in ("/detokenize", "/v1/score", "/rerank"):
                r = await env.client.post(path, json={"model": "other"})
                assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w1"
            # Not hashed or routed: no decision record, but counted.
            assert await env.decisions() == []
            metrics = await (await env.client.get("/metrics")).text()
            assert 'decision="passthrough"' in metrics

    run(main)


def test_bad_requests_get_openai_errors() -> None:
    async def main() -> None:
        seen: list[tuple[str, dict[str, Any], str]] = []
        async with gateway_env(apps=[_engine_app(FakeEngine(), seen)]) as env:
            r = await env.client.post("/v1/embeddings", json={"model": "nope", "input": "a"})
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
            r = await env.client.post("/v1/embeddings", data=b"{not json")
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
            r = await env.client.post("/v1/embeddings", json={"model": 3})
            assert r.status == 400 and (await r.json())["error"]["param"] == "model"
            r = await env.client.get("/v1/embeddings")
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert seen == []  # none of these reached an engine

    run(main)


def test_a_refusal_is_retried_on_another_worker() -> None:
    async def main() -> None:
        seen: list[tuple[str, dict[str, Any], str]] = []
        engines = [FakeEngine(status=503), FakeEngine()]
        async with gateway_env(apps=[_engine_app(e, seen) for e in engines]) as env:
            r = await env.client.post(
                "/v1/embeddings", json={"model": "tiny", "input": "a"},
                headers={"X-Request-Id": "same"},
            )  # fmt: skip
            assert r.status == 200 and r.headers["X-Prefixrouter-Worker"] == "w1"
            assert [s[2] for s in seen] == ["same", "same"]  # w0 refused, w1 answered
            engines[1].status = 503
            r = await env.client.post("/v1/embeddings", json={"model": "tiny", "input": "a"})
            # Every worker refused: the last refusal's own answer, headers kept.
            assert r.status == 503 and r.headers["Retry-After"] == "7"
            assert (await r.json())["error"]["message"] == "busy"

    run(main)


def test_the_api_key_rules_apply() -> None:
    async def main() -> None:
        seen: list[tuple[str, dict[str, Any], str]] = []
        overrides = {"api_keys": {"k-alice": "alice"}, "require_api_key": True}
        app = _engine_app(FakeEngine(), seen)
        async with gateway_env(apps=[app], overrides=overrides) as env:
            body = {"model": "tiny", "input": "a"}
            r = await env.client.post("/v1/embeddings", json=body)
            assert r.status == 401
            r = await env.client.post(
                "/v1/embeddings", json=body, headers={"Authorization": "Bearer wrong"}
            )
            assert r.status == 401
            assert seen == []
            r = await env.client.post(
                "/v1/embeddings", json=body, headers={"Authorization": "Bearer k-alice"}
            )
            assert r.status == 200
            assert len(seen) == 1

    run(main)


def test_the_responses_api_is_refused_with_the_reason() -> None:
    async def main() -> None:
        async with gateway_env(n=1) as env:
            for method, path in (
                ("POST", "/v1/responses"),
                ("GET", "/v1/responses/resp_123"),
                ("POST", "/v1/responses/resp_123/cancel"),
            ):
                r = await env.client.request(method, path, json={"model": "tiny"})
                assert r.status == 404
                err = (await r.json())["error"]
                assert err["code"] == "unsupported_endpoint"
                assert "previous_response_id" in err["message"]
                assert "one engine directly" in err["message"]

    run(main)


def test_413_names_the_setting_and_the_limit() -> None:
    async def main() -> None:
        overrides = {"server": {"max_body_bytes": 4096}}
        seen: list[tuple[str, dict[str, Any], str]] = []
        async with gateway_env(apps=[_engine_app(FakeEngine(), seen)], overrides=overrides) as env:
            big = {"model": "tiny", "input": "x" * 5000}
            for path in ("/v1/embeddings", "/v1/chat/completions"):
                r = await env.client.post(path, json=big)
                assert r.status == 413
                msg = (await r.json())["error"]["message"]
                assert "server.max_body_bytes" in msg and "4096" in msg

    run(main)
