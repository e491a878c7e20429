"""An OpenAI request body -> what routing needs of it: the pure request path.

The gateway builds every request through here, and so does any other driver
that must see requests exactly as the gateway does (the simulator's text mode):
:func:`build_prompt_request` is the whole path, from a parsed body to model,
options, prompt text or token ids and prefix class; it reads nothing but its
arguments, and every malformed field raises :class:`PromptError` naming it
(the gateway answers it with an OpenAI-style 400, the same message).

Steps, in the order their errors are reported:

1. :func:`request_options`: the body is an object; ``model`` (a non-empty
   string); ``stream``, ``stream_options.include_usage`` (booleans);
   ``max_completion_tokens``, else ``max_tokens`` (each, when given, a
   positive integer), else the default (0: none given, the engine's own
   limit applies). The gateway validates its own fields (``cache_salt``, the
   tenant) between this step and the next.
2. :func:`build_prompt`: ``messages`` (a non-empty list, rendered with
   :data:`~prefixrouter.prompt.render.GATEWAY` rules, or, with a tokenizer,
   also the text-only template's) and ``tools`` (a list); or ``prompt`` (a
   string, a list of strings, token ids, or lists of token ids). Chat messages
   are always rendered once (:func:`~prefixrouter.prompt.render.render_chat`:
   the text, the spans the linter reads, the class); in *text mode* (no
   tokenizer) that text is the prompt; in *token mode* its token ids are
   (the model's own template renders it instead when it has one). A
   completions prompt given as token ids is used as tokens in either mode.
   Then the prefix class: the ``X-Prefix-Class`` value if given, else
   :func:`~prefixrouter.prompt.classify.classify`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.classify import (
    DEFAULT_PARAMS,
    ClassifierParams,
    classify,
    classify_tokens,
    parse_prefix_class,
)
from prefixrouter.prompt.render import (
    GATEWAY,
    OPENAI_ROLES,
    PromptError,
    RenderedPrompt,
    RenderRules,
    completion_text,
    render_chat,
    render_prompt_text,
)

CHAT = "chat"
COMPLETIONS = "completions"
DEFAULT_MAX_TOKENS = 0
"""The ``max_tokens`` of a body that gives none: 0, no cap (what such requests
decode is learned from their answers, :class:`~prefixrouter.core.output.OutputEstimate`)."""
TOKEN_MODE_RULES = RenderRules(strict=True, roles=OPENAI_ROLES, text_only=True)
"""Token mode: the gateway's roles and the text-only template's content rules."""
MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32
_CHECK_SLICE = 32_768  # ids checked per step: about 1.5 ms of C loops


class ChatTokenizer(Protocol):
    """What token mode needs from a tokenizer (:class:`prefixrouter.tokenization.Tokenizer`)."""

    revision: str

    @property
    def renders_chatml(self) -> bool:
        """Its chat template is the project's ChatML: the rendered text is its prompt."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completions prompt (with the tokenizer's special tokens, as vLLM)."""
        ...

    def apply_chat_template(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None
    ) -> str:
        """The prompt text of chat messages (the model's own template)."""
        ...


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The body's fields other than the prompt.

    Attributes:
        model: The requested model.
        stream: The client asked for a stream.
        wants_usage: The client asked for the usage chunk (``stream_options.include_usage``).
        max_tokens: The client's cap on the output; 0 when it sent none (the
            router learns what such requests decode, :mod:`prefixrouter.core.output`).
    """

    model: str
    stream: bool
    wants_usage: bool
    max_tokens: int


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """The prompt of a request, as routing sees it.

    Attributes:
        text: Text mode: the prompt text (hashed in character chunks); None in token mode.
        tokens: Token mode, or a completions prompt of token ids: the ids.
        rendered: The rendered prompt with its message spans (None for token ids).
        prefix_class: Stated (``X-Prefix-Class``) or inferred.
        first_user_text: The text of the first user message (chat), else None.
    """

    text: str | None
    tokens: Sequence[int] | None
    rendered: RenderedPrompt | None
    prefix_class: PrefixClass
    first_user_text: str | None

    @property
    def text_chars(self) -> int:
        """Characters of the text-mode prompt (0 in token mode): with the
        engine's ``prompt_tokens`` they teach the characters-per-token estimate."""
        return len(self.text) if self.text is not None else 0


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """A validated request body: its options and its prompt."""

    options: RequestOptions
    prompt: BuiltPrompt


def build_prompt_request(
    body: Any,
    kind: str,
    *,
    tokenizer: ChatTokenizer | None = None,
    classifier: ClassifierParams = DEFAULT_PARAMS,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    prefix_class: str | None = None,
) -> PromptRequest:
    """The whole request path: a parsed body -> options and prompt.

    Args:
        body: The parsed JSON body (not modified).
        kind: :data:`CHAT` (``/v1/chat/completions``) or :data:`COMPLETIONS`.
        tokenizer: Token mode's tokenizer; None: text mode.
        classifier: Thresholds and markers of the inferred prefix class.
        default_max_tokens: The cap taken when the body gives none (0: none).
        prefix_class: A stated class (the ``X-Prefix-Class`` header), if any.

    Raises:
        PromptError: A malformed field (names it; see the module docstring for the order).
    """
    options = request_options(body, default_max_tokens)
    return PromptRequest(options, build_prompt(body, kind, tokenizer, classifier, prefix_class))


