"""Streaming reader of request logs: OpenAI request bodies or decision-log records.

One JSON object per line (gzip files, known by their magic bytes whatever
their name, are decompressed on the fly); the file is read line by line, so
memory does not grow with its length. A line is one of:

* a request body: an object with ``messages`` (chat) or a string ``prompt``
  (completions);
* a wrapper or gateway decision-log record holding the body under
  ``request``, ``body`` or ``request_body``, with optional ``prefix_class``,
  ``namespace``, ``headers`` (``X-Prefix-Class``), ``prompt_tokens`` and
  ``usage`` (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``);
* a gateway decision-log record without a body
  (:mod:`prefixrouter.gateway.decision_log`): its ``prefix_key`` (the id of
  the prompt's first ``prefix_key_tokens`` tokens), ``prompt_tokens`` (or
  ``estimated_prompt_tokens``), ``actual_cached_tokens`` and
  ``prefix_class`` are kept; the analysis then works on prefix keys.

A wrapper or decision record's HTTP ``status`` is kept too: a request the
engines (or the gateway) refused, a 400 for a prompt too long, say, was
never served, and the analysis leaves it out (:attr:`LogRecord.served`).

A line that is none of these (invalid JSON, not an object, a ``messages``
that is not a list of objects, a body-less record without a prompt length, a
record whose cached tokens outnumber its prompt's) is
reported through ``on_error(line, reason)`` and skipped (:class:`SkippedLines`
is such a handler: it keeps the count and the first reason, for the message
when no line was usable); blank lines are skipped silently. Nothing here
raises on bad input except for I/O errors and a damaged gzip file
(:class:`gzip.BadGzipFile`, an :class:`OSError`).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import orjson

from prefixrouter.core.types import CacheNamespace, PrefixClass
from prefixrouter.errors import GZIP_MAGIC
from prefixrouter.prompt.classify import PREFIX_CLASS_HEADER, parse_prefix_class

BODY_KEYS = ("request", "body", "request_body")
CLIENT_GONE = 499
"""The gateway's status for a request whose client went away."""

