"""The engine server over real HTTP: OpenAI responses, SSE, caching, metrics, errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

from aiohttp import ClientResponse

from prefixrouter.tokenization import load_tokenizer, render_chat
from tests.simulated_engine.conftest import long_text, served

BLOCK = 16  # tiny-cpu


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


async def _sse(resp: ClientResponse) -> tuple[list[dict[str, Any]], bytes]:
    raw = await resp.read()
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]", raw[-200:]
    assert all(f.startswith(b"data: ") for f in frames[:-1])
    return [json.loads(f[6:]) for f in frames[:-2]], raw


async def _first_chunk_time(client: Any, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # role chunk
        await resp.content.readuntil(b"\n\n")  # first token
        ttft = time.perf_counter() - t0
        chunks, _ = await _sse(resp)
    return ttft, chunks[-1]["usage"]


async def test_chat_and_completion_non_streaming_usage() -> None:
    tok = load_tokenizer()
    async with served(time_scale=20) as (client, _):
        body = _chat("Tell me a story.", max_tokens=5)
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        data = await resp.json()
        assert data["object"] == "chat.completion" and data["model"] == "tiny"
        prompt = len(tok.encode(render_chat(body["messages"])))
        assert data["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": 5,
            "total_tokens": prompt + 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        choice = data["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
        assert choice["message"]["content"]

        resp = await client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 3})
        data = await resp.json()
        assert data["object"] == "text_completion"
        assert data["usage"]["prompt_tokens"] == len(tok.encode("Once upon"))
        assert data["usage"]["completion_tokens"] == 3
        # Token-id prompts and the default output length (16).
        resp = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True})
        data = await resp.json()
        assert data["usage"]["prompt_tokens"] == 3 and data["usage"]["completion_tokens"] == 16


async def test_streaming_framing_and_usage_only_when_asked() -> None:
    async with served(time_scale=20) as (client, server):
        body = _chat("hello", max_tokens=4, stream=True)
        async with client.post("/v1/chat/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            chunks, _ = await _sse(resp)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
        assert len(tokens) == 4 and all("usage" not in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None] * 3 + ["length"]
        assert len({c["id"] for c in chunks}) == 1

        body["stream_options"] = {"include_usage": True}
        async with client.post("/v1/chat/completions", json=body) as resp:
            chunks, _ = await _sse(resp)
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
        assert all("usage" not in c for c in chunks[:-1])

        comp = {"prompt": "abc", "max_tokens": 3, "stream": True}
        comp["stream_options"] = {"include_usage": True}
        async with client.post("/v1/completions", json=comp) as resp:
            chunks, _ = await _sse(resp)
        assert [c["object"] for c in chunks] == ["text_completion"] * 4
        assert "".join(c["choices"][0]["text"] for c in chunks[:3])
        assert chunks[-1]["usage"]["total_tokens"] == chunks[-1]["usage"]["prompt_tokens"] + 3
        assert server.in_flight == 0 and server.runtime.in_flight == 0


async def test_single_token_stream() -> None:
    async with served(time_scale=20) as (client, _):
        comp = {"prompt": "abc", "max_tokens": 1, "stream": True}
        async with client.post("/v1/completions", json=comp) as resp:
            chunks, _ = await _sse(resp)
        assert len(chunks) == 1 and chunks[0]["choices"][0]["finish_reason"] == "length"


async def test_repeated_long_prompt_is_cached_and_faster() -> None:
    async with served(time_scale=4) as (client, _):
        body = _chat(long_text(600), max_tokens=2, stream=True)
        body["stream_options"] = {"include_usage": True}
        cold_ttft, cold = await _first_chunk_time(client, body)
        warm_ttft, warm = await _first_chunk_time(client, body)
        prompt = cold["prompt_tokens"]
        assert 1500 < prompt < 3500
        assert cold["prompt_tokens_details"]["cached_tokens"] == 0
        cached = warm["prompt_tokens_details"]["cached_tokens"]
        assert cached % BLOCK == 0 and cached == (prompt - 1) // BLOCK * BLOCK
        # The profile prices the cold prefill at ~0.25 s (62 ms at 4x), the warm one at ~3 ms.
        assert cold_ttft > 0.04
        assert warm_ttft < cold_ttft / 2, (cold_ttft, warm_ttft)


async def test_cache_salt_isolates_and_reset_clears() -> None:
    async with served(time_scale=50) as (client, _):

        async def cached(**extra: Any) -> int:
            resp = await client.post("/v1/chat/completions", json=_chat(long_text(200), **extra))
            data = await resp.json()
            return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached() == 0
        assert await cached() > 0
        assert await cached(cache_salt="tenant-a") == 0  # same prompt, other salt
        assert await cached(cache_salt="tenant-a") > 0
        assert await cached(cache_salt="tenant-b") == 0
        resp = await client.post("/reset_prefix_cache")
        assert resp.status == 200
        assert await cached() == 0
        assert await cached(cache_salt="tenant-a") == 0


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_use_vllm_names_and_count_hits() -> None:
    async with served(time_scale=50, engine_id="3") as (client, _):
        body = _chat(long_text(300), max_tokens=3)
        first = await (await client.post("/v1/chat/completions", json=body)).json()
        second = await (await client.post("/v1/chat/completions", json=body)).json()
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        m = _samples(await resp.text())
    lab = '{engine="3",model_name="tiny"}'
    prompt = first["usage"]["prompt_tokens"]
    hits = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hits > 0
    assert m[f"vllm:prefix_cache_queries_total{lab}"] == 2 * prompt
    assert m[f"vllm:prefix_cache_hits_total{lab}"] == hits
    assert m[f"vllm:prompt_tokens_total{lab}"] == 2 * prompt
    assert m[f"vllm:generation_tokens_total{lab}"] == 6
    assert m[f"vllm:num_requests_running{lab}"] == 0
    assert m[f"vllm:num_requests_waiting{lab}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{lab}"] == 0.0  # nothing running; cached blocks are free
    assert m[f"vllm:time_to_first_token_seconds_count{lab}"] == 2
    success = '{engine="3",finished_reason="length",model_name="tiny"}'
    assert m[f"vllm:request_success_total{success}"] == 2
    info = next(k for k in m if k.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="256"' in info


async def test_gauges_while_requests_run() -> None:
    async with served(time_scale=1) as (client, _):
        body = {"prompt": long_text(400), "max_tokens": 200}
        tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
        await asyncio.sleep(0.15)
        m = _samples(await (await client.get("/metrics")).text())
        load = await (await client.get("/load")).json()
        for t in tasks:
            t.cancel()
    lab = '{engine="0",model_name="tiny"}'
    assert m[f"vllm:num_requests_running{lab}"] + m[f"vllm:num_requests_waiting{lab}"] == 2
    assert 0 < m[f"vllm:kv_cache_usage_perc{lab}"] <= 1
    assert load == {"server_load": 2}


async def test_tokenize_detokenize_and_render() -> None:
    tok = load_tokenizer()
    async with served() as (client, _):
        resp = await client.post("/tokenize", json={"model": "tiny", "prompt": "hello world"})
        data = await resp.json()
        assert data["tokens"] == tok.encode("hello world")
        assert data["count"] == len(data["tokens"]) and data["max_model_len"] == 4096
        messages = [{"role": "user", "content": "hi"}]
        data = await (await client.post("/tokenize", json={"messages": messages})).json()
        assert data["tokens"] == tok.encode(render_chat(messages))
        resp = await client.post("/detokenize", json={"tokens": data["tokens"]})
        assert (await resp.json())["prompt"] == render_chat(messages)

        rendered = await (
            await client.post("/v1/chat/completions/render", json={"messages": messages})
        ).json()
        assert rendered["token_ids"] == data["tokens"] and rendered["model"] == "tiny"
        rendered = await (
            await client.post("/v1/completions/render", json={"prompt": "hello world"})
        ).json()
        assert isinstance(rendered, list) and rendered[0]["token_ids"] == tok.encode("hello world")


async def test_discovery_endpoints() -> None:
    async with served() as (client, _):
        assert (await client.get("/health")).status == 200
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == 4096
        for path in ("/server_info", "/get_server_info"):
            info = await (await client.get(path)).json()
            assert info["served_model_name"] == "tiny" and info["dp_size"] == 1
            assert info["tp_size"] == 1 and info["page_size"] == BLOCK
        for path in ("/model_info", "/get_model_info"):
            info = await (await client.get(path)).json()
            assert info["is_generation"] is True
        # The reported tokenizer path is a local Hugging Face style folder.
        from pathlib import Path

        assert (Path(info["tokenizer_path"]) / "tokenizer_config.json").is_file()
        assert (await client.get("/load")).status == 200
        assert "version" in await (await client.get("/version")).json()


async def _error(resp: ClientResponse, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return dict(err)


async def test_errors() -> None:
    async with served(max_model_len=1024) as (client, _):
        post = client.post
        err = await _error(await post("/v1/chat/completions", data=b"{bad json"), 400)
        assert "JSON" in err["message"]
        err = await _error(await post("/v1/chat/completions", json={"model": "tiny"}), 400)
        assert "messages" in err["message"] and err["param"] == "messages"
        err = await _error(await post("/v1/completions", json={"max_tokens": 3}), 400)
        assert "prompt" in err["message"]
        err = await _error(
            await post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404
        )
        assert err["message"] == "The model `gpt-9` does not exist."
        err = await _error(await post("/v1/completions", json={"prompt": long_text(2000)}), 400)
        assert "maximum context length is 1024 tokens" in err["message"]
        assert err["message"].endswith("start it with --max-model-len up to 4,096 (its KV cache).")
        body = {"prompt": long_text(100), "max_tokens": 5000}
        err = await _error(await post("/v1/completions", json=body), 400)
        assert "'max_tokens' or 'max_completion_tokens' is too large" in err["message"]
        bad_part = _chat("x")
        bad_part["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "u"}}]
        err = await _error(await post("/v1/chat/completions", json=bad_part), 400)
        assert err["message"].startswith("messages[0].content[0].type")
        err = await _error(await post("/v1/completions", json={"prompt": [999999]}), 400)
        assert "vocabulary" in err["message"]
        await _error(await post("/v1/completions", json={"prompt": ""}), 400)
        await _error(await post("/tokenize", json={}), 400)
        await _error(await post("/v1/completions", json={"prompt": "x", "n": 3}), 400)


async def test_client_disconnect_mid_stream_frees_bookkeeping() -> None:
    async with served(time_scale=1) as (client, server):
        body = _chat("go", max_tokens=500, stream=True)
        resp = await client.post("/v1/chat/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()  # drop the connection
        for _ in range(100):
            if server.in_flight == 0 and server.runtime.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert server.in_flight == 0 and server.runtime.in_flight == 0
        # The server is still fine.
        data = await (
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        ).json()
        assert data["usage"]["completion_tokens"] == 1


async def test_a_date_string_goes_ahead_of_the_prompt_as_llama_templates_write_it() -> None:
    tok = load_tokenizer()
    messages = [{"role": "user", "content": "What is on the agenda today?"}]
    async with served(time_scale=20) as (client, _):
        for date in ("1 Dec 2026", "2 Dec 2026"):
            body = {"messages": messages, "chat_template_kwargs": {"date_string": date}}
            rendered = await (await client.post("/v1/chat/completions/render", json=body)).json()
            expected = f"Today Date: {date}\n\n" + render_chat(messages)
            assert rendered["token_ids"] == tok.encode(expected)
        bad = {"messages": messages, "chat_template_kwargs": {"date_string": 5}}
        resp = await client.post("/v1/chat/completions/render", json=bad)
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "chat_template_kwargs"


async def test_vllm_request_validation_over_http() -> None:
    async with served(time_scale=50) as (client, _):
        # null is the default (OpenAI's API and vLLM): a plain answer, not a stream.
        body = _chat("hi", max_tokens=2, stream=None)
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200 and (await resp.json())["object"] == "chat.completion"
        # A list of bare strings is text parts to vLLM (its content-part union holds str).
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": ["hi"]}]}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
        for path, body in (
            ("/v1/chat/completions", _chat("hi", temperature="hot")),
            ("/v1/completions", {"prompt": "hi", "top_p": 2}),
            ("/v1/chat/completions", _chat("hi", user=5)),
        ):
            resp = await client.post(path, json=body)
            err = (await resp.json())["error"]
            field = next(k for k in body if k not in ("model", "messages", "prompt"))
            assert resp.status == 400 and err["param"] == field and field in err["message"]
            assert (err["type"], err["code"]) == ("BadRequestError", 400)


async def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    """/health answers while a long prompt is tokenized: the tokenizer must release the GIL
    on its thread (a 3.5 MB prompt held the loop for seconds: the gateway's health check
    timed out and took the engine for down)."""
    async with served() as (client, _):
        prompt = long_text(200_000)  # about 1.4 MB: about a second to tokenize
        answered: list[float] = []  # when each /health answer came
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                assert (await client.get("/health")).status == 200
                answered.append(time.perf_counter())
                await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        took = time.perf_counter() - t0
        done.set()
        await poller
        assert resp.status == 400  # longer than max_model_len: refused once tokenized
        # The client shares the server's loop: the longest wait between two answers is
        # the longest the loop was held. Against the request's own time: a slow machine
        # is no failure.
        gap = max(b - a for a, b in itertools.pairwise(answered))
        assert gap < took / 2, (gap, took, len(answered))
