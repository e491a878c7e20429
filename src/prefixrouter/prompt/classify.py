"""The prefix class of a request: stated by the client, or inferred from its prompt.

One classifier for the gateway's metrics, the linter's observe mode and the
log analyzer, so that all three label the same traffic alike. It reads a
:class:`~prefixrouter.prompt.render.RenderedPrompt` (the spans say which text
came from which role) and applies these rules, first match wins:

1. ``session``: an earlier turn (assistant, tool or function, or any role
   outside OpenAI's) before the last message, or more than one user message;
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
from functools import lru_cache

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.render import (
    RAG_MARKERS,
    SYSTEM_ROLES,
    MessageSpan,
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


def _both(text: str, pair: tuple[str, str], start: int, end: int) -> bool:
    a, b = pair
    first = text.find(a, start, end)
    if first < 0:
        return False
    if a == b:  # the marker twice (it cannot overlap itself)
        return text.find(a, first + len(a), end) >= 0
    return text.find(b, start, end) >= 0


_Groups = tuple[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ...]


@lru_cache(maxsize=16)
def _by_first_char(params: ClassifierParams) -> _Groups:
    """The RAG markers and passage pairs grouped by their first character."""
    groups: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}
    for m in params.rag_markers:
        groups.setdefault(m[0], ([], []))[0].append(m)
    for pair in params.passage_pairs:
        groups.setdefault(pair[0][0], ([], []))[1].append(pair)
    return tuple((c, tuple(ms), tuple(ps)) for c, (ms, ps) in groups.items())


def _retrieved(text: str, start: int, end: int, groups: _Groups) -> bool:
    # Markers are first looked for by their first character (a memchr, about
    # 30 times faster than a substring scan): most prompts hold no "[" or "<",
    # and the scans of the full markers then never run.
    find = text.find
    for head, markers, pairs in groups:
        if find(head, start, end) < 0:
            continue
        if any(find(m, start, end) >= 0 for m in markers):
            return True
        if any(_both(text, pair, start, end) for pair in pairs):
            return True
    return False


def classify(prompt: RenderedPrompt, params: ClassifierParams = DEFAULT_PARAMS) -> PrefixClass:
    """The prefix class of a rendered chat or completion prompt (module docstring).

    One walk over the spans, then bounded ``str.find`` calls on the text
    (no copies of the contents).
    """
    spans = prompt.spans
    last = max((s.index for s in spans), default=-1)
    users: list[MessageSpan] = []
    has_system = False
    for s in spans:
        role = s.role
        if role == "user" or role == "prompt":
            users.append(s)
        elif role in SYSTEM_ROLES or s.index == -1:
            has_system = True
        elif s.index < last:
            # assistant, tool, function, or a role outside OpenAI's (Llama's
            # ``ipython`` tool results, a ``narrator``): an earlier turn, not
            # instructions (HISTORY_ROLES).
            return PrefixClass.SESSION
    if len(users) > 1:
        return PrefixClass.SESSION
    text = prompt.text
    groups = _by_first_char(params)
    for s in users:
        if _retrieved(text, s.start, s.end, groups):
            return PrefixClass.RAG
    marker = params.document_marker
    for s in users:
        if s.end - s.start >= params.document_chars or text.find(marker, s.start, s.end) >= 0:
            return PrefixClass.DOCUMENT
    return PrefixClass.SYSTEM if has_system else PrefixClass.UNKNOWN


def classify_tokens(
    tokens: Sequence[int], params: ClassifierParams = DEFAULT_PARAMS
) -> PrefixClass:
    """The prefix class of a completions prompt given as token ids: only its length is known."""
    if len(tokens) * params.chars_per_token >= params.document_chars:
        return PrefixClass.DOCUMENT
    return PrefixClass.UNKNOWN
