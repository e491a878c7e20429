"""The prefix class of a request: stated by the client, or inferred from its prompt.

One classifier for the gateway's metrics, the linter's observe mode and the
log analyzer, so that all three label the same traffic alike. It reads a
:class:`~prefixrouter.prompt.render.RenderedPrompt` (the spans say which text
came from which role) and applies these rules, first match wins:

1. ``session``: an earlier turn (assistant, tool or function) before the
   last message, or more than one user message;
2. ``rag``: a user message (or completion prompt) holds retrieved context:
   a :data:`~prefixrouter.prompt.render.RAG_MARKERS` marker, or several
   numbered or marked passages (``[1]`` and ``[2]``, two ``<document``, two
   ``Source:``);
3. ``document``: a user message of at least ``document_chars`` characters, or
   one ``<document`` marker in it (a token-id prompt counts its ids at
   ``chars_per_token``);
4. ``system``: a system or developer message, or tool definitions;
5. ``unknown``.

The thresholds and markers are one :class:`ClassifierParams`; the gateway
fills it from its configuration (``routing.document_chars``).

A stated class comes from the ``X-Prefix-Class`` header (or a log record's
field): :func:`parse_prefix_class` is the one reader of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.render import (
    HISTORY_ROLES,
    RAG_MARKERS,
    SYSTEM_ROLES,
    PromptError,
    RenderedPrompt,
)

PREFIX_CLASS_HEADER = "X-Prefix-Class"
DOCUMENT_CHARS = 4_000
"""A user message this long (about 1,000 tokens) is a document (``routing.document_chars``)."""
_BY_NAME = {c.value: c for c in PrefixClass}


@dataclass(frozen=True, slots=True)
class ClassifierParams:
    """Thresholds and markers of :func:`classify`.

    Attributes:
        document_chars: A user message this long is a document.
        chars_per_token: Characters a token of a token-id prompt stands for.
        rag_markers: Any one of them marks retrieved context.
        passage_pairs: Markers that mark retrieved context when a prompt holds
            both (``("[1]", "[2]")``) or, given once, twice.
        document_marker: One document pasted into the prompt.
    """

    document_chars: int = DOCUMENT_CHARS
    chars_per_token: float = 4.0
    rag_markers: tuple[str, ...] = RAG_MARKERS
    passage_pairs: tuple[tuple[str, str], ...] = (
        ("[1]", "[2]"),
        ("<document", "<document"),
        ("Source:", "Source:"),
    )
    document_marker: str = "<document"


DEFAULT_PARAMS = ClassifierParams()


def parse_prefix_class(value: object, *, strict: bool = False) -> PrefixClass | None:
    """A stated prefix class (the ``X-Prefix-Class`` header, a log record's field).

    Case and surrounding blanks are ignored; empty or absent is None.

    Args:
        value: The stated value.
        strict: Raise on a value that names no class (the gateway answers
            400); else such a value is None (a log is read as it is).

    Raises:
        PromptError: Strict, and ``value`` names no class (field ``X-Prefix-Class``).
    """
    if not value or not isinstance(value, str):
        return None
    cls = _BY_NAME.get(value.strip().lower())
    if cls is None and strict:
        raise PromptError(
            PREFIX_CLASS_HEADER,
            f"unknown prefix class {value!r}; known: {', '.join(sorted(_BY_NAME))}",
        )
    return cls


def _has(text: str, marker: str, start: int, end: int) -> bool:
    return text.find(marker, start, end) >= 0


def _both(text: str, pair: tuple[str, str], start: int, end: int) -> bool:
    a, b = pair
    first = text.find(a, start, end)
    if first < 0:
        return False
    if a == b:  # the marker twice (it cannot overlap itself)
        return text.find(a, first + len(a), end) >= 0
    return text.find(b, start, end) >= 0


def _retrieved(text: str, start: int, end: int, params: ClassifierParams) -> bool:
    # Each marker is first looked for by its first character (a memchr, about
    # 30 times faster than a substring scan): most prompts hold no "[" or "<",
    # and the scans of the full markers then never run.
    heads: dict[str, bool] = {}

    def head(marker: str) -> bool:
        c = marker[0]
        found = heads.get(c)
        if found is None:
            found = heads[c] = _has(text, c, start, end)
        return found

    if any(head(m) and _has(text, m, start, end) for m in params.rag_markers):
        return True
    return any(head(p[0]) and _both(text, p, start, end) for p in params.passage_pairs)


def classify(prompt: RenderedPrompt, params: ClassifierParams = DEFAULT_PARAMS) -> PrefixClass:
    """The prefix class of a rendered chat or completion prompt (module docstring).

    Reads the text through the spans (bounded ``str.find``, no copies).
    """
    spans = prompt.spans
    users = [s for s in spans if s.role in ("user", "prompt")]
    last = max((s.index for s in spans), default=-1)
    if len(users) > 1 or any(s.role in HISTORY_ROLES and s.index < last for s in spans):
        return PrefixClass.SESSION
    text = prompt.text
    if any(_retrieved(text, s.start, s.end, params) for s in users):
        return PrefixClass.RAG
    for s in users:
        if s.end - s.start >= params.document_chars or _has(
            text, params.document_marker, s.start, s.end
        ):
            return PrefixClass.DOCUMENT
    if any(s.role in SYSTEM_ROLES or s.index == -1 for s in spans):
        return PrefixClass.SYSTEM
    return PrefixClass.UNKNOWN


def classify_tokens(
    tokens: Sequence[int], params: ClassifierParams = DEFAULT_PARAMS
) -> PrefixClass:
    """The prefix class of a completions prompt given as token ids: only its length is known."""
    if len(tokens) * params.chars_per_token >= params.document_chars:
        return PrefixClass.DOCUMENT
    return PrefixClass.UNKNOWN
