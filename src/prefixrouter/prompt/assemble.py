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

How a body becomes one prompt text is :mod:`.render`'s; how its prefix class
is inferred, :mod:`.classify`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.classify import PREFIX_CLASS_HEADER
from prefixrouter.prompt.normalize import Normalizer, canonical_json

TEMPLATE_VERSION_HEADER = "X-Prompt-Template"


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
