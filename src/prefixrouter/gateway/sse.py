"""SSE relay: pass a stream through, read its usage, drop what the client did not ask for.

The gateway always asks a streaming engine for the usage chunk
(``stream_options.include_usage``), because the final chunk's
``usage.prompt_tokens_details.cached_tokens`` is the only place a stream
reports its prefix-cache reuse. If the client did not ask for it, that chunk
(``"choices": []`` with a ``usage`` object) is removed, so the client receives
the same events a direct call would have produced.

Bytes are forwarded per *complete event* (events end with a blank line): a
partial event stays buffered until its end arrives, which costs one
``rfind`` per upstream chunk and keeps events byte-identical. Only a span of
events that contains ``"usage"`` is split and parsed.

:attr:`SseRelay.done` records whether ``data: [DONE]`` went through: an
engine's stream that ends without it was cut short (an engine that crashed
while writing, or closed its response early), and the gateway must end it
with an error event rather than let it pass for a complete answer.
Both front ends read usage here: the HTTP proxy and the endpoint picker
(:mod:`prefixrouter.epp`, which sees the response bodies Envoy streams to it),
a stream through :class:`SseRelay`, a whole answer through :func:`json_usage`.
"""

from __future__ import annotations

from typing import Any

import orjson

_SEP = b"\n\n"
_USAGE = b'"usage"'
_DONE = b"data: [DONE]"
_DONE_EVENT = _DONE + _SEP


class SseRelay:
    """Incremental relay of one event stream.

    Attributes:
        strip_usage: Drop the usage-only chunk (the client did not ask for it).
        usage: The last non-null ``usage`` object seen, if any.
        done: The stream's ``data: [DONE]`` event has been relayed.
    """

    __slots__ = ("_buf", "done", "strip_usage", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Take an upstream chunk; return the bytes to send to the client now."""
        if self._buf:
            chunk = self._buf + chunk
        end = chunk.rfind(_SEP)
        if end < 0:
            self._buf = chunk
            return b""
        end += 2
        self._buf = chunk[end:]
        ready = chunk[:end]
        if _USAGE in ready:
            ready = self._events(ready)
        if ready.endswith(_DONE_EVENT):
            self.done = True
        return ready

    def finish(self) -> bytes:
        """The upstream ended: whatever is left (an unterminated last event)."""
        rest, self._buf = self._buf, b""
        # At most one event is left (it holds no blank line): keep it verbatim
        # unless it is the usage chunk to strip.
        if rest and _USAGE in rest and self._is_usage_only(rest.rstrip(b"\n")):
            return b""
        if rest.rstrip(b"\n") == _DONE:
            self.done = True
        return rest

    def _events(self, span: bytes) -> bytes:
        kept: list[bytes] = []
        for event in span.split(_SEP):
            if not event:
                continue
            if _USAGE in event and self._is_usage_only(event):
                continue
            kept.append(event + _SEP)
        return b"".join(kept)

    def _is_usage_only(self, event: bytes) -> bool:
        """Record the event's usage; True if it is the usage chunk to strip."""
        data = b"".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            return self.strip_usage and not obj.get("choices")
        return False


def json_usage(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole (non-streamed) JSON answer, if it has one."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return answer_usage(data)


def answer_usage(data: Any) -> dict[str, Any] | None:
    """The ``usage`` object of a parsed JSON answer, if it has one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    return usage if isinstance(usage, dict) else None


def token_count(value: Any) -> int | None:
    """``value`` if it is a count of tokens (an integer >= 0), else None.

    An engine's usage is untrusted input: a negative figure, a bool (an
    ``int`` to Python: ``True`` would count as 1) or a float counted as a
    token figure would make the Prometheus counters fed from it go down,
    which ``rate()`` reads as a reset. Such a figure is treated as not reported.
    """
    return value if type(value) is int and value >= 0 else None


def completion_tokens(usage: dict[str, Any] | None) -> int:
    """``usage.completion_tokens`` (0: not reported, or not a count): what the answer decoded."""
    return (token_count(usage.get("completion_tokens")) or 0) if usage else 0


def usage_figures(usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI usage object.

    None for a figure not reported or not a count (:func:`token_count`).
    """
    if not usage:
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return token_count(usage.get("prompt_tokens")), token_count(cached)