def request_options(body: Any, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> RequestOptions:
    """Step 1: the body is an object, and its model and options.

    Raises:
        PromptError: Naming the field.
    """
    if not isinstance(body, dict):
        raise PromptError("", "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise PromptError("model", "missing required field", "missing_field")
    if not isinstance(model, str) or not model:
        raise PromptError("model", "must be a non-empty string")
    stream, wants_usage = _stream_flags(body)
    return RequestOptions(model, stream, wants_usage, _max_tokens(body, default_max_tokens))


def build_prompt(
    body: Mapping[str, Any],
    kind: str,
    tokenizer: ChatTokenizer | None = None,
    classifier: ClassifierParams = DEFAULT_PARAMS,
    prefix_class: str | None = None,
) -> BuiltPrompt:
    """Step 2: the prompt of a body that passed :func:`request_options`.

    Raises:
        PromptError: Naming the field.
    """
    if kind == CHAT:
        return _chat_prompt(body, tokenizer, classifier, prefix_class)
    return _completion_prompt(body.get("prompt"), tokenizer, classifier, prefix_class)


def _chat_prompt(
    body: Mapping[str, Any],
    tokenizer: ChatTokenizer | None,
    classifier: ClassifierParams,
    stated: str | None,
) -> BuiltPrompt:
    messages = body.get("messages")
    if messages is None:
        raise PromptError("messages", "missing required field", "missing_field")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages", "must be a non-empty list of message objects")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise PromptError("tools", "must be a list of tool objects")
    rendered = render_chat(messages, tools, GATEWAY if tokenizer is None else TOKEN_MODE_RULES)
    text: str | None = rendered.text
    tokens: list[int] | None = None
    if tokenizer is not None:
        tokens = _chat_tokens(tokenizer, rendered, messages, tools)
        text = None
    cls = parse_prefix_class(stated, strict=True) or classify(rendered, classifier)
    first = next((s for s in rendered.spans if s.role == "user"), None)
    first_user: str | None = None
    if first is not None:
        content = messages[first.index].get("content")
        # The message's own string when it is one: a long content is not copied.
        first_user = content if isinstance(content, str) else rendered.content(first)
    return BuiltPrompt(text, tokens, rendered, cls, first_user)


def _chat_tokens(
    tokenizer: ChatTokenizer, rendered: RenderedPrompt, messages: list[Any], tools: Any
) -> list[int]:
    if tokenizer.renders_chatml:
        return tokenizer.encode(rendered.text)
    try:
        prompt = tokenizer.apply_chat_template(messages, tools)
    except PromptError:
        raise
    except ValueError as exc:  # a template's error names the field: "messages[2].role: ..."
        msg = str(exc)
        field = msg.split(":", 1)[0] if ":" in msg else "messages"
        raise PromptError(field, msg, text=msg) from None
    return tokenizer.encode(prompt)


def _completion_prompt(
    prompt: Any, tokenizer: ChatTokenizer | None, classifier: ClassifierParams, stated: str | None
) -> BuiltPrompt:
    text, tokens = completion_prompt(prompt)
    rendered = render_prompt_text(text) if text is not None else None
    if text is not None and tokenizer is not None:
        tokens, text = tokenizer.encode_prompt(text), None
    cls = parse_prefix_class(stated, strict=True)
    if cls is None:
        if rendered is not None:
            cls = classify(rendered, classifier)
        else:
            cls = classify_tokens(tokens or (), classifier)
    return BuiltPrompt(text, tokens, rendered, cls, None)


def completion_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """A completions ``prompt`` as (text, None) or (None, token ids).

    Raises:
        PromptError: Naming ``prompt`` or ``prompt[i]``.
    """
    if prompt is None:
        raise PromptError("prompt", "missing required field", "missing_field")
    text = completion_text(prompt)
    if text is not None:
        return text, None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            if not token_ids_ok(prompt):
                raise PromptError("prompt", "token ids must be integers in [0, 2^32)")
            return None, prompt
        if isinstance(first, list):
            flat: list[int] = []
            for i, seq in enumerate(prompt):
                if not isinstance(seq, list) or not token_ids_ok(seq):
                    raise PromptError(f"prompt[{i}]", "must be a list of token ids in [0, 2^32)")
                flat.extend(seq)
            return None, flat
    raise PromptError("prompt", "must be a string, a list of strings or a list of token ids")


def token_ids_ok(seq: list[Any], slice_size: int = _CHECK_SLICE) -> bool:
    """Every element an ``int`` (not ``bool``) in ``[0, 2^32)``.

    Checked in slices with C loops (``map(type)``, ``min``, ``max``) rather
    than one generator: a million ids took 120 ms of bytecode on the gateway's
    parse thread, and its event loop waited for the GIL meanwhile; slices of
    C loops take a third of that and give the GIL back between slices.
    """
    for lo in range(0, len(seq), slice_size):
        part = seq[lo : lo + slice_size]
        if set(map(type, part)) != {int} or min(part) < 0 or max(part) > MAX_TOKEN_ID:
            return False
    return True


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise PromptError("stream", "must be a boolean")
    opts = body.get("stream_options")
    wants_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise PromptError("stream_options", "must be an object")
        inc = opts.get("include_usage", False)
        if not isinstance(inc, bool):
            raise PromptError("stream_options.include_usage", "must be a boolean")
        wants_usage = inc
    return stream, wants_usage


def _max_tokens(body: Mapping[str, Any], default: int) -> int:
    # Both are checked (vLLM validates both), the first given one counts.
    found: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PromptError(name, "must be a positive integer")
        if found is None:
            found = value
    return default if found is None else found