ErrorHandler = Callable[[int, str], None]


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One request read from a log.

    Attributes:
        line: 1-based line number in the file.
        body: The OpenAI request body.
        prefix_class: The class the log states (record field, header or body
            metadata); None when it must be inferred.
        namespace: Cache namespace key: the record's ``namespace``, else the
            model's (``CacheNamespace(model).key``).
        prompt_tokens: Prompt tokens the engine reported (or the router
            estimated, for a body-less decision record), if logged.
        cached_tokens: Cached prompt tokens the engine reported, if logged.
        prefix_key: For a decision record without a body (``body`` is then
            empty): the id of the prompt's leading prefix.
        status: The HTTP status the record states (a wrapper's or decision
            record's ``status``); None when it states none.
    """

    line: int
    body: Mapping[str, Any]
    prefix_class: PrefixClass | None = None
    namespace: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prefix_key: str | None = None
    status: int | None = None

    @property
    def served(self) -> bool:
        """Whether an engine served it, as far as its status tells.

        No status stated, a success, or 499 (the client left: the engine had
        the prompt, and usually prefilled it before the client went) count as
        served; an error status (the engine's 400 for a prompt too long, the
        gateway's 429 or 502) is a request no engine prefilled.
        """
        return self.status is None or self.status < 400 or self.status == CLIENT_GONE


@dataclass(slots=True)
class SkippedLines:
    """A tally of the lines (or array items) skipped as malformed; an ``on_error`` handler.

    It keeps how many, and the first one's number and reason: a file none of
    whose lines is usable is an error, and its message says why.

    Attributes:
        count: Lines skipped so far.
        first: (line, reason) of the first one; None while none was skipped.
    """

    count: int = 0
    first: tuple[int, str] | None = None

    def __call__(self, line: int, reason: str) -> None:
        if self.first is None:
            self.first = (line, reason)
        self.count += 1

    def none_usable(self, what: str, unit: str = "line") -> str:
        """Why a file gave no ``what``: ``no WHAT in it: N lines skipped; line L: REASON``."""
        if self.first is None:
            return f"no {what} in it: it is empty"
        line, reason = self.first
        units = unit if self.count == 1 else f"{unit}s"
        return (
            f"no {what} in it: {self.count:,} {units} skipped as malformed; "
            f"the first, {unit} {line}: {reason}"
        )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_CACHED_KEYS = ("cached_tokens", "actual_cached_tokens")


def _first(record: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((record[k] for k in keys if record.get(k) is not None), None)


def _check_body(body: Mapping[str, Any]) -> str | None:
    """Why ``body`` is not a usable request body, or None."""
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            return "'messages' is not a list"
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                return f"messages[{i}] is not an object"
        return None
    prompt = body.get("prompt")
    if prompt is None:
        return "no 'messages' or 'prompt'"
    if not isinstance(prompt, str):
        return "'prompt' is not a string (token-id and batched prompts are not supported)"
    return None


def parse_record(obj: Any, line: int = 0) -> LogRecord | str:
    """A decoded JSON line as a :class:`LogRecord`, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    record: Mapping[str, Any] = obj
    body: Any = obj
    if "messages" not in obj and "prompt" not in obj:
        body = next((obj[k] for k in BODY_KEYS if isinstance(obj.get(k), dict)), None)
        if body is None:
            if isinstance(obj.get("prefix_key"), str) and obj["prefix_key"]:
                return _key_record(obj, line)
            return "no 'messages' or 'prompt'"
    why = _check_body(body)
    if why is not None:
        return why
    cls = parse_prefix_class(record.get("prefix_class"))
    headers = record.get("headers")
    if cls is None and isinstance(headers, Mapping):
        wanted = PREFIX_CLASS_HEADER.lower()
        cls = next(
            (parse_prefix_class(v) for k, v in headers.items() if str(k).lower() == wanted),
            None,
        )
    meta = body.get("metadata")
    if cls is None and isinstance(meta, Mapping):
        cls = parse_prefix_class(meta.get("prefix_class"))
    if cls is PrefixClass.UNKNOWN:
        cls = None  # "unknown" in a log means nobody knew: infer it
    namespace = record.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        namespace = CacheNamespace(str(body.get("model", ""))).key
    usage = record.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, Mapping) else {}
    prompt_tokens = _int(usage.get("prompt_tokens", record.get("prompt_tokens")))
    cached_tokens = _int(details.get("cached_tokens", _first(record, _CACHED_KEYS)))
    if (why := _cached_problem(cached_tokens, prompt_tokens)) is not None:
        return why
    return LogRecord(
        line=line,
        body=body,
        prefix_class=cls,
        namespace=namespace,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        # A bare body's fields are the request's own: only a record states a status.
        status=_int(record.get("status")) if body is not record else None,
    )


def _cached_problem(
    cached: int | None, prompt: int | None, prompt_field: str = "prompt_tokens"
) -> str | None:
    """Why a record's cached and prompt token counts contradict each other, or None.

    An engine reuses part of the prompt, never more: a record that says
    otherwise has one of its counts wrong, and which one cannot be told, so
    the record is skipped rather than clamped (its cached share would read
    above 100%).
    """
    if cached is not None and prompt is not None and cached > prompt:
        return f"cached_tokens {cached:,} > {prompt_field} {prompt:,}"
    return None


def _key_record(obj: Mapping[str, Any], line: int) -> LogRecord | str:
    """A body-less decision record: its prefix key and token counts."""
    reported = _int(obj.get("prompt_tokens"))
    field = "prompt_tokens" if reported else "estimated_prompt_tokens"
    tokens = reported or _int(obj.get("estimated_prompt_tokens"))
    if not tokens:
        return "decision record without a body or a prompt length"
    cached = _int(obj.get("actual_cached_tokens"))
    if (why := _cached_problem(cached, tokens, field)) is not None:
        return why
    cls = parse_prefix_class(obj.get("prefix_class"))
    namespace = obj.get("namespace")
    return LogRecord(
        line=line,
        body={},
        prefix_class=None if cls is PrefixClass.UNKNOWN else cls,
        namespace=namespace if isinstance(namespace, str) else str(obj.get("model", "")),
        prompt_tokens=tokens,
        cached_tokens=cached,
        prefix_key=str(obj["prefix_key"]),
        status=_int(obj.get("status")),
    )


def _open(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed as they are read if it is gzip (known by its
    first bytes, :data:`~prefixrouter.errors.GZIP_MAGIC`, not its name): a log is
    streamed, never held whole."""
    with path.open("rb") as fh:
        head = fh.read(len(GZIP_MAGIC))
    # Opened again by name: a GzipFile over an open file would not close that file.
    return cast(IO[bytes], gzip.open(path, "rb")) if head == GZIP_MAGIC else path.open("rb")


def iter_records(path: Path, on_error: ErrorHandler | None = None) -> Iterator[LogRecord]:
    """Stream the usable records of a JSON-lines log.

    Args:
        path: The log (gzip is decompressed).
        on_error: Called with (line number, reason) for each line skipped as malformed.

    Yields:
        One :class:`LogRecord` per usable line, in file order.

    Raises:
        OSError: The file cannot be opened or read (:class:`gzip.BadGzipFile`:
            a gzip file that is truncated or damaged).
    """
    try:
        with _open(path) as fh:
            yield from records_of_lines(fh, on_error)
    except (EOFError, zlib.error) as exc:  # gzip's own errors for a cut or corrupt stream
        raise gzip.BadGzipFile(f"not a valid gzip file: {exc}") from exc


def records_of_lines(
    lines: Iterable[bytes], on_error: ErrorHandler | None = None
) -> Iterator[LogRecord]:
    """The usable records of JSON lines already read (and decompressed), as
    :func:`iter_records` yields them from a file: lines are numbered from 1, a
    blank one is skipped silently, a malformed one goes to ``on_error``.

    A caller holding the file's bytes passes ``io.BytesIO(data)``, which splits
    lines as a file does (on ``\\n`` only).
    """
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if on_error is not None:
                on_error(number, f"invalid JSON: {exc}")
            continue
        rec = parse_record(obj, number)
        if isinstance(rec, str):
            if on_error is not None:
                on_error(number, rec)
            continue
        yield rec


def format_error(path: Path | str, line: int, reason: str) -> str:
    """``FILE:LINE: reason``, the way compilers report."""
    return f"{path}:{line}: {reason}"
