r"""SSE relay: pass a stream through, read its usage, drop what the client did not ask for.

The gateway always asks a streaming engine for the usage chunk
(``stream_options.include_usage``), because the final chunk's
``usage.prompt_tokens_details.cached_tokens`` is the only place a stream
reports its prefix-cache reuse. If the client did not ask for it, what that
request added is removed, so the client receives the events a direct call
would have produced:

* the usage chunk itself (``"choices": []`` with a ``usage`` object);
* the ``"usage": null`` member OpenAI-style servers put on every other chunk
  once ``include_usage`` is on. It is removed by a byte rule, no parse:
  ``,"usage":null`` and ``, "usage": null`` (the compact and the Python
  spellings; pydantic, orjson and ``json.dumps`` write nothing else), which
  covers the member wherever it stands but first (no such server puts it
  first). In valid JSON those bytes can only be an object's ``usage`` member
  whose value is null: inside a string the quotes would be escaped. A
  ``null`` and an absent ``usage`` are the same to OpenAI's SDKs; an engine
  that writes ``"usage":null`` even without ``include_usage`` (vLLM's
  ``/v1/completions``, SGLang) loses it too, which no client can tell apart.

**Framing.** An event ends at a blank line, and SSE allows three line ends:
``\n``, ``\r\n`` and ``\r`` (sse-starlette, and so llama-cpp-python's server,
ends events with ``\r\n\r\n``). A blank line is there exactly where the bytes
hold ``\n\n``, ``\n\r`` or ``\r\r``, so finding the last event end of a
chunk costs one ``rfind`` for ``\n\n`` streams (vLLM, SGLang) plus a ``memchr``
for ``\r``, and two more ``rfind`` only where a ``\r`` is present. Bytes are
forwarded per *complete event*, as the engine sent them: a partial event
stays buffered until its end arrives. A chunk that ends on a ``\r`` ending an
event is forwarded at once; a ``\n`` that opens the next chunk completes that
``\r\n`` and follows the event it belongs to (or is dropped with it). Only
a span of events that contains ``"usage"`` with a value other than null is
split into events and parsed.

:attr:`SseRelay.done` records whether the ``[DONE]`` event went through
(``data: [DONE]`` or ``data:[DONE]``, the space being optional in SSE, with
any line end): an engine's stream that ends without it was cut short (an
engine that crashed while writing, or closed its response early), and the
gateway must end it with an error event rather than let it pass for a
complete answer.
Both front ends read usage here: the HTTP proxy and the endpoint picker
(:mod:`prefixrouter.epp`, which sees the response bodies Envoy streams to it),
a stream through :class:`SseRelay`, a whole answer through :func:`json_usage`.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_USAGE = b'"usage"'
# The "usage": null members an OpenAI-style server adds under include_usage,
# with the comma before them (the member is never first): what strip removes.
_NULL_MEMBERS = (b',"usage":null', b', "usage": null')
# The same values without the comma: a span whose every "usage" is one of
# these holds no usage object, and needs no parse.
_NULL_VALUES = (b'"usage":null', b'"usage": null')
_DONE = b"[DONE]"
# Two line ends in a row (a CRLF is one line end, so a CR followed by LF is not two).
_BLANK_LINE = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r(?!\n))")
_LINE_ENDS = b"\r\n"


def _cr_event_end(data: bytes, end: int) -> int:
    """Where the last event of ``data`` ends, given where its last ``\\n\\n`` blank line ends.

    For data holding a CR: its ``\\n\\r`` and ``\\r\\r`` blank lines count too
    (a CR followed by an LF is one CRLF line end, taken whole).
    """
    for blank in (b"\n\r", b"\r\r"):
        at = data.rfind(blank)
        if at >= 0:
            at += 2
            if data.startswith(b"\n", at):  # the blank line is a CRLF
                at += 1
            if at > end:
                end = at
    return end


def _ends_with_done(span: bytes) -> bool:
    """Whether the last line of ``span`` is the ``[DONE]`` data line (any line end after it)."""
    at = span.rfind(_DONE, -20)
    if at < 0 or span[at + 6 :].strip(_LINE_ENDS):
        return False
    if at >= 6 and span.startswith(b"data: ", at - 6):
        start = at - 6
    elif at >= 5 and span.startswith(b"data:", at - 5):
        start = at - 5
    else:
        return False
    return start == 0 or span[start - 1] in _LINE_ENDS


class SseRelay:
    """Incremental relay of one event stream.

    Attributes:
        strip_usage: Drop what ``include_usage`` added (the client did not ask
            for it): the usage-only chunk and the ``"usage": null`` members.
        usage: The last non-null ``usage`` object seen, if any.
        done: The stream's ``[DONE]`` event has been relayed.
    """

    __slots__ = ("_buf", "_dropped_last", "_lf", "done", "strip_usage", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._buf = b""
        # The last forwarded span ended on a CR: an LF opening the next chunk
        # completes that CRLF (b"\n": relay it; b"": its event was dropped).
        self._lf: bytes | None = None
        self._dropped_last = False

    def feed(self, chunk: bytes) -> bytes:
        """Take an upstream chunk; return the bytes to send to the client now."""
        lead = b""
        if self._lf is not None:
            if chunk.startswith(b"\n"):
                lead, chunk = self._lf, chunk[1:]
            self._lf = None
        if self._buf:
            chunk = self._buf + chunk
        end = chunk.rfind(b"\n\n")
        if end >= 0:
            end += 2
        cr = 13 in chunk  # a CR (one memchr): CRLF or bare-CR line ends
        if cr:
            end = _cr_event_end(chunk, end)
        if end < 0:
            self._buf = chunk
            return lead
        self._buf = chunk[end:]
        ready = chunk[:end]  # the chunk itself when it ends with an event (most do)
        dropped = False
        if _USAGE in ready:
            ready = self._usage_span(ready)
            dropped = self._dropped_last
        if cr and chunk[end - 1] == 13:  # ended on a CR: its LF may open the next chunk
            self._lf = b"" if dropped else b"\n"
        # Start -20: the last 20 bytes (the whole span if shorter), as a slice reads it.
        if ready.find(_DONE, -20) >= 0 and _ends_with_done(ready):
            self.done = True
        return lead + ready if lead else ready

    def finish(self) -> bytes:
        """The upstream ended: whatever is left (an unterminated last event)."""
        rest, self._buf = self._buf, b""
        # At most one event is left (it holds no blank line): keep it verbatim
        # unless it is the usage chunk to strip.
        if rest and _USAGE in rest:
            rest = self._usage_span(rest)
        if _ends_with_done(rest):
            self.done = True
        return rest

    def _usage_span(self, span: bytes) -> bytes:
        """Complete events that mention ``"usage"``: read it, strip what the client did not ask."""
        self._dropped_last = False
        if self.strip_usage:
            for member in _NULL_MEMBERS:
                if member in span:
                    span = span.replace(member, b"")
        usages = span.count(_USAGE)
        if usages and usages > span.count(_NULL_VALUES[0]) + span.count(_NULL_VALUES[1]):
            span = self._events(span)  # a usage object: parse the events that hold one
        return span

    def _events(self, span: bytes) -> bytes:
        kept: list[bytes] = []
        start = 0
        dropped = False
        for blank in _BLANK_LINE.finditer(span):
            event = span[start : blank.end()]
            start = blank.end()
            dropped = _USAGE in event and self._is_usage_only(event)
            if not dropped:
                kept.append(event)
        if start < len(span):  # an unterminated last event (the stream's end)
            event = span[start:]
            dropped = _USAGE in event and self._is_usage_only(event)
            if not dropped:
                kept.append(event)
        self._dropped_last = dropped
        return b"".join(kept)

    def _is_usage_only(self, event: bytes) -> bool:
        """Record the event's usage; True if it is the usage chunk to strip."""
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")
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
