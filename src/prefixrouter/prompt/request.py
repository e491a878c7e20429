"""An OpenAI request body -> what routing needs of it: the pure request path.

The gateway builds every request through here, and so does any other driver
that must see requests exactly as the gateway does (the simulator's text mode):
:func:`build_prompt_request` is the whole path, from a parsed body to model,
options, prompt text or token ids and prefix class; it reads nothing but its
arguments, and every malformed field raises :class:`PromptError` naming it
(the gateway answers it with an OpenAI-style 400, the same message).

Steps, in the order their errors are reported:

1. :func:`request_options`: the body is an object; ``model`` (a non-empty
   string; absent or null: the one served model, if exactly one is);
   ``stream``, ``stream_options.include_usage`` (booleans, null as absent);
   ``max_completion_tokens``, else ``max_tokens`` (each, when given, a
   positive integer, ``3.0`` taken as 3), else the default (0: none given,
   the engine's own limit applies). The gateway validates its own fields
   (``cache_salt``, the tenant) between this step and the next.
2. :func:`build_prompt`: ``messages`` (a non-empty list, rendered with
   :data:`~prefixrouter.prompt.render.GATEWAY` rules, or, with a tokenizer,
   also the text-only template's), ``tools`` (a list) and the fields that
   change the rendered prompt (:func:`template_options`); or ``prompt`` (a
   string, a list of strings, token ids, or lists of token ids: a batch is
   routed on its first element). Chat messages are always rendered once
   (:func:`~prefixrouter.prompt.render.render_chat`: the text, the spans the
   linter reads, the class); in *text mode* (no tokenizer) that text is the
   prompt, and the template fields, when set, go into its key
   (:attr:`TemplateOptions.key`); in *token mode* its token ids are (the
   model's own template, or the request's, renders it instead when there is
   one or a template field is set; a prompt with media only up to the first
   message holding it). A completions prompt given as token ids is used as
   tokens in either mode. Then the prefix class: the ``X-Prefix-Class`` value
   if given, else :func:`~prefixrouter.prompt.classify.classify`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
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
    PromptError,
    RenderedPrompt,
    RenderRules,
    completion_text,
    first_media_message,
    is_media_part,
    json_text,
    render_chat,
    render_prompt_text,
)

CHAT = "chat"
COMPLETIONS = "completions"
DEFAULT_MAX_TOKENS = 0
"""The ``max_tokens`` of a body that gives none: 0, no cap (what such requests
decode is learned from their answers, :class:`~prefixrouter.core.output.OutputEstimate`)."""
TOKEN_MODE_RULES = RenderRules(strict=True, text_only=True)
"""Token mode: any non-empty role (as vLLM) and the text-only template's content
rules (a prompt with media is rendered only before it, :func:`_chat_tokens`)."""
SERVED_MODELS_NAMED = 5
"""Served models a "model is required" error names (the first few, sorted)."""
_CUT = "\x00prefixrouter-media\x00"
"""Stands in for the content of the first message with media when token mode
renders the prompt before it: a string no template writes and no client sends."""
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
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Sequence[Any] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of chat messages (the model's own template)."""
        ...


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """A chat request's fields that change the rendered prompt besides its messages and tools.

    vLLM's ``ChatCompletionRequest`` fields of these names (``variables`` is
    ``chat_template_kwargs``); :func:`template_options` reads them.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[Any] | None = None
    variables: dict[str, Any] | None = None
    chat_template: str | None = None

    @property
    def key(self) -> str:
        """Canonical JSON (sorted keys) of the fields set to other than their
        defaults; ``""`` when none is. Text mode folds it into the cache
        namespace: two different values never share a prefix key, and a
        request that sets none keeps the key it always had."""
        changed: dict[str, Any] = {}
        if not self.add_generation_prompt:
            changed["add_generation_prompt"] = False
        if self.continue_final_message:
            changed["continue_final_message"] = True
        if self.documents:
            changed["documents"] = self.documents
        if self.variables:
            changed["chat_template_kwargs"] = self.variables
        if self.chat_template is not None:
            changed["chat_template"] = self.chat_template
        return json_text(changed) if changed else ""

    @property
    def request_template_key(self) -> str:
        """Token mode's key: the request's own ``chat_template`` alone (canonical
        JSON; ``""`` when it brings none).

        Token mode renders the other fields into the tokens, but not a template
        the request brings: compiling a client's Jinja in the gateway, once per
        request that varies it, is a CPU and sandbox surface for a request vLLM
        refuses unless started with ``--trust-request-chat-template``. Its
        tokens are the model's template's, and its prefix is kept apart.
        """
        if self.chat_template is None:
            return ""
        return json_text({"chat_template": self.chat_template})


DEFAULT_TEMPLATE_OPTIONS = TemplateOptions()


def template_options(body: Mapping[str, Any]) -> TemplateOptions:
    """The body's :class:`TemplateOptions` (null: the default, as absent).

    Raises:
        PromptError: A field of the wrong type (vLLM answers those 400 too).
    """
    if not any(name in body for name in _TEMPLATE_FIELDS):
        return DEFAULT_TEMPLATE_OPTIONS  # the common case, one probe per field
    gen = _flag(body, "add_generation_prompt", True)
    cont = _flag(body, "continue_final_message", False)
    docs = body.get("documents")
    if docs is not None and not (isinstance(docs, list) and all(isinstance(d, dict) for d in docs)):
        raise PromptError("documents", "must be a list of objects")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PromptError("chat_template_kwargs", "must be an object")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise PromptError("chat_template", "must be a string")
    return TemplateOptions(gen, cont, docs or None, kwargs or None, template)


_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template_kwargs",
    "chat_template",
)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PromptError(name, "must be a boolean")
    return value


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The body's fields other than the prompt.

    Attributes:
        model: The requested model.
        stream: The client asked for a stream.
        wants_usage: ``stream_options.include_usage`` as the client sent it:
            True or False, or None for ``stream_options`` without it (the
            engine's default, :func:`_stream_flags`); False also when it
            sent no ``stream_options``.
        max_tokens: The client's cap on the output; 0 when it sent none (the
            router learns what such requests decode, :mod:`prefixrouter.core.output`).
    """

    model: str
    stream: bool
    wants_usage: bool | None
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
        template_key: What the namespace folds in of the template fields
            (``""``: none): text mode :attr:`TemplateOptions.key`; token mode,
            which renders the rest into the tokens,
            :attr:`TemplateOptions.request_template_key`.
        batch_chars: A batch of completions prompts in text mode: the
            characters of all of them (``text`` is the first one's); else 0.
        batch_tokens: A batch in token mode: the tokens of all of them
            (``tokens`` are the first one's); else 0.
    """

    text: str | None
    tokens: Sequence[int] | None
    rendered: RenderedPrompt | None
    prefix_class: PrefixClass
    first_user_text: str | None
    template_key: str = ""
    batch_chars: int = 0
    batch_tokens: int = 0

    @property
    def text_chars(self) -> int:
        """Characters of the text-mode prompt (0 in token mode), a batch's all:
        with the engine's ``prompt_tokens`` (the batch's sum) they teach the
        characters-per-token estimate."""
        if self.batch_chars:
            return self.batch_chars
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
    served_models: Callable[[], Collection[str]] = frozenset,
) -> PromptRequest:
    """The whole request path: a parsed body -> options and prompt.

    Args:
        body: The parsed JSON body (not modified).
        kind: :data:`CHAT` (``/v1/chat/completions``) or :data:`COMPLETIONS`.
        tokenizer: Token mode's tokenizer; None: text mode.
        classifier: Thresholds and markers of the inferred prefix class.
        default_max_tokens: The cap taken when the body gives none (0: none).
        prefix_class: A stated class (the ``X-Prefix-Class`` header), if any.
        served_models: The models served (:func:`request_options`).

    Raises:
        PromptError: A malformed field (names it; see the module docstring for the order).
    """
    options = request_options(body, default_max_tokens, served_models)
    return PromptRequest(options, build_prompt(body, kind, tokenizer, classifier, prefix_class))


def request_options(
    body: Any,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    served_models: Callable[[], Collection[str]] = frozenset,
) -> RequestOptions:
    """Step 1: the body is an object, and its model and options.

    ``model`` absent or null is the served model when exactly one is served
    (``served_models()``, asked only then), as vLLM serves a request without
    one with its own model; with several served it is a 400 naming the first
    few (:data:`SERVED_MODELS_NAMED`), with none the plain "missing".

    Raises:
        PromptError: Naming the field.
    """
    if not isinstance(body, dict):
        raise PromptError("", "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = _served_model(served_models())
    elif not isinstance(model, str) or not model:
        raise PromptError("model", "must be a non-empty string")
    stream, wants_usage = _stream_flags(body)
    return RequestOptions(model, stream, wants_usage, _max_tokens(body, default_max_tokens))


def _served_model(served: Collection[str]) -> str:
    if len(served) == 1:
        return next(iter(served))
    if not served:
        raise PromptError("model", "missing required field", "missing_field")
    names = sorted(served)
    shown = ", ".join(names[:SERVED_MODELS_NAMED])
    more = len(names) - SERVED_MODELS_NAMED
    if more > 0:
        shown += f" and {more} more"
    raise PromptError(
        "model",
        f"missing required field: {len(names)} models are served ({shown}); name one",
        "missing_field",
    )


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
    options = template_options(body)
    text: str | None = None
    tokens: list[int] | None = None
    if tokenizer is None:
        rendered = render_chat(messages, tools, GATEWAY)
        text = rendered.text
    else:
        media = first_media_message(messages)
        # With media the spans come from the placeholder rendering (what text
        # mode hashes): the classifier and the linter read text, not tokens.
        rendered = render_chat(messages, tools, TOKEN_MODE_RULES if media is None else GATEWAY)
        tokens = _chat_tokens(tokenizer, rendered, messages, tools, options, media)
    cls = parse_prefix_class(stated, strict=True) or classify(rendered, classifier)
    first = next((s for s in rendered.spans if s.role == "user"), None)
    first_user: str | None = None
    if first is not None:
        content = messages[first.index].get("content")
        # The message's own string when it is one: a long content is not copied.
        first_user = content if isinstance(content, str) else rendered.content(first)
    key = options.key if tokenizer is None else options.request_template_key
    return BuiltPrompt(text, tokens, rendered, cls, first_user, key)


def _chat_tokens(
    tokenizer: ChatTokenizer,
    rendered: RenderedPrompt,
    messages: list[Any],
    tools: Any,
    options: TemplateOptions,
    media: int | None,
) -> list[int]:
    """The prompt's token ids as the engine renders them (the options passed to the template).

    A prompt with media (``media``: the first message holding some) is
    rendered with that message's content replaced by a marker and cut there:
    its tokens are those of the text the template writes before it, the
    engine's prefix too (:func:`~prefixrouter.prompt.render.first_media_message`),
    less the last token, which may merge with what follows the cut. Media
    parts of later messages are left out of that rendering (it is cut before
    them). Only whole blocks of these tokens are hashed.
    """
    if options.add_generation_prompt and options.continue_final_message:
        # vLLM's own check (Hugging Face's template call refuses it too).
        raise PromptError(
            "continue_final_message", "cannot be true while add_generation_prompt is true"
        )
    if media is None and tokenizer.renders_chatml and not options.key:
        return tokenizer.encode(rendered.text)  # the same text, already rendered
    if media is not None:
        messages = [
            m if i < media else _text_only(m, _CUT if i == media else None)
            for i, m in enumerate(messages)
        ]
    try:
        prompt = tokenizer.apply_chat_template(
            messages,
            tools,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message and media is None,
            documents=options.documents,
            variables=options.variables,
        )
    except PromptError:
        raise
    except ValueError as exc:  # a template's error names the field: "messages[2].role: ..."
        msg = str(exc)
        field = msg.split(":", 1)[0] if ":" in msg else "messages"
        raise PromptError(field, msg, text=msg) from None
    if media is None:
        return tokenizer.encode(prompt)
    cut = prompt.find(_CUT)
    if cut < 0:  # the template did not write that message's content: no known prefix
        return []
    return tokenizer.encode(prompt[:cut])[:-1]


def _text_only(message: Any, content: str | None) -> Any:
    """A copy of a message with ``content`` instead of its own, or with its media parts left out."""
    if not isinstance(message, Mapping):
        return message
    if content is None:
        own = message.get("content")
        if not isinstance(own, list):
            return message
        return {**message, "content": [p for p in own if not is_media_part(p)]}
    return {**message, "content": content}


def _completion_prompt(
    prompt: Any, tokenizer: ChatTokenizer | None, classifier: ClassifierParams, stated: str | None
) -> BuiltPrompt:
    texts, seqs = completion_prompts(prompt)
    text = texts[0] if texts else None
    tokens = seqs[0] if seqs else None
    batch_chars = batch_tokens = 0
    rendered = render_prompt_text(text) if text is not None else None
    if texts and tokenizer is not None:
        seqs = [tokenizer.encode_prompt(t) for t in texts]
        tokens, text = seqs[0], None
    elif len(texts) > 1:
        batch_chars = sum(map(len, texts))
    if seqs and len(seqs) > 1:
        batch_tokens = sum(map(len, seqs))
    cls = parse_prefix_class(stated, strict=True)
    if cls is None:
        if rendered is not None:
            cls = classify(rendered, classifier)
        else:
            cls = classify_tokens(tokens or (), classifier)
    return BuiltPrompt(text, tokens, rendered, cls, None, "", batch_chars, batch_tokens)


def completion_prompts(prompt: Any) -> tuple[list[str], list[list[int]]]:
    """A completions ``prompt`` as its texts, or its token id sequences (the other list empty).

    One element for a string or a list of token ids; a list of strings or of
    token id lists is a batch, each element its own sequence on the engine
    (so routing keys on the first one's prefix, not on the elements joined).

    Raises:
        PromptError: Naming ``prompt`` or ``prompt[i]``.
    """
    if prompt is None:
        raise PromptError("prompt", "missing required field", "missing_field")
    if isinstance(prompt, str):
        return [prompt], []
    if completion_text(prompt) is not None:  # checks a list of strings holds only strings
        return list(prompt), []
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            if not token_ids_ok(prompt):
                raise PromptError("prompt", "token ids must be integers in [0, 2^32)")
            return [], [prompt]
        if isinstance(first, list):
            for i, seq in enumerate(prompt):
                if not isinstance(seq, list) or not token_ids_ok(seq):
                    raise PromptError(f"prompt[{i}]", "must be a list of token ids in [0, 2^32)")
            return [], prompt
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


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool | None]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise PromptError("stream", "must be a boolean")
    opts = body.get("stream_options")
    wants_usage: bool | None = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise PromptError("stream_options", "must be an object")
        inc = opts.get("include_usage")
        if inc is not None and not isinstance(inc, bool):
            raise PromptError("stream_options.include_usage", "must be a boolean")
        # Absent or null inside stream_options is the engine's default (None):
        # vLLM's is True (StreamOptions.include_usage), SGLang's and OpenAI's
        # False, so the client gets what the engine behind would give it
        # (BuiltRequest.usage_to_client). A client that sent no stream_options
        # at all (or include_usage false) has the gateway ask for the chunk
        # and keep it from the client.
        wants_usage = inc
    return stream, wants_usage


def _max_tokens(body: Mapping[str, Any], default: int) -> int:
    # Both are checked (vLLM validates both), the first given one counts.
    found: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        # An integral float (3.0) is the integer, as pydantic's lax mode in vLLM takes it.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PromptError(name, "must be a positive integer")
        if found is None:
            found = value
    return default if found is None else found
