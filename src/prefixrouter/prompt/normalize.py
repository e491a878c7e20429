"""Deterministic prompt normalization: equal meaning, equal bytes, equal cache key.

Two prompts that differ only in line endings, trailing blanks or the key order
of an embedded JSON object hash to different block chains and share no KV
cache. :func:`normalize` removes those differences. It is a pure function of
the text and the :class:`NormalizeRules`: no clock, no locale, no ``hash()``
(whose seed changes per process), so the same input gives the same bytes in
every process and on every machine.

Algorithm, in order:

1. **Verbatim regions** are found on the raw text and copied byte for byte:
   fenced code blocks (a line starting with optional blanks and at least three
   backticks or tildes, up to a line holding at least as many of the same
   character; an unclosed fence runs to the end of the text) and the literal
   ``verbatim_markers`` pairs (open marker through close marker).
2. Every other segment gets, in this order: the Unicode normal form
   (``unicode_form``, NFC by default); line endings ``\\r\\n`` and ``\\r`` to
   ``\\n``; **embedded JSON objects** (every ``{`` that starts a valid JSON
   object) re-serialized on one line with sorted keys and their strings in the
   same Unicode form; then, outside those objects, the whitespace rules:
   trailing blanks of each line removed, runs of two or more blanks (space,
   tab) between non-blank characters collapsed to one space (indentation is
   kept), at most ``max_blank_lines`` consecutive blank lines, and leading and
   trailing blank lines of the whole text removed.

Only space and tab count as blanks: they are the only horizontal whitespace
JSON accepts, so no whitespace rule can turn an invalid JSON object into a
valid one, which is what makes the function idempotent
(``normalize(normalize(t)) == normalize(t)``; property-tested). One caveat:
with ``unicode_form="NFKC"`` full-width backticks become ASCII backticks and
may open a code fence on the next pass; NFC (the default) never does.

The **template-version stamp** ties a normalized prompt to the template and
the rules that produced it: :attr:`Normalizer.version` is
``"<template_version>+<rules fingerprint>"``, meant for
``CacheNamespace.template_version``; :meth:`Normalizer.stamp` also writes it as
the first line of the text (replacing an older stamp), so a template change
can never silently reuse a stale cache.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any, Literal

import xxhash

UnicodeForm = Literal["NFC", "NFKC", "NFD", "NFKD"]

_FENCE_OPEN = re.compile(r"(?:^|(?<=[\r\n]))[ \t]*(`{3,}|~{3,})[^\r\n]*")
_LINE_END = re.compile(r"\r\n?")
_TRAILING = re.compile(r"[ \t]+(?=\n)")
_INTERIOR = re.compile(r"(?<=[^ \t\n])[ \t]{2,}(?=[^ \t\n])")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_STAMP = re.compile(r"\A\[prompt-template [^\]\n]*\]\n")
_JSON = json.JSONDecoder(strict=False)
_AFTER_ESCAPE = re.compile(r"(\\(?:u[0-9a-fA-F]{4}|.))([^\x00-\x7f]+)")


@dataclass(frozen=True, slots=True)
class NormalizeRules:
    """Which normalizations to apply; every rule can be switched off.

    Attributes:
        unicode_form: Unicode normal form of the text outside verbatim regions
            (None: leave code points as they are).
        line_endings: ``\\r\\n`` and lone ``\\r`` become ``\\n``.
        strip_trailing: Remove blanks (space, tab) at the end of each line.
        collapse_spaces: Runs of two or more blanks between non-blank
            characters become one space; indentation is kept.
        max_blank_lines: Keep at most this many consecutive blank lines
            (None: keep them all).
        strip_ends: Remove blank lines and blanks at the start and end of the text.
        sort_json_keys: Re-serialize embedded JSON objects with sorted keys.
        verbatim_fences: Keep fenced code blocks (``` or ~~~) byte for byte.
        verbatim_markers: Literal (open, close) marker pairs whose content,
            markers included, is kept byte for byte. Markers must not start or
            end with whitespace or contain a line break.
    """

    unicode_form: UnicodeForm | None = "NFC"
    line_endings: bool = True
    strip_trailing: bool = True
    collapse_spaces: bool = True
    max_blank_lines: int | None = 1
    strip_ends: bool = True
    sort_json_keys: bool = True
    verbatim_fences: bool = True
    verbatim_markers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_blank_lines is not None and self.max_blank_lines < 0:
            raise ValueError("max_blank_lines must be >= 0 or None")
        for pair in self.verbatim_markers:
            for marker in pair:
                if not marker or marker != marker.strip() or "\n" in marker or "\r" in marker:
                    raise ValueError(f"verbatim marker {marker!r}: empty or blank at an end")

    def fingerprint(self) -> str:
        """A short, process-independent digest of the rules (8 hex digits)."""
        return xxhash.xxh32_hexdigest(repr(astuple(self)).encode("utf-8"))


DEFAULT_RULES = NormalizeRules()


def _verbatim_spans(text: str, rules: NormalizeRules) -> list[tuple[int, int]]:
    """Sorted, disjoint (start, end) spans of the text to keep byte for byte."""
    spans: list[tuple[int, int]] = []
    pos, n = 0, len(text)
    while pos < n:
        best: tuple[int, int] | None = None
        if rules.verbatim_fences:
            m = _FENCE_OPEN.search(text, pos)
            if m is not None:
                fence = m.group(1)
                close = re.compile(
                    r"(?<=[\r\n])[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}"
                    r"[ \t]*(?=[\r\n]|\Z)"
                )
                c = close.search(text, m.end())
                best = (m.start(), c.end() if c is not None else n)
        for open_, close_ in rules.verbatim_markers:
            i = text.find(open_, pos)
            if i < 0 or (best is not None and i >= best[0]):
                continue
            j = text.find(close_, i + len(open_))
            best = (i, j + len(close_) if j >= 0 else n)
        if best is None:
            break
        spans.append(best)
        pos = max(best[1], best[0] + 1)
    return spans


def _normalize_value(value: Any, form: UnicodeForm | None) -> Any:
    if isinstance(value, str):
        return unicodedata.normalize(form, value) if form else value
    if isinstance(value, dict):
        return {_normalize_value(k, form): _normalize_value(v, form) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize_value(v, form) for v in value]
    return value


def _escape_marks(m: re.Match[str]) -> str:
    marks = m.group(2)
    run = 0
    while run < len(marks) and unicodedata.combining(marks[run]):
        run += 1
    return m.group(1) + json.dumps(marks[:run])[1:-1] + marks[run:]


def canonical_json(value: Any) -> str:
    """One-line JSON with sorted keys and ``", "`` / ``": "`` separators.

    Combining marks right after an escape sequence (``\\n`` then U+0301) are
    escaped too: raw, the Unicode normal form would compose them with the
    escape's ASCII letter and change the string on the next pass.
    """
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))
    return _AFTER_ESCAPE.sub(_escape_marks, text) if "\\" in text else text


def _json_spans(text: str, form: UnicodeForm | None) -> list[tuple[int, int, str]]:
    """(start, end, canonical text) of each embedded JSON object, left to right."""
    out: list[tuple[int, int, str]] = []
    pos = text.find("{")
    while pos >= 0:
        try:
            obj, end = _JSON.raw_decode(text, pos)
        except (ValueError, RecursionError):
            pos = text.find("{", pos + 1)
            continue
        if isinstance(obj, dict):
            canon = canonical_json(_normalize_value(obj, form))
            # A lone surrogate (from a \\ud800 escape) cannot be encoded: leave the object as is.
            if _SURROGATE.search(canon) is None:
                out.append((pos, end, canon))
        pos = text.find("{", end)
    return out


def _whitespace(piece: str, rules: NormalizeRules, *, first: bool, last: bool) -> str:
    """The whitespace rules on one piece of ordinary text.

    ``first`` / ``last``: the piece starts / ends the whole text. A piece that
    does not is bounded by a JSON object or a verbatim region, which count as
    non-blank neighbours for the collapse rule.
    """
    if rules.strip_trailing:
        piece = _TRAILING.sub("", piece)
        if last:
            piece = piece.rstrip(" \t")
    if rules.collapse_spaces:
        padded = ("" if first else "x") + piece + ("" if last else "x")
        padded = _INTERIOR.sub(" ", padded)
        piece = padded[(0 if first else 1) : len(padded) - (0 if last else 1)]
    if rules.max_blank_lines is not None:
        keep = rules.max_blank_lines + 1
        piece = re.sub(f"\n{{{keep + 1},}}", "\n" * keep, piece)
    if rules.strip_ends:
        if first:
            piece = piece.lstrip(" \t\n")
        if last:
            piece = piece.rstrip(" \t\n")
    return piece


def _normalize_segment(seg: str, rules: NormalizeRules, *, first: bool, last: bool) -> str:
    if rules.unicode_form:
        seg = unicodedata.normalize(rules.unicode_form, seg)
    if rules.line_endings:
        seg = _LINE_END.sub("\n", seg)
    spans = _json_spans(seg, rules.unicode_form) if rules.sort_json_keys else []
    parts: list[str] = []
    pos = 0
    for i, (start, end, canon) in enumerate(spans):
        parts.append(_whitespace(seg[pos:start], rules, first=first and i == 0, last=False))
        parts.append(canon)
        pos = end
    parts.append(_whitespace(seg[pos:], rules, first=first and not spans, last=last))
    return "".join(parts)


def normalize(text: str, rules: NormalizeRules = DEFAULT_RULES) -> str:
    """Normalize one prompt text (see the module docstring for the rules).

    Args:
        text: The prompt, a message content or a template.
        rules: Which normalizations to apply.

    Returns:
        The normalized text; ``normalize(normalize(t)) == normalize(t)``, and
        verbatim regions are returned unchanged.
    """
    out: list[str] = []
    pos = 0
    spans = _verbatim_spans(text, rules)
    for start, end in spans:
        out.append(_normalize_segment(text[pos:start], rules, first=pos == 0, last=False))
        out.append(text[start:end])
        pos = end
    if pos < len(text) or not spans:
        out.append(_normalize_segment(text[pos:], rules, first=pos == 0, last=True))
    return "".join(out)


def normalize_content(content: Any, rules: NormalizeRules = DEFAULT_RULES) -> Any:
    """A message ``content``: a string, or a list of parts whose text parts are normalized."""
    if isinstance(content, str):
        return normalize(content, rules)
    if isinstance(content, list):
        parts: list[Any] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append({**part, "text": normalize(part["text"], rules)})
            else:
                parts.append(part)
        return parts
    return content


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], rules: NormalizeRules = DEFAULT_RULES
) -> list[dict[str, Any]]:
    """New message dicts with every ``content`` normalized; the input is not changed."""
    return [
        {**m, "content": normalize_content(m["content"], rules)} if "content" in m else dict(m)
        for m in messages
    ]


class Normalizer:
    """Normalization rules bound to a template version.

    Attributes:
        rules: The rules applied by :meth:`__call__`.
        template_version: The prompt template's own version (e.g. ``"rag-v3"``).
    """

    __slots__ = ("rules", "template_version")

    def __init__(self, rules: NormalizeRules = DEFAULT_RULES, template_version: str = "0") -> None:
        if not template_version or "]" in template_version or "\n" in template_version:
            raise ValueError(f"template_version {template_version!r}: empty or contains ']'")
        self.rules = rules
        self.template_version = template_version

    @property
    def version(self) -> str:
        """``template_version+fingerprint``: the value for ``CacheNamespace.template_version``."""
        return f"{self.template_version}+{self.rules.fingerprint()}"

    def __call__(self, text: str) -> str:
        """Normalize ``text`` with the bound rules."""
        return normalize(text, self.rules)

    def stamp(self, text: str) -> str:
        """The normalized text with ``[prompt-template VERSION]`` as its first line.

        An existing stamp (of any version) is replaced, so stamping is idempotent.
        """
        body = normalize(_STAMP.sub("", text, count=1), self.rules)
        return f"[prompt-template {self.version}]\n{body}"

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Normalize the content of every message."""
        return normalize_messages(messages, self.rules)


def stamp_version(text: str) -> str | None:
    """The template version stamped on ``text`` by :meth:`Normalizer.stamp`, if any."""
    m = _STAMP.match(text)
    return m.group(0)[len("[prompt-template ") : -2] if m else None
