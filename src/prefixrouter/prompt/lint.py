"""Prompt linter: volatile fields placed before long stable content.

A prefix cache reuses a prompt up to its first differing token. A timestamp,
request id or counter near the start of an otherwise fixed prompt therefore
costs every token after it on every call. The linter finds such fields and
says what each costs and how to fix it. It is pure: text in, findings out.

What it looks for (one combined regular expression, :func:`scan_volatile`):

* timestamps (ISO 8601, RFC 2822 / HTTP dates, ``May 1, 2024 10:00``,
  ``01/05/2024 10:00``, ``hh:mm:ss``, Unix epochs 2017-2033 in s or ms) and
  dates (ISO, ``05/01/2024``, ``1.5.2024``, ``May 1, 2024``, ``1 May 2024``);
* UUIDs, W3C ``traceparent`` values, hex ids of 16+ digits (with a letter and a
  digit; not the content-derived ``doc-<hex>`` ids of :func:`document_id`);
* ``key=value`` / ``"key": value`` pairs whose key names a session, user,
  request or trace id, a nonce, a counter or a time (the value of a counter or
  time key must hold a digit);
* in a template (a text with ``{{ x }}``, ``${x}`` or ``{x}`` placeholders):
  placeholders, classified by name (``{{ now }}`` is a timestamp, ``{user_id}``
  a user id, any other one a ``variable``); literal text of a template is
  constant, so it is not scanned;
* in JSON lines: fields that differ between otherwise identical requests
  (``varying_field``): each request is compared with the previous one of the
  same model and role sequence; after the common prefix and suffix of their
  whole prompts, a difference of at most ``max_field_chars`` is a field, and a
  longer one is diffed word by word if the prompts are still 90% equal. The
  equal text after a field is what it costs, so a field in the per-call tail
  counts too when later requests repeat what follows it (a timestamp ahead of
  a long prompt with no paragraph break, which one request alone reads as
  all tail).

Where it looks: in a request body, the content written for this call (system
and developer messages, tool definitions, the last user message); earlier
turns are history, already fixed. The **stable part** of a prompt ends where
its per-call tail begins (:attr:`RenderedPrompt.tail_start`: the retrieved
context, or else the last paragraph of the last user message, where the
question goes). A match is a finding when the stable tokens after it, other
matches excluded, reach ``min_stable_tokens``: ``stable_tokens_after`` is the
prefill it costs per call. A kind found more than ``max_per_message`` times
in one message is taken for data (a pasted log), not a field. Positions are
character offsets in the rendered prompt (:func:`~.render.render_body`), or in the
file for a template; tokens are estimated at ``chars_per_token``.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from prefixrouter.core.hashing import TokenEstimator
from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.classify import (
    DEFAULT_PARAMS,
    ClassifierParams,
    classify,
    parse_prefix_class,
)
from prefixrouter.prompt.render import MessageSpan, RenderedPrompt, render_body

_MOVE = "move it after the stable block (into the last user message)"
_HEADER = "send it in a header or the request's metadata, not in the prompt"
FIXES: dict[str, str] = {
    "timestamp": f"{_MOVE}, or drop it",
    "date": f"{_MOVE}, or keep it only if it is constant",
    "uuid": _HEADER,
    "hex_id": _HEADER,
    "request_id": f"{_HEADER} (e.g. X-Request-Id)",
    "trace_id": f"{_HEADER} (e.g. traceparent)",
    "session_id": f"{_HEADER} (or the body's `user` field)",
    "user_id": f"send it in the body's `user` field or metadata, or {_MOVE}",
    "nonce": f"drop it from the prompt, or {_MOVE}",
    "counter": f"{_MOVE}, or drop it",
    "varying_field": f"it differs between otherwise identical requests: {_MOVE}, or {_HEADER}",
    "variable": "move the placeholder after the static text (static instructions first)",
}

_KEY_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), kind)
    for p, kind in (
        (r"session|conversation|chat|thread", "session_id"),
        (r"user|client|account|customer|device", "user_id"),
        (r"trace|span|correlation|parent", "trace_id"),
        (r"request|req|message|msg|run|job|guid|uuid", "request_id"),
        (r"nonce|salt|random", "nonce"),
        (r"counter|count|seq|attempt|retr|iteration|turn|index", "counter"),
        (r"time|now|^ts$|created|updated", "timestamp"),
        (r"date|today", "date"),
    )
)
_DIGIT_KINDS = frozenset({"counter", "timestamp", "date"})

_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
)
_WDAY = r"(?:mon|tue|wed|thu|fri|sat|sun)[a-z]*\.?,?"
_TIME = (
    r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[ap]\.?m\.?)?"
    r"(?:\s?(?:z|utc|gmt|[+-]\d{2}:?\d{2}))?"
)
_KEY = (
    r"(?:x[-_])?(?:session|conversation|chat|thread|user|client|account|customer|device"
    r"|request|req|message|msg|run|job|trace|span|correlation|parent)[-_ ]?id"
    r"|nonce|salt|counter|seq|sequence(?:[-_ ]?(?:no|number))?|attempt|retry|retries|iteration"
    r"|turn|timestamp|ts|time|date|datetime|now|created[-_ ]?at|current[-_ ]?(?:time|date)"
)
_VOLATILE = re.compile(
    rf"""(?P<kv>\b(?P<key>{_KEY})\b["']?\s*[:=]\s*
            (?P<value>"[^"\n]{{1,200}}"|'[^'\n]{{1,200}}'|[^\s,;}}\]"')]{{1,200}}))
    |(?P<uuid>\b[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}\b)
    |(?P<trace_id>\b[0-9a-f]{{2}}-[0-9a-f]{{32}}-[0-9a-f]{{16}}-[0-9a-f]{{2}}\b)
    |(?P<timestamp>\b\d{{4}}-\d{{2}}-\d{{2}}[t\s]\d{{2}}:\d{{2}}(?::\d{{2}}(?:[.,]\d+)?)?
            (?:z|[+-]\d{{2}}:?\d{{2}})?
        |\b{_WDAY}\s+\d{{1,2}}\s+{_MONTH}\s+\d{{4}},?\s+{_TIME}
        |\b(?:{_WDAY}\s+)?{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}},?\s+(?:at\s+)?{_TIME}
        |\b\d{{1,2}}[/.]\d{{1,2}}[/.]\d{{2,4}},?\s+{_TIME}
        |\b\d{{8}}t\d{{6}}z?\b
        |\b\d{{1,2}}:\d{{2}}:\d{{2}}(?:[.,]\d+)?\b
        |\b1[5-9]\d{{8}}(?:\d{{3}})?\b)
    |(?P<date>\b\d{{4}}-\d{{2}}-\d{{2}}\b
        |\b\d{{1,2}}/\d{{1,2}}/\d{{4}}\b
        |\b\d{{1,2}}\.\d{{1,2}}\.\d{{4}}\b
        |\b(?:{_WDAY}\s+)?{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b
        |\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\s+\d{{4}}\b)
    |(?P<hex_id>\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{{16,}}\b)
    """,
    re.IGNORECASE | re.VERBOSE,
)
_PLACEHOLDER = re.compile(
    r"\{\{-?\s*(?P<jinja>[^{}]*?)\s*-?\}\}"
    r"|\$\{(?P<dollar>[A-Za-z_][\w.]*)\}"
    r"|(?<!\{)\{(?P<fmt>[A-Za-z_][\w.]*)(?:![rsa])?(?::[^{}\n]*)?\}(?!\})"
)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_ANCHOR = re.compile(r"[\d:=]+")
_BLANK = re.compile(r"\s")
_BEFORE, _AFTER = 64, 256  # window around an anchor: longest lead-in, longest value
_WORD = re.compile(r"\w+|[^\w\s]+")
DEFAULT_MIN_STABLE_TOKENS = 128
_DOC_ID_PREFIX = "doc-"


@dataclass(frozen=True, slots=True)
class Finding:
    """One volatile field before stable content.

    Attributes:
        kind: ``timestamp``, ``date``, ``uuid``, ``hex_id``, ``request_id``,
            ``trace_id``, ``session_id``, ``user_id``, ``nonce``, ``counter``,
            ``varying_field`` or ``variable`` (a template placeholder).
        position: Character offset in the rendered prompt (in the file for a template).
        text: The volatile text (for a placeholder, the placeholder).
        stable_tokens_after: Estimated stable tokens after it: the prefill it costs per call.
        fix: What to do about it.
        location: Where it is in the source: ``messages[0].content@17``, ``line 3, column 5``.
        token_position: ``position`` in estimated tokens.
        requests: Requests it was found in (JSON lines), else 1.
        line: Line of the (first) request in a JSON-lines file, or of a template match.
    """

    kind: str
    position: int
    text: str
    stable_tokens_after: int
    fix: str
    location: str = ""
    token_position: int = 0
    requests: int = 1
    line: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (``kind, position, text, stable_tokens_after, fix`` and the rest)."""
        return {
            "kind": self.kind,
            "position": self.position,
            "text": self.text,
            "stable_tokens_after": self.stable_tokens_after,
            "fix": self.fix,
            "location": self.location,
            "token_position": self.token_position,
            "requests": self.requests,
            "line": self.line,
        }


@dataclass(frozen=True, slots=True)
class VolatileMatch:
    """A volatile-looking span of text (before deciding whether it costs anything)."""

    kind: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class LintParams:
    """Linter thresholds.

    Attributes:
        min_stable_tokens: Report a field only when at least this many stable
            tokens follow it (a short tail after a field costs little).
        chars_per_token: For the token estimates.
        max_field_chars: JSON lines: the longest difference still taken as one field.
        max_diff_chars: JSON lines: compare at most this much of two stable parts word by word.
        max_groups: JSON lines: requests remembered for comparison (one per model and roles).
        max_per_message: A kind seen more often than this in one message is
            data (a pasted log, a table of dates), not a field: not reported.
    """

    min_stable_tokens: int = DEFAULT_MIN_STABLE_TOKENS
    chars_per_token: float = 4.0
    max_field_chars: int = 120
    max_diff_chars: int = 50_000
    max_groups: int = 1024
    max_per_message: int = 3


def _key_kind(name: str) -> str:
    for pattern, kind in _KEY_KINDS:
        if pattern.search(name):
            return kind
    return "variable"


def scan_volatile(text: str, start: int = 0, end: int | None = None) -> list[VolatileMatch]:
    """Volatile-looking spans of ``text[start:end]``, left to right, not overlapping.

    Every pattern holds a digit or a ``:`` / ``=`` (its *anchor*), and starts
    at most ``_BEFORE`` characters before it, so only windows around anchors
    are searched (merged when they overlap, extended to the next blank): on
    prose this is several times faster than searching every position, and it
    finds the same matches.
    """
    stop = len(text) if end is None else end
    out: list[VolatileMatch] = []
    lo = hi = -1
    for a in _ANCHOR.finditer(text, start, stop):
        wlo = max(start, a.start() - _BEFORE)
        if wlo > hi:  # disjoint from the current range: search that one, open a new one
            if hi >= 0:
                _scan_range(text, lo, hi, out)
            lo = wlo
        # end the window at a blank so that no match is cut
        edge = min(stop, a.end() + _AFTER)
        blank = _BLANK.search(text, edge, min(stop, edge + _AFTER))
        hi = blank.start() if blank is not None else min(stop, edge + _AFTER)
    if hi >= 0:
        _scan_range(text, lo, hi, out)
    return out


def _scan_range(text: str, lo: int, hi: int, out: list[VolatileMatch]) -> None:
    pos = lo
    while True:
        m = _VOLATILE.search(text, pos, hi)
        if m is None:
            return
        kind = m.lastgroup or "hex_id"
        end = m.end()
        if kind == "kv":
            kind = _key_kind(m.group("key"))
            if kind in _DIGIT_KINDS and not any(c.isdigit() for c in m.group("value")):
                pos = m.start() + 1  # "time: later" is prose; rescan inside it
                continue
            while end > m.start("value") + 1 and text[end - 1] in ".:!?":
                end -= 1  # sentence punctuation after an unquoted value
        elif kind == "hex_id" and text.endswith(_DOC_ID_PREFIX, 0, m.start()):
            pos = end  # a content-derived document id (document_id()): stable by construction
            continue
        out.append(VolatileMatch(kind, m.start(), end))
        pos = end


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (binary search on slices)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _expand_run(text: str, start: int, end: int, limit: int = 64) -> tuple[int, int]:
    """Widen [start, end) to the whitespace-delimited run around it (at most ``limit`` each way)."""
    lo = start
    while lo > 0 and start - lo < limit and not text[lo - 1].isspace():
        lo -= 1
    hi = max(end, start + 1)
    while hi < len(text) and hi - end < limit and not text[hi].isspace():
        hi += 1
    return lo, min(hi, len(text))


class _StableChars:
    """Counts characters outside a set of disjoint, sorted volatile spans."""

    __slots__ = ("_cum", "_ends", "_starts")

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]
        self._cum = [0]
        for s, e in spans:
            self._cum.append(self._cum[-1] + e - s)

    def _volatile_before(self, pos: int) -> int:
        """Volatile characters before ``pos``."""
        i = bisect_right(self._starts, pos)  # spans starting at or before pos
        if i and self._ends[i - 1] > pos:
            return self._cum[i - 1] + pos - self._starts[i - 1]
        return self._cum[i]

    def between(self, start: int, end: int) -> int:
        """Characters in [start, end) outside every volatile span."""
        if end <= start:
            return 0
        return end - start - (self._volatile_before(end) - self._volatile_before(start))


@dataclass(slots=True)
class _Rendered:
    """A rendered request remembered for comparison with the next one of its group."""

    line: int
    prompt: RenderedPrompt


class Linter:
    """Finds volatile fields before stable content in bodies, templates and JSON lines."""

    __slots__ = ("_estimator", "params")

    def __init__(self, params: LintParams | None = None) -> None:
        self.params = params or LintParams()
        self._estimator = TokenEstimator(self.params.chars_per_token)

    def _tokens(self, chars: int) -> int:
        return self._estimator.estimate(max(0, chars))

    def matches(self, prompt: RenderedPrompt) -> list[tuple[MessageSpan, VolatileMatch]]:
        """Volatile matches in the content written for this call (:attr:`RenderedPrompt.live`).

        A kind found more than ``max_per_message`` times in one message is
        data (a pasted log, a table of dates), not a template field: those
        matches are dropped.
        """
        out: list[tuple[MessageSpan, VolatileMatch]] = []
        for span in prompt.live:
            found = scan_volatile(prompt.text, span.start, span.end)
            kinds = Counter(m.kind for m in found)
            limit = self.params.max_per_message
            out += [(span, m) for m in found if kinds[m.kind] <= limit]
        return out

    def lint_body(self, body: Mapping[str, Any], *, line: int | None = None) -> list[Finding]:
        """Findings of one request body (chat or completions).

        Args:
            body: The OpenAI request body; it is not modified.
            line: Its line in a JSON-lines file, echoed in the findings.
        """
        return self.lint_prompt(render_body(body), line)

    def lint_prompt(self, prompt: RenderedPrompt, line: int | None = None) -> list[Finding]:
        """Findings of a prompt already rendered (the gateway's, in observe mode)."""
        return self._findings(prompt, self.matches(prompt), line)

    def _findings(
        self,
        prompt: RenderedPrompt,
        matches: list[tuple[MessageSpan, VolatileMatch]],
        line: int | None,
    ) -> list[Finding]:
        stable = _StableChars([(m.start, m.end) for _, m in matches])
        out: list[Finding] = []
        for span, m in matches:
            tokens = self._tokens(stable.between(m.end, prompt.tail_start))
            if tokens < self.params.min_stable_tokens:
                continue
            out.append(
                self._finding(
                    m.kind,
                    m.start,
                    prompt.text[m.start : m.end],
                    tokens,
                    f"{span.path}@{m.start - span.start}",
                    line,
                )
            )
        return out

    def _finding(
        self, kind: str, pos: int, text: str, tokens: int, location: str, line: int | None
    ) -> Finding:
        base = FIXES.get(kind, FIXES["varying_field"])
        fix = f"{base}; it costs ~{tokens} prefill tokens per call"
        return Finding(kind, pos, text, tokens, fix, location, self._tokens(pos), 1, line)

    def lint_template(self, text: str) -> list[Finding]:
        """Findings of a prompt template: placeholders before long static text.

        A text without placeholders is linted as one literal prompt instead
        (volatile patterns, everything before its last paragraph stable).
        """
        holders = list(_PLACEHOLDER.finditer(text))
        if not holders:
            return self.lint_body({"prompt": text})
        stable = _StableChars([(m.start(), m.end()) for m in holders])
        out: list[Finding] = []
        for m in holders:
            tokens = self._tokens(stable.between(m.end(), len(text)))
            if tokens < self.params.min_stable_tokens:
                continue
            expr = m.group("jinja") or m.group("dollar") or m.group("fmt") or ""
            name = _IDENT.search(expr)
            kind = _key_kind(name.group(0)) if name else "variable"
            ln, col = _line_col(text, m.start())
            out.append(
                self._finding(kind, m.start(), m.group(0), tokens, f"line {ln}, column {col}", ln)
            )
        return out

    def lint_bodies(self, bodies: Iterable[tuple[int, Mapping[str, Any]]]) -> list[Finding]:
        """Findings of many request bodies (JSON lines), merged by kind and position.

        Each body is linted alone, then compared with the previous body of the
        same model and role sequence for fields that differ between otherwise
        identical requests. A finding seen in several requests is reported
        once, with ``requests`` counting them and ``line`` the first one.

        Args:
            bodies: (line number, body) pairs.
        """
        merged: dict[tuple[str, int], Finding] = {}
        last: OrderedDict[tuple[str, tuple[str, ...]], _Rendered] = OrderedDict()
        for line, body in bodies:
            prompt = render_body(body)
            matches = self.matches(prompt)
            found = self._findings(prompt, matches, line)
            key = _group_key(body)
            prev = last.get(key)
            if prev is not None:
                found += self._varying_fields(prev.prompt, prompt, matches, found, line)
            last[key] = _Rendered(line, prompt)
            last.move_to_end(key)
            if len(last) > self.params.max_groups:
                last.popitem(last=False)
            for f in found:
                k = (f.kind, f.position)
                old = merged.get(k)
                merged[k] = (
                    f
                    if old is None
                    else Finding(
                        old.kind,
                        old.position,
                        old.text,
                        max(old.stable_tokens_after, f.stable_tokens_after),
                        old.fix,
                        old.location,
                        old.token_position,
                        old.requests + 1,
                        old.line,
                    )
                )
        return sorted(merged.values(), key=lambda f: (f.position, f.kind))

    def _varying_fields(
        self,
        prev: RenderedPrompt,
        cur: RenderedPrompt,
        matches: list[tuple[MessageSpan, VolatileMatch]],
        reported: list[Finding],
        line: int,
    ) -> list[Finding]:
        """Fields in which ``cur`` differs from ``prev``, before content both repeat.

        The whole prompts are compared, per-call tail included: one request
        alone cannot tell its stable text from its own (a prompt with no
        paragraph break is all tail), but two requests that repeat a long
        text after a differing timestamp show what every call pays. A
        difference in the question itself has little equal text after it,
        so it stays under ``min_stable_tokens``. A region that one of the
        patterns matched is reported under that pattern's kind (a timestamp
        in the tail, which the request alone could not judge), once.
        """
        a, b = prev.text, cur.text
        p = common_prefix_len(a, b)
        if p >= min(len(a), len(b)):
            return []  # equal prompts, or one extends the other (a session growing)
        s = common_prefix_len(a[p:][::-1], b[p:][::-1])
        regions: list[tuple[int, int, int]] = []  # (start, end, stable chars after) in b
        mid_a, mid_b = len(a) - s - p, len(b) - s - p
        if max(mid_a, mid_b) <= self.params.max_field_chars:
            regions.append((p, p + mid_b, s))
        else:
            regions = self._word_diff(a[p : p + self.params.max_diff_chars], b, p)
        taken = [(f.position, f.position + len(f.text)) for f in reported]
        out: list[Finding] = []
        for start, end, stable in regions:
            lo, hi = _expand_run(b, start, end)
            if any(ts < hi and lo < te for ts, te in taken):
                continue  # already reported by its pattern (a timestamp, an id...)
            tokens = self._tokens(stable)
            if tokens < self.params.min_stable_tokens:
                continue
            match = next((m for _, m in matches if m.start < hi and lo < m.end), None)
            if match is not None:
                kind, lo, hi = match.kind, match.start, match.end
            else:
                kind = "varying_field"
            span = cur.span_at(lo)
            where = f"{span.path}@{lo - span.start}" if span else f"@{lo}"
            out.append(self._finding(kind, lo, b[lo:hi][:120], tokens, where, line))
            taken.append((lo, hi))
        return out

    def _word_diff(self, a: str, b_full: str, p: int) -> list[tuple[int, int, int]]:
        """Short differing regions of two mostly equal texts (a from offset p of b_full)."""
        b = b_full[p : p + self.params.max_diff_chars]
        wa = [m.group(0) for m in _WORD.finditer(a)]
        mb = list(_WORD.finditer(b))
        wb = [m.group(0) for m in mb]
        ops = SequenceMatcher(None, wa, wb).get_opcodes()
        equal_chars = [0] * (len(ops) + 1)  # equal characters of b from opcode i on
        for i in range(len(ops) - 1, -1, -1):
            tag, _, _, j1, j2 = ops[i]
            eq = (mb[j2 - 1].end() - mb[j1].start()) if tag == "equal" and j2 > j1 else 0
            equal_chars[i] = equal_chars[i + 1] + eq
        if equal_chars[0] < 0.9 * max(len(b), 1):
            return []  # different content (another document), not a field
        out: list[tuple[int, int, int]] = []
        for i, (tag, i1, i2, j1, j2) in enumerate(ops):
            if tag == "equal":
                continue
            start = mb[j1].start() if j1 < len(mb) else len(b)
            end = mb[j2 - 1].end() if j2 > j1 else start
            width = max(end - start, sum(len(w) for w in wa[i1:i2]))
            if width <= self.params.max_field_chars:
                out.append((p + start, p + end, equal_chars[i + 1]))
        return out


def _group_key(body: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    messages = body.get("messages")
    roles = tuple(
        str(m.get("role", "")) for m in (messages if isinstance(messages, list) else [])
        if isinstance(m, Mapping)
    )  # fmt: skip
    return str(body.get("model", "")), roles


class LintObserver:
    """Observe mode for the gateway: lint each request, count findings; change nothing.

    :meth:`observe` scans the prompt the gateway rendered for routing (its
    spans say which content was written for this call), so a request is
    rendered once whether the linter runs or not, and adds its findings to
    counters keyed by prefix class and kind, for the gateway to export
    (``prefixrouter_lint_findings_total{prefix_class, kind}``). It never
    raises: a prompt it cannot read counts as an error.
    """

    __slots__ = ("_errors", "_findings", "_requests", "classifier", "linter")

    def __init__(
        self, linter: Linter | None = None, classifier: ClassifierParams = DEFAULT_PARAMS
    ) -> None:
        self.linter = linter or Linter()
        self.classifier = classifier
        self._findings: Counter[tuple[str, str]] = Counter()
        self._requests: Counter[str] = Counter()
        self._errors = 0

    def observe(
        self, prompt: RenderedPrompt | None, prefix_class: PrefixClass | str | None = None
    ) -> dict[str, int]:
        """Lint one rendered prompt and count its findings.

        Args:
            prompt: The request's prompt as rendered for routing (None: a
                prompt of token ids, which holds no text to lint).
            prefix_class: The request's prefix class if the gateway knows it
                (it always does); else classified from the prompt.

        Returns:
            Findings of this request by kind (empty when clean).
        """
        try:
            cls = parse_prefix_class(prefix_class)
            if cls is None:
                cls = PrefixClass.UNKNOWN if prompt is None else classify(prompt, self.classifier)
            found = self.linter.lint_prompt(prompt) if prompt is not None else []
            kinds = Counter(f.kind for f in found)
        except Exception:  # observe mode must never fail a request
            self._errors += 1
            return {}
        self._requests[cls.value] += 1
        for kind, n in kinds.items():
            self._findings[(cls.value, kind)] += n
        return dict(kinds)

    def findings(self) -> dict[str, dict[str, int]]:
        """Findings so far: prefix class -> kind -> count."""
        out: dict[str, dict[str, int]] = {}
        for (cls, kind), n in sorted(self._findings.items()):
            out.setdefault(cls, {})[kind] = n
        return out

    def requests(self) -> dict[str, int]:
        """Requests observed so far, by prefix class."""
        return dict(sorted(self._requests.items()))

    @property
    def errors(self) -> int:
        """Bodies that could not be linted."""
        return self._errors

    @staticmethod
    def classes() -> tuple[str, ...]:
        """Every prefix class label the counters can carry."""
        return tuple(c.value for c in PrefixClass)
