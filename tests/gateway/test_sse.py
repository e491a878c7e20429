"""The SSE relay: byte-identical pass-through, usage read, usage chunk stripped on demand."""

from __future__ import annotations

import orjson
import pytest

from prefixrouter.gateway.sse import SseRelay, completion_tokens, usage_figures

USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 2,
    "prompt_tokens_details": {"cached_tokens": 32},
}


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


CONTENT = [
    _event({"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}}]}),
    _event({"id": "c", "choices": [{"index": 0, "delta": {"content": '"usage" in text'}}]}),
    _event({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
]
USAGE_EVENT = _event({"id": "c", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"
STREAM = b"".join([*CONTENT, USAGE_EVENT, DONE])


def _relay(data: bytes, strip: bool, size: int) -> tuple[bytes, SseRelay]:
    r = SseRelay(strip_usage=strip)
    out = b"".join(r.feed(data[i : i + size]) for i in range(0, len(data), size))
    return out + r.finish(), r


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_pass_through_is_byte_identical(size: int) -> None:
    out, r = _relay(STREAM, strip=False, size=size)
    assert out == STREAM
    assert usage_figures(r.usage) == (40, 32)


@pytest.mark.parametrize("size", [1, 5, 33, 10_000])
def test_usage_chunk_is_stripped_and_read(size: int) -> None:
    out, r = _relay(STREAM, strip=True, size=size)
    assert out == b"".join([*CONTENT, DONE])
    assert usage_figures(r.usage) == (40, 32)


def test_unterminated_last_event_is_kept_or_stripped() -> None:
    out, r = _relay(b"".join(CONTENT) + USAGE_EVENT[:-2], strip=True, size=9)
    assert out == b"".join(CONTENT) and r.usage == USAGE
    out, _ = _relay(b"".join(CONTENT) + b"data: tail", strip=True, size=9)
    assert out == b"".join(CONTENT) + b"data: tail"


def test_usage_figures_when_not_reported() -> None:
    assert usage_figures(None) == (None, None)
    assert usage_figures({"prompt_tokens": 3}) == (3, None)
    assert usage_figures({"prompt_tokens": 3, "prompt_tokens_details": None}) == (3, None)


@pytest.mark.parametrize("bad", [-15, True, False, 1.5, "3", None])
def test_usage_figures_that_are_not_counts_are_not_reported(bad: object) -> None:
    # An engine's usage is untrusted: a negative or bool figure must not reach the counters.
    usage = {"prompt_tokens": bad, "prompt_tokens_details": {"cached_tokens": bad}}
    assert usage_figures(usage) == (None, None)
    assert completion_tokens({"completion_tokens": bad}) == 0
    assert usage_figures({"prompt_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}) == (
        0,
        0,
    )
