"""Stable prompt assembly: stable content first, the per-call part last.

A prefix cache reuses a prompt only up to its first differing token, so a
prompt should be built from the most stable layer to the least stable one.
The builders here return OpenAI chat-completions bodies in that order:

* :func:`doc_qa_request` (one document, many questions): the system
  instruction, then the document wrapped in ``<document id="...">`` with an id
  derived from its content (so the same document always renders the same
  bytes), then the question as the last paragraph of the user message.
* :func:`rag_request` (two layers): the stable layer (:class:`StableLayer`:
  instructions, response policy, glossary, rules, tool profile) as the system
  message and the body's ``tools``; then the retrieved fragments ordered by
  score, ties broken by source id and then position (:func:`order_fragments`),
  so equal retrieval results render equal bytes; then the question.
* :class:`PinnedSession` (a session pinned to a retrieved set): the set and
  its order are fixed when the session starts; each turn only appends, so
  turn ``n+1`` reuses the whole prompt of turn ``n``.

Every builder normalizes its text with a :class:`Normalizer` and returns an
:class:`AssembledRequest`: the body, and the headers that tell the gateway the
prefix class (``X-Prefix-Class``) and the template version.

The module also defines how a body becomes one prompt text
(:func:`render_chat`: the bundled model's ChatML template, byte for byte, with
the offset of every message and of the per-call tail, for the linter and the
log analyzer) and how a body's prefix class is inferred from its structure
(:func:`infer_prefix_class`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.normalize import Normalizer, canonical_json

PREFIX_CLASS_HEADER = "X-Prefix-Class"
TEMPLATE_VERSION_HEADER = "X-Prompt-Template"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

RAG_MARKERS = (
    "<retrieved",
    "<context>",
    "<context ",
    "<documents>",
    "<search_results",
    "[source:",
    "[Source:",
    "# Context\n",
    "# Retrieved context",
)
"""Markers of retrieved context in a prompt (what :func:`render_fragments` writes, and the
common conventions); the retrieved layer is variable, so the stable part ends before it.
Literal and case-sensitive: ``str.find`` is an order of magnitude faster than a regex."""
_DOCUMENT_MARKER = re.compile(r"<document\b", re.IGNORECASE)
DOCUMENT_CHARS = 6_000
"""A single-turn user message this long (about 1,500 tokens) is a document."""
SYSTEM_CHARS = 400
"""A system message this long (about 100 tokens) is a reusable system template."""
_HISTORY_ROLES = frozenset({"assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class MessageSpan:
    """Where one message's content lies in the rendered prompt.

    Attributes:
        index: Index in ``messages`` (-1: the tool definitions, -2: a completion prompt).
        role: The message role (``tools`` / ``prompt`` for the two special spans).
        start: Offset of the content's first character.
        end: Offset just past the content.
    """

    index: int
    role: str
    start: int
    end: int

    @property
    def path(self) -> str:
        """``messages[i].content``, ``tools`` or ``prompt``."""
        return f"messages[{self.index}].content" if self.index >= 0 else self.role


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A request body as one prompt text, with its message spans.

    Attributes:
        text: The prompt as the engine sees it (ChatML rendering).
        spans: Content span of every message (and of the tool definitions).
        tail_start: Where the per-call tail begins: the retrieved context, or
            else the last paragraph of the last user message (where builders
            put the question). Content before it is expected to be stable.
        live: The spans written for this call (system, tools, last user
            message); earlier turns are history, already fixed.
    """

    text: str
    spans: tuple[MessageSpan, ...]
    tail_start: int
    live: tuple[MessageSpan, ...] = field(default=())

    def span_at(self, pos: int) -> MessageSpan | None:
        """The content span holding ``pos``, if any."""
        for s in self.spans:
            if s.start <= pos < s.end:
                return s
        return None


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, or a list of typed parts.

    Text parts are joined by newlines; an image part becomes ``<image:HASH>``
    (the hash of its URL), so equal images render equally and different ones do not.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else _json_text(content)
    out: list[str] = []
    for part in content:
        if isinstance(part, Mapping):
            if isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                out.append(
                    f"<{part.get('type', 'part')}:{xxhash.xxh3_64_hexdigest(repr(part).encode())}>"
                )
        elif isinstance(part, str):
            out.append(part)
    return "\n".join(out)


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def canonical_tools(tools: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool definitions with sorted keys, ordered by function name: a stable tool profile."""

    def name(tool: Mapping[str, Any]) -> str:
        fn = tool.get("function")
        return str(fn.get("name", "")) if isinstance(fn, Mapping) else str(tool.get("name", ""))

    return [_canonical(t) for t in sorted(tools, key=lambda t: (name(t), canonical_json(t)))]


def find_rag_marker(text: str, start: int = 0) -> int:
    """Offset of the first :data:`RAG_MARKERS` marker in ``text``, or -1."""
    best = -1
    for marker in RAG_MARKERS:
        # Only an earlier match can improve on ``best``: bound the search there.
        i = text.find(marker, start, best + len(marker) - 1 if best >= 0 else len(text))
        if i >= 0:
            best = i
    return best


def _tail_start(content: str, start: int) -> int:
    cut = content.rfind("\n\n")
    return start + (cut + 2 if cut >= 0 else 0)


def _json_text(value: Any) -> str:
    """Sorted keys, ``", "`` / ``": "``, no ASCII escaping: the chat template's JSON."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def _tool_call_text(call: Any) -> str:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        return _json_text(call)  # malformed: still rendered, deterministically
    args = fn.get("arguments", "{}")
    args_text = args if isinstance(args, str) else _json_text(args)
    return (
        f'<tool_call>\n{{"name": {_json_text(fn["name"])}, "arguments": {args_text}}}\n</tool_call>'
    )


def render_chat(body: Mapping[str, Any]) -> RenderedPrompt:
    """Render a chat-completions (or completions) body as one ChatML prompt.

    The rules are those of the bundled model's chat template
    (:func:`prefixrouter.tokenizer.render_chat`), so offsets and block hashes
    match what the engine prefills: each message is
    ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; text parts of a content list
    are joined by newlines; an assistant's tool calls follow its content as
    ``<tool_call>`` blocks; the tool definitions, one JSON object a line, form
    a ``# Tools`` section appended to the first system message (or inserted as
    one); ``<|im_start|>assistant\\n`` ends the text. Unlike the template it
    never raises: parts it cannot render (images, malformed entries) become
    deterministic placeholders, so a log of any shape can be analyzed. A
    completions body (``prompt``: a string) renders as that string.

    Args:
        body: An OpenAI request body.

    Returns:
        The prompt text with message spans and where the per-call tail begins.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        span = MessageSpan(-2, "prompt", 0, len(prompt))
        tail = _tail_start(prompt, 0)
        rag = find_rag_marker(prompt)
        tail = min(tail, rag) if rag >= 0 else tail
        return RenderedPrompt(prompt, (span,), tail, (span,))
    messages = body.get("messages")
    turns: list[tuple[int, str, str]] = []
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, Mapping):
            continue
        text = content_text(m.get("content"))
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            text = "\n".join(([text] if text else []) + [_tool_call_text(c) for c in calls])
        turns.append((i, str(m.get("role") or "user"), text))
    tools = body.get("tools")
    section = ""
    if isinstance(tools, list) and tools:
        lines = "\n".join(_json_text(t) for t in tools)
        section = f"# Tools\n\n<tools>\n{lines}\n</tools>"
        if not turns or turns[0][1] != "system":
            turns.insert(0, (-1, "system", ""))

    parts: list[str] = []
    spans: list[MessageSpan] = []
    pos = 0
    for k, (index, role, text) in enumerate(turns):
        start = pos + len(IM_START) + len(role) + 1
        if index >= 0:
            spans.append(MessageSpan(index, role, start, start + len(text)))
        if k == 0 and section:
            if text:
                text += "\n\n"
            spans.append(
                MessageSpan(-1, "tools", start + len(text), start + len(text) + len(section))
            )
            text += section
        chunk = f"{IM_START}{role}\n{text}{IM_END}\n"
        parts.append(chunk)
        pos += len(chunk)
    parts.append(f"{IM_START}assistant\n")
    text = "".join(parts)

    chat = [s for s in spans if s.index >= 0]
    last = chat[-1] if chat else None
    if last is None:
        tail = len(text)
    elif last.role == "user":
        tail = _tail_start(text[last.start : last.end], last.start)
    else:
        tail = last.start
    rag = find_rag_marker(text)
    if rag >= 0:
        tail = min(tail, rag)
    last_user = max((s.index for s in chat if s.role == "user"), default=-1)
    live = tuple(
        s
        for s in spans
        if s.role not in _HISTORY_ROLES and (s.role != "user" or s.index == last_user)
    )
    return RenderedPrompt(text, tuple(spans), tail, live)


def explicit_prefix_class(value: Any) -> PrefixClass | None:
    """``value`` as a :class:`PrefixClass`, if it names one."""
    if isinstance(value, str):
        try:
            return PrefixClass(value.strip().lower())
        except ValueError:
            return None
    return None


def infer_prefix_class(body: Mapping[str, Any]) -> PrefixClass:
    """The prefix class of a request body, from its metadata or else its structure.

    In order: ``metadata.prefix_class`` if it names a class; several user turns
    or an earlier assistant turn: ``session``; retrieved-context markers
    (:data:`RAG_MARKERS`): ``rag``; a ``<document`` marker or a user message of
    :data:`DOCUMENT_CHARS` or more: ``document``; a system message of
    :data:`SYSTEM_CHARS` or more: ``system``; else ``unknown``.
    """
    meta = body.get("metadata")
    if isinstance(meta, Mapping):
        explicit = explicit_prefix_class(meta.get("prefix_class"))
        if explicit is not None:
            return explicit
    prompt = body.get("prompt")
    messages = body.get("messages")
    msgs = [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []
    texts = [(str(m.get("role", "user")), content_text(m.get("content"))) for m in msgs]
    if isinstance(prompt, str):
        texts.append(("user", prompt))
    users = [t for r, t in texts if r == "user"]
    if len(users) > 1 or any(r == "assistant" for r, _ in texts[:-1]):
        return PrefixClass.SESSION
    if any(find_rag_marker(t) >= 0 for _, t in texts):
        return PrefixClass.RAG
    if any(len(t) >= DOCUMENT_CHARS or _DOCUMENT_MARKER.search(t) for t in users):
        return PrefixClass.DOCUMENT
    if any(r in ("system", "developer") and len(t) >= SYSTEM_CHARS for r, t in texts):
        return PrefixClass.SYSTEM
    return PrefixClass.UNKNOWN


# ---------------------------------------------------------------------------- builders


@dataclass(frozen=True, slots=True)
class AssembledRequest:
    """An OpenAI request body and the headers to send with it.

    Attributes:
        body: The chat-completions body (``model``, ``messages``, options).
        headers: ``X-Prefix-Class`` and ``X-Prompt-Template`` (the normalizer's version).
        prefix_class: The request's prefix class.
    """

    body: dict[str, Any]
    headers: dict[str, str]
    prefix_class: PrefixClass


_DEFAULT_NORMALIZER = Normalizer()


def document_id(text: str) -> str:
    """A stable id of a document's content: ``doc-`` and 16 hex digits of its hash."""
    return "doc-" + xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def _assembled(
    model: str,
    messages: list[dict[str, Any]],
    cls: PrefixClass,
    normalizer: Normalizer,
    params: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] = (),
) -> AssembledRequest:
    body: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        body["tools"] = canonical_tools(tools)
    for key in sorted(params or {}):
        if key in body:
            raise ValueError(f"params: {key!r} is set by the builder")
        body[key] = (params or {})[key]
    headers = {PREFIX_CLASS_HEADER: cls.value, TEMPLATE_VERSION_HEADER: normalizer.version}
    return AssembledRequest(body, headers, cls)


def doc_qa_request(
    *,
    model: str,
    instruction: str,
    document: str,
    question: str,
    doc_id: str | None = None,
    normalizer: Normalizer | None = None,
    params: Mapping[str, Any] | None = None,
) -> AssembledRequest:
    """One document, many questions: instruction, then the document, then the question.

    Args:
        model: Model name.
        instruction: The system instruction (the same for every question).
        document: The document text.
        question: This call's question; it goes last.
        doc_id: The document's id; default: :func:`document_id` of the normalized text.
        normalizer: Normalization rules and template version (default rules, version "0").
        params: Other body fields (``max_tokens``, ``temperature``...).

    Returns:
        The body (``system``, then one ``user`` message holding
        ``<document id=...>``...``</document>``, a blank line and the question).
    """
    norm = normalizer or _DEFAULT_NORMALIZER
    doc = norm(document)
    ident = doc_id or document_id(doc)
    user = f'<document id="{ident}">\n{doc}\n</document>\n\n{norm(question)}'
    messages = [{"role": "system", "content": norm(instruction)}, {"role": "user", "content": user}]
    return _assembled(model, messages, PrefixClass.DOCUMENT, norm, params)


@dataclass(frozen=True, slots=True)
class StableLayer:
    """The stable layer of a RAG prompt, rendered in a fixed section order.

    Attributes:
        instructions: What the assistant does.
        response_policy: How it answers (format, length, citations).
        glossary: Domain terms.
        rules: Business rules.
        tool_profile: How to use the tools (text).
        tools: Tool definitions, sent as the body's ``tools`` in canonical order.
    """

    instructions: str
    response_policy: str = ""
    glossary: str = ""
    rules: str = ""
    tool_profile: str = ""
    tools: tuple[Mapping[str, Any], ...] = ()

    def render(self, normalizer: Normalizer | None = None) -> str:
        """The system text: each non-empty section under a ``## `` heading."""
        norm = normalizer or _DEFAULT_NORMALIZER
        sections = (
            ("Instructions", self.instructions),
            ("Response policy", self.response_policy),
            ("Glossary", self.glossary),
            ("Rules", self.rules),
            ("Tools", self.tool_profile),
        )
        return "\n\n".join(f"## {title}\n{norm(text)}" for title, text in sections if text)


@dataclass(frozen=True, slots=True)
class Fragment:
    """One retrieved fragment.

    Attributes:
        source_id: The source document's id.
        position: The fragment's position in its source (chunk index or offset).
        score: Retrieval score; higher first.
        text: The fragment's text.
    """

    source_id: str
    position: int
    score: float
    text: str


def order_fragments(fragments: Iterable[Fragment]) -> list[Fragment]:
    """Fragments by score (highest first), ties by source id and then position."""
    return sorted(fragments, key=lambda f: (-f.score, f.source_id, f.position))


def render_fragments(fragments: Sequence[Fragment], normalizer: Normalizer | None = None) -> str:
    """The retrieved context block, in the given order (see :func:`order_fragments`).

    The score is not rendered: two retrievals returning the same fragments in
    the same order then render the same bytes even when their scores differ.
    """
    norm = normalizer or _DEFAULT_NORMALIZER
    body = "\n".join(
        f'<retrieved source="{f.source_id}" position="{f.position}">\n{norm(f.text)}\n</retrieved>'
        for f in fragments
    )
    return f"<context>\n{body}\n</context>"


def rag_request(
    *,
    model: str,
    stable: StableLayer,
    fragments: Iterable[Fragment],
    question: str,
    normalizer: Normalizer | None = None,
    params: Mapping[str, Any] | None = None,
) -> AssembledRequest:
    """RAG in two layers: the stable layer, then ordered fragments, then the question.

    Args:
        model: Model name.
        stable: The stable layer (system message and tools).
        fragments: Retrieved fragments, in any order; they are ordered by
            :func:`order_fragments`.
        question: This call's question; it goes last.
        normalizer: Normalization rules and template version.
        params: Other body fields.
    """
    norm = normalizer or _DEFAULT_NORMALIZER
    context = render_fragments(order_fragments(fragments), norm)
    messages = [
        {"role": "system", "content": stable.render(norm)},
        {"role": "user", "content": f"{context}\n\n{norm(question)}"},
    ]
    return _assembled(model, messages, PrefixClass.RAG, norm, params, stable.tools)


class PinnedSession:
    """A multi-turn session pinned to one retrieved set.

    The set is ordered once (:func:`order_fragments`) when the session starts
    and never changes; the first user message holds it, and every turn appends
    (question, then the answer recorded with :meth:`answer`). Invariant: the
    messages of turn ``n`` are a prefix of the messages of turn ``n+1``.
    """

    __slots__ = ("_context", "_messages", "_norm", "_pending", "model", "params", "stable")

    def __init__(
        self,
        *,
        model: str,
        stable: StableLayer,
        fragments: Iterable[Fragment],
        normalizer: Normalizer | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.stable = stable
        self.params = dict(params or {})
        self._norm = normalizer or _DEFAULT_NORMALIZER
        self._messages: list[dict[str, Any]] = [
            {"role": "system", "content": stable.render(self._norm)}
        ]
        self._context = render_fragments(order_fragments(fragments), self._norm)
        self._pending = False

    @property
    def messages(self) -> tuple[dict[str, Any], ...]:
        """The messages so far (copies are made by :meth:`ask`)."""
        return tuple(self._messages)

    def ask(self, question: str) -> AssembledRequest:
        """The body for the next question; record the reply with :meth:`answer` before the next."""
        if self._pending:
            raise ValueError("answer() the previous question before asking the next one")
        q = self._norm(question)
        first = len(self._messages) == 1
        self._messages.append(
            {"role": "user", "content": f"{self._context}\n\n{q}" if first else q}
        )
        self._pending = True
        return _assembled(
            self.model,
            [dict(m) for m in self._messages],
            PrefixClass.SESSION,
            self._norm,
            self.params,
            self.stable.tools,
        )

    def answer(self, text: str) -> None:
        """Append the assistant's reply to the last question (as returned, not normalized)."""
        if not self._pending:
            raise ValueError("no question is waiting for an answer")
        self._messages.append({"role": "assistant", "content": text})
        self._pending = False
