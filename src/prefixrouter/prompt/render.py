"""Chat messages -> one prompt text, as the engine sees it (ChatML), with spans.

The one renderer of the project. The gateway hashes its text (text mode) or
encodes it (token mode with the project's tokenizer), the linter and the log
analyzer read its spans, and :mod:`prefixrouter.tokenization` serves it as the
project model's chat template (its Jinja twin, ``CHAT_TEMPLATE_JINJA``, is
tested equal to it). The format is that of the bundled model's template::

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

* ``content`` may be a string, null (``""``) or a list of parts, joined with
  ``\\n`` as vLLM joins them for a string template; a text part is its
  text (:data:`TEXT_PART_FIELDS`: a ``refusal`` part's ``refusal``); any
  other part (an image) becomes ``<{type}:{hash}>``, the hash of its
  canonical JSON, so equal parts render equally and different ones do not (a
  text-only template refuses them instead);
* an assistant's ``tool_calls`` follow its content, one
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` each,
  separated by newlines; ``arguments`` (JSON text or an object) is written as
  JSON with its keys in their order, ``{}`` when it is not a JSON object (what
  vLLM hands the template);
* ``tools`` (when non-empty), one canonical JSON object a line with null
  fields left out (vLLM sends absent fields as null), form a ``# Tools``
  section appended to the first system message (inserted if there is none);
* the generation prompt ``<|im_start|>assistant\\n`` ends the text.

How strictly it reads the messages is a :class:`RenderRules`:
:data:`LENIENT` (never raises: anything unreadable becomes a deterministic
placeholder, so a log of any shape can be analyzed), :data:`GATEWAY` (any
non-empty role, as vLLM; content types; errors name the field: :class:`PromptError`) and
:data:`TEMPLATE` (the text-only chat template's rules: any role, text parts
only, well-formed tool calls and tools).

Every message's content has a :class:`MessageSpan` (character range in the
text), and the :class:`RenderedPrompt` says where the per-call tail begins
(:attr:`RenderedPrompt.tail_start`), computed on first use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The roles of OpenAI chat messages. The gateway takes any non-empty role
(vLLM hands any role to the template: Llama's ``ipython``, a ``narrator``)."""
HISTORY_ROLES = frozenset({"assistant", "tool", "function"})
"""Roles of earlier turns: content already fixed when the next user turn is written.
A role outside OpenAI's (``ipython``, ``narrator``) is read as one too: it is
neither the instructions nor the user's question."""
SYSTEM_ROLES = frozenset({"system", "developer"})
TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content part types vLLM reads as text, and the field holding the text
(``{"type": "refusal", "refusal": ...}``); a part without ``type`` is ``text``.
Any other part (``image_url``, ``input_audio``, ``video_url``, ``file``) is media."""
TEXT_PART_TYPES = frozenset(TEXT_PART_FIELDS)

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
"""Markers of retrieved context in a prompt (what
:func:`~prefixrouter.prompt.assemble.render_fragments` writes, and the common
conventions); the retrieved layer is variable, so the stable part ends before
it. Literal and case-sensitive: ``str.find`` is an order of magnitude faster
than a regex."""


class PromptError(ValueError):
    """A malformed request body or message; names the field.

    Attributes:
        field: Dotted path of the offending field (``messages[2].role``), ``""`` for the body.
        message: What is wrong with it.
        code: ``invalid_field`` or ``missing_field`` (the gateway's OpenAI error code).

    ``str()`` of it is ``field: message`` (``message`` alone without a field),
    unless ``text`` gives the whole line (a template's own words).
    """

    def __init__(
        self, field: str, message: str, code: str = "invalid_field", *, text: str | None = None
    ) -> None:
        super().__init__(text if text is not None else f"{field}: {message}" if field else message)
        self.field = field
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class RenderRules:
    """How strictly :func:`render_chat` reads messages.

    Attributes:
        strict: Raise :class:`PromptError` on a malformed message (else render a placeholder).
        roles: Strict: the accepted roles (None: any non-empty string).
        text_only: Strict: content parts, tool calls and tools as a text-only
            chat template takes them; anything else is refused, not rendered.
    """

    strict: bool
    roles: frozenset[str] | None = None
    text_only: bool = False


LENIENT = RenderRules(strict=False)
GATEWAY = RenderRules(strict=True)
TEMPLATE = RenderRules(strict=True, text_only=True)


@dataclass(slots=True)
class MessageSpan:
    """Where one message's content lies in the rendered prompt.

    Treat as read-only. (Not a frozen dataclass: one is made per message of
    every request, and a frozen dataclass's ``__init__`` costs twice as much.)

    Attributes:
        index: Index in ``messages`` (-1: the tool definitions, -2: a completion prompt).
        role: The message role (``tools`` / ``prompt`` for the two special spans).
        start: Offset of the content's first character.
        end: Offset just past the content (tool calls included).
    """

    index: int
    role: str
    start: int
    end: int

    @property
    def path(self) -> str:
        """``messages[i].content``, ``tools`` or ``prompt``."""
        return f"messages[{self.index}].content" if self.index >= 0 else self.role


class RenderedPrompt:
    """A prompt text with the spans of the messages it was rendered from.

    Attributes:
        text: The prompt as the engine sees it.
        spans: Content span of every message (and of the tool definitions), in text order.
    """

    __slots__ = ("_live", "_tail", "spans", "text")

    def __init__(
        self,
        text: str,
        spans: tuple[MessageSpan, ...],
        tail_start: int | None = None,
        live: tuple[MessageSpan, ...] | None = None,
    ) -> None:
        self.text = text
        self.spans = spans
        self._tail = tail_start
        self._live = live

    def __repr__(self) -> str:
        return f"RenderedPrompt({len(self.text)} chars, {len(self.spans)} spans)"

    @property
    def tail_start(self) -> int:
        """Where the per-call tail begins: the retrieved context, or else the
        last paragraph of the last message if it is the user's (where builders
        put the question). Content before it is expected to be stable."""
        if self._tail is None:
            self._tail = _tail_start(self)
        return self._tail

    @property
    def live(self) -> tuple[MessageSpan, ...]:
        """The spans written for this call (system, tools, last user message,
        a completion prompt); earlier turns are history, already fixed, and so
        is a message of a role outside OpenAI's (:data:`HISTORY_ROLES`)."""
        if self._live is None:
            chat = [s for s in self.spans if s.index >= 0]
            last_user = max((s.index for s in chat if s.role == "user"), default=-1)
            self._live = tuple(
                s
                for s in self.spans
                if s.index < 0
                or s.role in SYSTEM_ROLES
                or (s.role == "user" and s.index == last_user)
            )
        return self._live

    def content(self, span: MessageSpan) -> str:
        """The text of one span."""
        return self.text[span.start : span.end]

    def span_at(self, pos: int) -> MessageSpan | None:
        """The content span holding ``pos``, if any."""
        for s in self.spans:
            if s.start <= pos < s.end:
                return s
        return None


def find_rag_marker(text: str, start: int = 0, end: int | None = None) -> int:
    """Offset of the first :data:`RAG_MARKERS` marker in ``text[start:end]``, or -1."""
    stop = len(text) if end is None else end
    best = -1
    for marker in RAG_MARKERS:
        # Only an earlier match can improve on ``best``: bound the search there.
        i = text.find(marker, start, best + len(marker) - 1 if best >= 0 else stop)
        if i >= 0:
            best = i
    return best


def _tail_start(prompt: RenderedPrompt) -> int:
    text = prompt.text
    chat = [s for s in prompt.spans if s.index != -1]
    last = chat[-1] if chat else None
    if last is None:
        tail = len(text)
    elif last.role in ("user", "prompt"):
        cut = text.rfind("\n\n", last.start, last.end)
        tail = cut + 2 if cut >= 0 else last.start
    else:
        tail = last.start
    rag = find_rag_marker(text)
    return min(tail, rag) if rag >= 0 else tail


# ---------------------------------------------------------------------------- pieces


def json_text(value: Any) -> str:
    """Sorted keys, ``", "`` / ``": "``, no ASCII escaping: the chat template's canonical JSON."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def _placeholder(part: Any) -> str:
    """``<{type}:{hash}>`` of a part that is not text (the hash of its canonical JSON)."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    # json, not orjson: any JSON value hashes (orjson refuses integers past 64 bits).
    digest = xxhash.xxh3_64_hexdigest(json_text(part).encode("utf-8", "surrogatepass"))
    return f"<{kind if isinstance(kind, str) else 'part'}:{digest}>"


def content_parts(content: Any, where: str, rules: RenderRules = TEMPLATE) -> list[str]:
    """The texts of a message's ``content``, one per part (null: none; a string: one).

    Args:
        content: The ``content`` field.
        where: Its path, for errors (``messages[3].content``).
        rules: Strict rules raise on what they refuse; otherwise a part that
            is not text becomes a placeholder (see the module docstring).

    Raises:
        PromptError: Strict rules and content they refuse.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        if rules.strict:
            raise PromptError(where, "must be a string, a list of content parts or null")
        return [json_text(content)]
    texts: list[str] = []
    add = texts.append
    for i, part in enumerate(content):
        if isinstance(part, str):
            add(part)
        elif not isinstance(part, Mapping):
            if rules.text_only:
                raise PromptError(f"{where}[{i}]", "a content part must be an object")
            add(_placeholder(part))
        elif rules.text_only:
            kind = part.get("type", "text")
            field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
            if field is None:
                raise PromptError(
                    f"{where}[{i}].type",
                    f"unsupported content part {kind!r} (this model is text only)",
                )
            text = part.get(field)
            if not isinstance(text, str):
                raise PromptError(f"{where}[{i}].{field}", "must be a string")
            add(text)
        else:
            text = part_text(part)
            add(text if text is not None else _placeholder(part))
    return texts


def part_text(part: Mapping[str, Any]) -> str | None:
    """The text of a content part vLLM reads as text (:data:`TEXT_PART_FIELDS`), else None."""
    kind = part.get("type", "text")
    field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
    text = part.get(field) if field is not None else None
    return text if isinstance(text, str) else None


def is_media_part(part: Any) -> bool:
    """A content part that is an object of a type vLLM does not read as text (an image...)."""
    if not isinstance(part, Mapping):
        return False
    kind = part.get("type", "text")
    return not (isinstance(kind, str) and kind in TEXT_PART_FIELDS)


def first_media_message(messages: Sequence[Any]) -> int | None:
    """Index of the first message with a media content part (:func:`is_media_part`), else None.

    Token mode routes such a request on the prompt rendered before that
    message's content: everything up to there is text the template renders in
    order, so the engine's prefix too, while where the media's tokens go inside
    the message is the engine's choice (vLLM's string content format puts the
    placeholders ahead of the message's text, the OpenAI one where the part is).
    """
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping):
            content = msg.get("content")
            if isinstance(content, list) and any(is_media_part(p) for p in content):
                return i
    return None


def content_text(content: Any, where: str = "content", rules: RenderRules = TEMPLATE) -> str:
    """The text of a message's ``content``: its parts (:func:`content_parts`) joined by newlines.

    Raises:
        PromptError: Strict rules and content they refuse.
    """
    if isinstance(content, str):
        return content
    return "\n".join(content_parts(content, where, rules))


def tool_call_function(call: Any, where: str) -> Mapping[str, Any]:
    """A tool call's ``function`` (checked: an object with a string ``name``).

    Raises:
        PromptError: It is not.
    """
    if not isinstance(call, Mapping):
        raise PromptError(where, "a tool call must be an object")
    fn = call.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise PromptError(f"{where}.function.name", "must be a string")
    return fn


def tool_call_arguments(fn: Mapping[str, Any]) -> Mapping[str, Any]:
    """A tool call's ``arguments`` as vLLM hands them to the template.

    OpenAI's JSON text is parsed to an object (keys in their order); anything
    that is not an object (empty, malformed, a list, a number) becomes ``{}``.
    """
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            args = {}
    return args if isinstance(args, Mapping) else {}


def _tool_call_text(call: Any, where: str, rules: RenderRules) -> str:
    try:
        fn = tool_call_function(call, where)
    except PromptError:
        if rules.text_only:
            raise
        return json_text(call)  # malformed: still rendered, deterministically
    args_text = json.dumps(tool_call_arguments(fn), ensure_ascii=False)
    return (
        f'<tool_call>\n{{"name": {json_text(fn["name"])}, "arguments": {args_text}}}\n</tool_call>'
    )


def _tool_calls_text(calls: Any, where: str, rules: RenderRules) -> list[str]:
    if not isinstance(calls, list):
        if rules.text_only:
            raise PromptError(where, "must be a list")
        return [json_text(calls)]
    return [_tool_call_text(c, f"{where}[{j}]", rules) for j, c in enumerate(calls)]


def tools_section(tools: Sequence[Any], rules: RenderRules = TEMPLATE) -> str:
    """The ``# Tools`` section: one canonical JSON object a line, null fields left out.

    Raises:
        PromptError: Text-only rules and a tool that is not an object.
    """
    lines = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            if rules.text_only:
                raise PromptError(f"tools[{i}]", "must be an object")
            lines.append(json_text(tool))
            continue
        # Null fields are dropped (vLLM sends every field, absent ones as null).
        tool = {k: v for k, v in tool.items() if v is not None}
        fn = tool.get("function")
        if isinstance(fn, Mapping):
            tool["function"] = {k: v for k, v in fn.items() if v is not None}
        lines.append(json_text(tool))
    return "# Tools\n\n<tools>\n" + "\n".join(lines) + "\n</tools>"


def _role(msg: Mapping[str, Any], where: str, rules: RenderRules) -> str:
    role = msg.get("role")
    if not rules.strict:
        return str(role or "user")
    if role is None:
        raise PromptError(f"{where}.role", "missing required field", "missing_field")
    if not isinstance(role, str) or not role:
        raise PromptError(f"{where}.role", "must be a non-empty string")
    if rules.roles is not None and role not in rules.roles:
        raise PromptError(f"{where}.role", f"unknown role {role!r}")
    return role


# ---------------------------------------------------------------------------- render


def render_chat(
    messages: Sequence[Any],
    tools: Sequence[Any] | None = None,
    rules: RenderRules = LENIENT,
    *,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Render chat messages to the prompt text the engine sees, with content spans.

    One pass over the messages; long contents are not copied until the final
    join. The rules are in the module docstring.

    Args:
        messages: Chat messages (``role``, ``content``, optional ``tool_calls``).
        tools: OpenAI tool definitions, if any.
        rules: How strictly to read them (:data:`LENIENT`, :data:`GATEWAY`, :data:`TEMPLATE`).
        add_generation_prompt: End with an open assistant turn.

    Returns:
        The prompt and the span of every message's content (and of the tools).

    Raises:
        PromptError: Strict rules and a message they refuse (names the field).
    """
    turns = _turns(messages, rules)
    section = tools_section(tools, rules) if tools else ""
    if section and (not turns or turns[0][1] != "system"):
        turns.insert(0, (-1, "system", ""))
    return _join(turns, section, add_generation_prompt)


def _turns(messages: Sequence[Any], rules: RenderRules) -> list[tuple[int, str, str]]:
    """(index, role, text) of each message (text: content, then tool calls)."""
    turns: list[tuple[int, str, str]] = []
    roles = rules.roles
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            if rules.strict:
                raise PromptError(f"messages[{i}]", "must be an object")
            continue
        role = msg.get("role")
        # The common case first (a known role); _role() says what is wrong otherwise.
        if not (isinstance(role, str) and role and (roles is None or role in roles)):
            role = _role(msg, f"messages[{i}]", rules)
        content = msg.get("content")
        text = (
            content
            if isinstance(content, str)
            else content_text(content, f"messages[{i}].content", rules)
        )
        calls = msg.get("tool_calls")
        if calls:
            rendered = _tool_calls_text(calls, f"messages[{i}].tool_calls", rules)
            text = "\n".join(([text] if text else []) + rendered)
        turns.append((i, role, text))
    return turns


def _join(
    turns: list[tuple[int, str, str]], section: str, add_generation_prompt: bool
) -> RenderedPrompt:
    """The ChatML text of the turns, the tools section closing the first, and their spans.

    Pieces are joined once at the end: no intermediate copy of long contents.
    """
    parts: list[str] = []
    spans: list[MessageSpan] = []
    pos = 0
    for k, (index, role, text) in enumerate(turns):
        head = f"{IM_START}{role}\n"
        start = pos + len(head)
        end = start + len(text)
        parts.append(head)
        if index >= 0:
            spans.append(MessageSpan(index, role, start, end))
        parts.append(text)
        if k == 0 and section:
            sep = "\n\n" if text else ""
            spans.append(MessageSpan(-1, "tools", end + len(sep), end + len(sep) + len(section)))
            parts.append(sep + section)
            end += len(sep) + len(section)
        parts.append(f"{IM_END}\n")
        pos = end + len(IM_END) + 1
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return RenderedPrompt("".join(parts), tuple(spans))


def completion_text(prompt: Any, strict: bool = True) -> str | None:
    """A completions ``prompt`` given as text: a string, or strings joined by newlines.

    Returns:
        The text; None for token ids (and, not strict, for anything else).

    Raises:
        PromptError: Strict, and a list that mixes strings with other values.
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if not all(isinstance(p, str) for p in prompt):
            if strict:
                raise PromptError(
                    "prompt", "a list prompt must hold only strings or only token ids"
                )
            return None
        return "\n".join(prompt)
    return None


def render_prompt_text(text: str) -> RenderedPrompt:
    """A completions prompt as a :class:`RenderedPrompt`: the text itself, one span."""
    return RenderedPrompt(text, (MessageSpan(-2, "prompt", 0, len(text)),))


def render_body(body: Mapping[str, Any]) -> RenderedPrompt:
    """Render any chat-completions or completions body, leniently (never raises).

    A completions body with a text prompt renders as that text; anything else
    through :func:`render_chat` with :data:`LENIENT` rules (a body without
    messages renders as the generation prompt alone).
    """
    text = completion_text(body.get("prompt"), strict=False)
    if text is not None:
        return render_prompt_text(text)
    messages = body.get("messages")
    tools = body.get("tools")
    return render_chat(
        messages if isinstance(messages, list) else [],
        tools if isinstance(tools, list) else None,
        LENIENT,
    )
