"""Wire-format helpers: validation messages and response shapes, no server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prefixrouter.simulated_engine.protocol import (
    ApiError,
    ChunkWriter,
    check_model,
    completion_prompt,
    length_error,
    parse_json_object,
    parse_options,
)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, None),  # only with stream=True
        ({"cache_salt": ""}, None),
    ],
)
def test_bad_options_are_400(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_options(body, "chat")
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # Types of vLLM's request model (pydantic's words), then SamplingParams' ranges (vLLM's).
        ("temperature", "hot", "temperature: Input should be a valid number, got 'hot'."),
        ("temperature", True, "temperature: Input should be a valid number, got True."),
        ("temperature", -0.5, "temperature must be non-negative, got -0.5."),
        ("temperature", 5, "temperature must be in [0, 2], got 5.0."),
        ("top_p", 2, "top_p must be in (0, 1], got 2.0."),
        ("top_p", 0, "top_p must be in (0, 1], got 0.0."),
        ("top_k", 1.5, "top_k: Input should be a valid integer, got 1.5."),
        ("top_k", -2, "top_k must be 0 (disable), or at least 1, got -2."),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5."),
        ("presence_penalty", 3, "presence_penalty must be in [-2, 2], got 3.0."),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3.0."),
        ("repetition_penalty", 0, "repetition_penalty must be greater than zero, got 0.0."),
        ("seed", 2**63, f"seed must be a signed 64-bit integer, got {2**63}."),
        ("n", "x", "n: Input should be a valid integer, got 'x'."),
        ("n", 0, "n must be at least 1, got 0."),
        ("n", 2, "Only n=1 is supported by this engine."),
        ("stream", "yes", "stream: Input should be a valid boolean, got 'yes'."),
        ("user", 5, "user: Input should be a valid string, got 5."),
    ],
)
def test_fields_are_validated_as_vllm_does(field: str, value: Any, message: str) -> None:
    for kind in ("chat", "completion"):
        with pytest.raises(ApiError) as info:
            parse_options({field: value}, kind)
        err = info.value
        assert (err.status, err.param, err.message) == (400, field, message)
        assert json.loads(err.body())["error"] == {
            "message": message,
            "type": "BadRequestError",
            "param": field,
            "code": 400,
        }


def test_null_is_the_default_and_edges_are_accepted() -> None:
    # OpenAI's API and vLLM take null for "not given": stream null is a plain answer.
    fields = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "stream", "user"]
    nulls = dict.fromkeys([*fields, "stream_options", "max_tokens", "cache_salt"])
    o = parse_options(nulls, "chat")
    assert (o.stream, o.include_usage, o.max_tokens) == (False, False, None)
    edges = {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0, "presence_penalty": -2}
    edges |= {"frequency_penalty": 2.0, "repetition_penalty": 1.2, "seed": -(2**63), "n": 1}
    assert parse_options({**edges, "temperature": 2.0, "user": "u1"}, "completion").stream is False


def test_options() -> None:
    body = {"max_tokens": 5, "max_completion_tokens": 7, "stream": True, "cache_salt": "s"}
    o = parse_options({**body, "stream_options": {"include_usage": True}}, "chat")
    assert (o.max_tokens, o.stream, o.include_usage, o.cache_salt) == (7, True, True, "s")
    assert parse_options({"max_completion_tokens": 7}, "completion").max_tokens is None


def test_prompt_forms() -> None:
    assert completion_prompt({"prompt": "hi"}) == "hi"
    assert completion_prompt({"prompt": [1, 2]}) == [1, 2]
    assert completion_prompt({"prompt": ["hi"]}) == "hi"
    assert completion_prompt({"prompt": [[3]]}) == [3]
    for bad in ({}, {"prompt": ["a", "b"]}, {"prompt": 5}, {"prompt": [-1]}):
        with pytest.raises(ApiError):
            completion_prompt(bad)


def test_errors_are_openai_shaped() -> None:
    with pytest.raises(ApiError) as info:
        parse_json_object(b"{oops")
    assert info.value.status == 400
    with pytest.raises(ApiError) as info:
        parse_json_object(b"[1]")
    with pytest.raises(ApiError) as info:
        check_model({"model": "other"}, "tiny")
    err = json.loads(info.value.body())["error"]
    assert err == {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert check_model({}, "tiny") == check_model({"model": "tiny"}, "tiny") == "tiny"


def test_length_errors_follow_vllm() -> None:
    assert length_error(100, 16, 4096) is None
    e = length_error(5000, 16, 4096)
    assert e is not None and "maximum context length is 4096 tokens" in e.message
    assert "5000 input tokens" in e.message
    e = length_error(4000, 200, 4096)
    assert e is not None and "(200 > 4096 - 4000)" in e.message
    e = length_error(5000, 16, 4096, "Use --kv-blocks.")
    assert e is not None and e.message.endswith("input messages. Use --kv-blocks.")
    e = length_error(0, 1, 4096)
    assert e is not None and e.param == "prompt"


def test_chunks_are_sse_frames() -> None:
    w = ChunkWriter("chat", "id1", 1, "tiny")
    frame = w.token("x", last=True)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    choice = json.loads(frame[6:])["choices"][0]
    assert choice["delta"] == {"content": "x"} and choice["finish_reason"] == "length"
    assert json.loads(w.role()[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(w.usage({"a": 1})[6:])["choices"] == []
    c = ChunkWriter("completion", "id2", 1, "tiny")
    assert json.loads(c.token("y", last=False)[6:])["choices"][0]["text"] == "y"
