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
