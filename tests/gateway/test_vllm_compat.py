"""What a client moving from vLLM's OpenAI server expects of the gateway, on loopback.

Each test sends a body vLLM serves through a real gateway in front of fake
engines and checks what the gateway did with it: the model of a body that
names none, custom roles, media in token mode, the template fields in the
prefix key, ``stream_options`` as vLLM defaults it, ``max_tokens: 3.0`` and
batched completions prompts.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from prefixrouter.core.types import WorkerId
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import Env, gateway_env, run
from tests.gateway.odd_engines import USAGE, chunk, odd_env

LONG = "The quarterly report covers revenue, costs and the outlook for next year. " * 20
TOKEN_MODE = {"routing": {"mode": "token"}}


def _user(content: Any, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": content}


async def _post(env: Env, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = await env.client.post(path, json=body)
    return r.status, orjson.loads(await r.read())


async def _prefix_keys(env: Env, n: int) -> list[str]:
    """The prefix keys of the last ``n`` decisions, oldest first."""
    return [d["prefix_key"] for d in await env.decisions(n)]


# ---------------------------------------------------------------- 1. no model


async def _echo(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """vLLM with one served model: a body without one is served with it."""
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body.get("model") or "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": USAGE,
    }
    return web.json_response(answer)


def test_a_body_without_model_is_for_the_one_served_model_and_goes_unchanged() -> None:
    async def main() -> None:
        async with odd_env([_echo]) as (env, odds):
            for path, body in (
                ("/v1/chat/completions", {"messages": [_user("hi")], "max_tokens": 3}),
                ("/v1/completions", {"prompt": "hello", "model": None}),
            ):
                status, answer = await _post(env, path, body)
                assert status == 200, answer
                assert odds[0].requests[-1] == body  # forwarded as sent
            logs = await env.decisions(2)
            assert {d["model"] for d in logs} == {"tiny"}  # routed and logged as the served model

    run(main)


def test_a_body_without_model_is_a_400_naming_the_models_when_several_are_served() -> None:
    async def main() -> None:
        engines = [FakeEngine(model="tiny"), FakeEngine(model="big")]
        async with gateway_env(engines=engines) as env:
            await env.state.registry.check(env.state.registry.workers[WorkerId("w0")])
            status, answer = await _post(env, "/v1/chat/completions", {"messages": [_user("hi")]})
            assert status == 400
            err = answer["error"]
            assert (err["param"], err["code"]) == ("model", "missing_field")
            assert "big, tiny" in err["message"] and err["type"] == "invalid_request_error"
            assert not engines[0].requests and not engines[1].requests

    run(main)


# ---------------------------------------------------------------- 2. custom roles


def test_custom_roles_are_forwarded_in_text_and_token_mode() -> None:
    async def main() -> None:
        for overrides in ({}, TOKEN_MODE):
            async with gateway_env(n=1, overrides=overrides) as env:
                messages = [_user("x", "narrator"), _user('{"ok": 1}', "ipython"), _user("hi")]
                r = await env.client.post(
                    "/v1/chat/completions", json={"model": "tiny", "messages": messages}
                )
                assert r.status == 200, await r.text()
                assert env.engines[0].requests[-1]["messages"] == messages
                # An earlier turn of a role outside OpenAI's is history, not instructions.
                assert (await env.decisions(1))[0]["prefix_class"] == "session"
                r = await env.client.post(
                    "/v1/chat/completions", json={"model": "tiny", "messages": [_user("x", "")]}
                )
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "messages[0].role"

    run(main)


# ---------------------------------------------------------------- 3. media in token mode


def test_token_mode_routes_media_on_the_prompt_before_it_and_forwards_the_body() -> None:
    async def main() -> None:
        async with gateway_env(n=2, overrides=TOKEN_MODE) as env:
            system = {"role": "system", "content": LONG}
            keys = []
            for i, part in enumerate(
                (
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                    {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
                )
            ):
                content = [{"type": "text", "text": f"what is this {i}?"}, part]
                body = {"model": "tiny", "messages": [system, _user(content)]}
                r = await env.client.post("/v1/chat/completions", json=body)
                assert r.status == 200, await r.text()
                assert "X-Prefixrouter-Worker" in r.headers
                forwarded = [e.requests[-1] for e in env.engines if e.requests]
                assert body in forwarded
                keys.append((await env.decisions(1))[0])
            # The same system prompt before the media: one prefix, predicted after the first.
            assert len({d["prefix_key"] for d in keys}) == 1
            assert keys[-1]["predicted_cached_tokens"] > 0
            assert len({d["selected_worker"] for d in keys}) == 1
            refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
            r = await env.chat("hi", messages=[system, refusal, _user("why?")])
            assert r.status == 200, await r.text()

    run(main)


# ---------------------------------------------------------------- 4. template fields


TEMPLATE_VARIANTS: list[dict[str, Any]] = [
    {},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template_kwargs": {"enable_thinking": True}},
    {"documents": [{"title": "a", "text": "b"}]},
    {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
    {"add_generation_prompt": False, "continue_final_message": True},
]


def test_template_fields_change_the_prefix_key_in_text_mode() -> None:
    async def main() -> None:
        async with gateway_env(n=1) as env:
            for extra in [*TEMPLATE_VARIANTS, {"add_generation_prompt": True}]:
                r = await env.chat(LONG, **extra)
                assert r.status == 200, await r.text()
                assert env.engines[0].requests[-1].items() >= extra.items()  # forwarded
            keys = await _prefix_keys(env, len(TEMPLATE_VARIANTS) + 1)
            assert len(set(keys[:-1])) == len(TEMPLATE_VARIANTS)  # each its own key
            assert keys[-1] == keys[0]  # a default value is the request without it

    run(main)


def test_template_fields_reach_the_template_in_token_mode() -> None:
    async def main() -> None:
        async with gateway_env(n=1, overrides=TOKEN_MODE) as env:
            tok = env.state.builder.tokenizer
            assert tok is not None
            messages = [
                {"role": "system", "content": LONG},
                _user("Write a haiku."),
                {"role": "assistant", "content": "Sure,"},
            ]
            body = {"model": "tiny", "messages": messages}
            built = env.state.builder.build(
                {**body, "add_generation_prompt": False, "continue_final_message": True},
                b"",
                "chat",
                lambda salt: env.state.tenancy.resolve(None, None, salt),
                None,
            )
            rendered = tok.apply_chat_template(messages)
            assert rendered.endswith("Sure,<|im_end|>\n<|im_start|>assistant\n")
            # vLLM's prompt stops where the final message does: the model continues it.
            cut = rendered[: rendered.rindex("Sure,") + len("Sure,")]
            assert list(built.routing.tokens or []) == tok.encode(cut)
            r = await env.client.post(
                "/v1/chat/completions", json={**body, "continue_final_message": True}
            )
            assert r.status == 400  # with the generation prompt on: vLLM's 400 too
            assert (await r.json())["error"]["param"] == "continue_final_message"
            own = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            r = await env.client.post("/v1/chat/completions", json={**body, "chat_template": own})
            assert r.status == 200, await r.text()
            # A template the request brings is not run by the gateway (vLLM refuses
            # it unless trusted): the model's tokens, in a namespace of its own.
            plain, brought = (
                env.state.builder.build(
                    b, b"", "chat", lambda salt: env.state.tenancy.resolve(None, None, salt), None
                ).routing
                for b in (body, {**body, "chat_template": own})
            )
            assert brought.tokens == plain.tokens
            assert brought.namespace != plain.namespace

    run(main)


# ---------------------------------------------------------------- 5. stream_options


def _usage_stream(usage_by_default: bool) -> Any:
    """An engine that streams two chunks and the usage chunk when asked, or, with
    ``usage_by_default``, also when ``stream_options`` leaves ``include_usage`` out (vLLM)."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        opts = body.get("stream_options")
        inc = opts.get("include_usage") if isinstance(opts, dict) else False
        for text in ("a", "b"):
            await resp.write(b"data: " + orjson.dumps(chunk(text)) + b"\n\n")
        if inc or (inc is None and usage_by_default):
            await resp.write(b"data: " + orjson.dumps(chunk(None, usage=USAGE, choices=False)))
            await resp.write(b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


def test_stream_options_without_include_usage_get_the_engines_usage_as_vllm_does() -> None:
    async def main() -> None:
        async with odd_env([_usage_stream(True)]) as (env, odds):
            base = {"model": "tiny", "messages": [_user("hi")], "stream": True}
            cases: list[tuple[Any, bool]] = [
                ({}, True),
                ({"include_usage": None}, True),
                ({"continuous_usage_stats": True}, True),
                ({"include_usage": True}, True),
                ({"include_usage": False}, False),
                ("absent", False),
            ]
            for opts, client_sees_usage in cases:
                body = dict(base) if opts == "absent" else {**base, "stream_options": opts}
                r = await env.client.post("/v1/chat/completions", json=body)
                text = await r.text()
                assert r.status == 200, text
                assert ('"usage"' in text) == client_sees_usage, (opts, text)
                sent = odds[0].requests[-1]
                if opts in ("absent", {"include_usage": False}):
                    # The gateway asks for the usage and keeps it from the client.
                    assert sent["stream_options"]["include_usage"] is True
                else:
                    assert sent == body  # as the client sent it, continuous_usage_stats too
            logs = await env.decisions(len(cases))
            assert all(d["prompt_tokens"] == USAGE["prompt_tokens"] for d in logs)

    run(main)


def test_an_engine_that_sends_no_usage_by_default_is_asked_and_the_client_gets_none() -> None:
    """SGLang's ``include_usage`` defaults to False: the client gets no usage, as
    from SGLang itself, but the gateway asks for it and learns the reuse."""

    async def main() -> None:
        sglang = [{"kind": "sglang"}]
        async with odd_env([_usage_stream(False)], worker_options=sglang) as (env, odds):
            assert not env.state.registry.workers[WorkerId("w0")].config.usage_by_default
            for opts in ({}, {"include_usage": None}, {"continuous_usage_stats": True}):
                body = {"model": "tiny", "messages": [_user("hi")], "stream": True}
                body["stream_options"] = opts
                r = await env.client.post("/v1/chat/completions", json=body)
                text = await r.text()
                assert r.status == 200, text
                assert '"usage"' not in text, (opts, text)
                sent = odds[0].requests[-1]
                assert sent["stream_options"]["include_usage"] is True
                assert "continuous_usage_stats" not in sent["stream_options"]
            logs = await env.decisions(3)
            assert all(d["prompt_tokens"] == USAGE["prompt_tokens"] for d in logs)

    run(main)


# ---------------------------------------------------------------- 6. max_tokens 3.0


def test_an_integral_float_max_tokens_is_taken_and_a_fraction_is_not() -> None:
    async def main() -> None:
        async with gateway_env(n=1) as env:
            for name in ("max_tokens", "max_completion_tokens"):
                whole: dict[str, Any] = {name: 3.0}
                r = await env.chat("hi", **whole)
                assert r.status == 200, await r.text()
                part: dict[str, Any] = {name: 3.5}
                r = await env.chat("hi", **part)
                assert r.status == 400
                assert (await r.json())["error"]["param"] == name

    run(main)


# ---------------------------------------------------------------- 7. batched completions


def test_a_batched_completions_prompt_routes_on_its_first_prompt_and_counts_all() -> None:
    async def main() -> None:
        for overrides in ({}, TOKEN_MODE):
            async with gateway_env(n=1, overrides=overrides) as env:
                first, other = LONG, "A different question entirely. " * 40
                for prompt in (first, [first, other], [first, other, other]):
                    r = await env.client.post(
                        "/v1/completions", json={"model": "tiny", "prompt": prompt}
                    )
                    assert r.status == 200, await r.text()
                logs = await env.decisions(3)  # oldest first
                assert len({d["prefix_key"] for d in logs}) == 1  # the first prompt's prefix
                single, pair, triple = (d["estimated_prompt_tokens"] for d in logs)
                assert single < pair < triple
            async with gateway_env(n=1, overrides=overrides) as env:
                batches: list[Any] = [[[1] * 64, [2] * 64], [[1] * 64, [3] * 80]]
                for prompt in batches:
                    r = await env.client.post(
                        "/v1/completions", json={"model": "tiny", "prompt": prompt}
                    )
                    assert r.status == 200, await r.text()
                logs = await env.decisions(2)
                assert len({d["prefix_key"] for d in logs}) == 1
                assert [d["estimated_prompt_tokens"] for d in logs] == [128, 144]

    run(main)
