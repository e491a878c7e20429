"""Request body -> :class:`~prefixrouter.core.types.RoutingRequest`.

One parse of the body (orjson, done by the caller), then:

* **validation**, naming the field: ``model``; ``messages`` (a non-empty list
  of objects with a string ``role`` and string / list / null ``content``) or
  ``prompt`` (string, list of strings, token ids, or lists of token ids);
  ``stream``, ``stream_options``, ``max_tokens``, ``max_completion_tokens``,
  ``tools``. Everything else passes through to the engine untouched.
* **the prompt**: in *text mode* the messages are rendered to deterministic
  text, tools first (chat templates put them in the system turn), then each
  message as ``<|role|>\\n{content}\\n``; images and other parts by a
  canonical JSON of the part. The router hashes it in character chunks and
  estimates tokens. In *token mode* the model's chat template and tokenizer
  give the exact token ids (:mod:`prefixrouter.tokenizer`). A completions
  prompt given as token ids is used as tokens in either mode.
* **the namespace**: model, tokenizer revision, adapter (a model name the
  workers list as a LoRA adapter, or SGLang's ``lora_path``), template version
  and the tenant's namespace (:mod:`prefixrouter.gateway.tenancy`).
* **the prefix class**: the ``X-Prefix-Class`` header, else inferred from the
  message structure: earlier assistant/tool turns -> ``session``; several
  retrieved passages (``[1]``/``[2]``, ``<document``, ``Source:``) -> ``rag``;
  a message of at least ``routing.document_chars`` -> ``document``; a system
  message or tools -> ``system``; otherwise ``unknown``.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol

import orjson

from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.types import CacheNamespace, PrefixClass, RequestId, RoutingRequest
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.errors import BadRequest
from prefixrouter.gateway.tenancy import TenantScope

CHAT = "chat"
COMPLETIONS = "completions"
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_HISTORY_ROLES = frozenset({"assistant", "tool", "function"})
_SYSTEM_ROLES = frozenset({"system", "developer"})
_PREFIX_CLASSES = {c.value: c for c in PrefixClass}
_NS_MEMO_MAX = 10_000


class ChatTokenizer(Protocol):
    """What token mode needs from a tokenizer (see :mod:`prefixrouter.tokenizer`)."""

    revision: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completions prompt (with the tokenizer's special tokens, as vLLM)."""
        ...

    def apply_chat_template(
        self, messages: Sequence[Any], tools: Sequence[Any] | None = None
    ) -> str:
        """The prompt text of chat messages."""
        ...


@dataclass(slots=True)
class BuiltRequest:
    """A validated request, ready to route and forward.

    Attributes:
        routing: What the router sees.
        body: The parsed body (forwarded as is unless a field must be set).
        raw: The body bytes as received.
        stream: The client asked for a stream.
        client_wants_usage: The client asked for the usage chunk itself.
        scope: The tenant and its cache scope.
        text_chars: Characters of the rendered prompt (text mode; 0 otherwise):
            with the engine's ``prompt_tokens`` they teach the estimator.
        model: The requested model.
        blocks: The prompt's block hashes, when hashed with the parse (large
            bodies, off the event loop); None: ``Router.route`` hashes it.
    """

    routing: RoutingRequest
    body: dict[str, Any]
    raw: bytes
    stream: bool
    client_wants_usage: bool
    scope: TenantScope
    text_chars: int
    model: str
    blocks: PromptBlocks | None = None


def _bad(field: str, message: str, code: str = "invalid_field") -> BadRequest:
    return BadRequest(f"{field}: {message}" if field else message, code=code, param=field or None)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string, a list of content parts or null")
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            out.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
    return "\n".join(out)


def render_messages(messages: list[Any], tools: list[Any] | None) -> tuple[str, str | None]:
    """Text mode: the deterministic prompt text of chat messages.

    Returns:
        (prompt text, text of the first user message or None)

    Raises:
        BadRequest: A malformed message (names ``messages[i].field``).
    """
    text, first_user, _ = _render_chat(messages, tools, 0)
    return text, first_user


def _render_chat(
    messages: list[Any], tools: list[Any] | None, document_chars: int, with_text: bool = True
) -> tuple[str, str | None, PrefixClass]:
    """Validate and render chat messages and infer their prefix class, in one pass.

    The same text as :func:`render_messages` and the same class as
    :func:`infer_prefix_class` (for validated messages): the gateway needs
    both for every chat request in text mode, and one walk over the messages
    is cheaper than two. Without ``with_text`` (token mode, where the chat
    template renders the prompt) the text is not built and ``""`` returned.
    """
    parts: list[str] = []
    add = parts.append
    if tools and with_text:
        add("<|tools|>\n" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    first_user: str | None = None
    # What infer_prefix_class looks at.
    session = False
    has_system = bool(tools)
    longest = 0
    last_user = ""
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise _bad(
                f"messages[{i}].role",
                "missing required field" if role is None else "must be a string",
                "missing_field" if role is None else "invalid_field",
            )
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"unknown role {role!r}")
        content = msg.get("content")
        if isinstance(content, str):
            text = content
            if len(content) > longest:
                longest = len(content)
            if role == "user":
                last_user = content
        else:
            text = _content_text(content, f"messages[{i}].content")
        if role == "user":
            if first_user is None:
                first_user = text
        elif role in _HISTORY_ROLES:
            if i < last:
                session = True
        elif role in _SYSTEM_ROLES:
            has_system = True
        if not with_text:
            continue
        name = msg.get("name")
        # Pieces joined once at the end: no intermediate copy of long contents.
        add(f"<|{role}|>\n" if not isinstance(name, str) else f"<|{role}:{name}|>\n")
        add(text)
        calls = msg.get("tool_calls")
        if calls:
            add(orjson.dumps(calls, option=orjson.OPT_SORT_KEYS).decode())
        add("\n")
    if session:
        cls = PrefixClass.SESSION
    elif _looks_like_rag(last_user):
        cls = PrefixClass.RAG
    elif longest >= document_chars:
        cls = PrefixClass.DOCUMENT
    else:
        cls = PrefixClass.SYSTEM if has_system else PrefixClass.UNKNOWN
    return "".join(parts), first_user, cls


def infer_prefix_class(
    messages: list[Any], tools: list[Any] | None, document_chars: int
) -> PrefixClass:
    """The prefix class of a chat request from its structure (see the module docstring).

    The gateway classifies in its rendering pass (:func:`_render_chat`); this
    states the rules on their own, and the tests hold the two to agree.
    """
    longest = 0
    last_user = ""
    has_system = bool(tools)
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in _HISTORY_ROLES and i < len(messages) - 1:
            return PrefixClass.SESSION
        content = msg.get("content")
        size = len(content) if isinstance(content, str) else 0
        longest = max(longest, size)
        if role in _SYSTEM_ROLES:
            has_system = True
        elif role == "user" and isinstance(content, str):
            last_user = content
    if _looks_like_rag(last_user):
        return PrefixClass.RAG
    if longest >= document_chars:
        return PrefixClass.DOCUMENT
    return PrefixClass.SYSTEM if has_system else PrefixClass.UNKNOWN


def _looks_like_rag(text: str) -> bool:
    # Each marker is first looked for by one character (a memchr, about 30
    # times faster than a substring scan): most prompts hold no "[" or "<",
    # and the scans of the full markers then never run.
    if not text:
        return False
    if "[" in text and "[1]" in text and "[2]" in text:
        return True
    if "<" in text and _twice(text, "<document"):
        return True
    return "Source:" in text and _twice(text, "Source:")


def _twice(text: str, marker: str) -> bool:
    """``text.count(marker) >= 2`` (for a marker that cannot overlap itself)."""
    first = text.find(marker)
    return first >= 0 and text.find(marker, first + len(marker)) >= 0


class RequestBuilder:
    """Builds :class:`BuiltRequest` objects; one per gateway.

    Args:
        config: The gateway configuration.
        adapters: Returns the adapter names the workers serve (a live set).
        tokenizer: The tokenizer for token mode (None = text mode).
    """

    def __init__(
        self,
        config: GatewayConfig,
        adapters: Callable[[], frozenset[str]],
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        self.config = config
        self.routing = config.routing
        self.tokenizer = tokenizer
        self._adapters = adapters
        self._tokenizer_revision = config.routing.tokenizer_revision or (
            tokenizer.revision if tokenizer is not None else ""
        )
        self._namespaces: dict[tuple[str, str, str], CacheNamespace] = {}
        self._ids = count(1)
        self._id_prefix = f"pr-{secrets.token_hex(4)}-"

    def new_request_id(self) -> str:
        """A process-unique request id (cheaper than a UUID)."""
        return f"{self._id_prefix}{next(self._ids)}"

    def namespace(self, model: str, adapter: str, tenant_ns: str) -> CacheNamespace:
        """The (memoized) cache namespace."""
        key = (model, adapter, tenant_ns)
        ns = self._namespaces.get(key)
        if ns is None:
            if len(self._namespaces) >= _NS_MEMO_MAX:
                self._namespaces.clear()
            ns = self._namespaces[key] = CacheNamespace(
                model_revision=model,
                tokenizer_revision=self._tokenizer_revision,
                adapter_id=adapter,
                template_version=self.routing.template_version,
                tenant=tenant_ns,
            )
        return ns

    def build(
        self,
        body: Any,
        raw: bytes,
        kind: str,
        scope_of: Callable[[str | None], TenantScope],
        prefix_class_header: str | None,
        request_id: str | None = None,
    ) -> BuiltRequest:
        """Validate ``body`` and build the routing request.

        Args:
            body: The parsed JSON body.
            raw: The body bytes.
            kind: ``chat`` or ``completions``.
            scope_of: Resolves the tenant scope given the body's ``cache_salt``.
            prefix_class_header: The ``X-Prefix-Class`` header, if any.
            request_id: Use this id (default: a new one).

        Raises:
            BadRequest: Naming the offending field.
            Unauthorized: From ``scope_of``.
        """
        if not isinstance(body, dict):
            raise _bad("", "the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise _bad("model", "missing required field", "missing_field")
        if not isinstance(model, str) or not model:
            raise _bad("model", "must be a non-empty string")
        stream, wants_usage = _stream_flags(body)
        max_tokens = _max_tokens(body, self.routing.default_max_tokens)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise _bad("cache_salt", "must be a string")
        scope = scope_of(salt)

        tokens: Sequence[int] | None = None
        text: str | None = None
        first_user: str | None = None
        if kind == CHAT:
            messages = body.get("messages")
            if messages is None:
                raise _bad("messages", "missing required field", "missing_field")
            if not isinstance(messages, list) or not messages:
                raise _bad("messages", "must be a non-empty list of message objects")
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise _bad("tools", "must be a list of tool objects")
            with_text = self.tokenizer is None
            text, first_user, inferred = _render_chat(
                messages, tools, self.routing.document_chars, with_text
            )
            if not with_text:
                tokens = self._chat_tokens(messages, tools)
                text = None
            cls = _header_class(prefix_class_header) or inferred
        else:
            text, tokens = _prompt(body.get("prompt"))
            if text is not None and self.tokenizer is not None:
                tokens, text = self.tokenizer.encode_prompt(text), None
            size = len(text) if text is not None else len(tokens or ())
            cls = _header_class(prefix_class_header) or (
                PrefixClass.DOCUMENT if size >= self.routing.document_chars else PrefixClass.UNKNOWN
            )

        adapter = ""
        lora = body.get("lora_path")
        if isinstance(lora, str) and lora:
            adapter = lora
        elif model in self._adapters():
            adapter = model
        routing = RoutingRequest(
            request_id=RequestId(request_id or self.new_request_id()),
            namespace=self.namespace(model, adapter, scope.namespace),
            tokens=tokens,
            text=text,
            max_tokens=max_tokens,
            prefix_class=cls,
            model="" if adapter == model else model,
            adapter=adapter,
            first_user_text=first_user,
            tenant=scope.tenant,
        )
        return BuiltRequest(
            routing=routing,
            body=body,
            raw=raw,
            stream=stream,
            client_wants_usage=wants_usage,
            scope=scope,
            text_chars=len(text) if text is not None else 0,
            model=model,
        )

    def _chat_tokens(self, messages: list[Any], tools: list[Any] | None) -> list[int]:
        assert self.tokenizer is not None
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools)
        except ValueError as exc:  # ChatTemplateError names the field: "messages[2].role: ..."
            msg = str(exc)
            field = msg.split(":", 1)[0] if ":" in msg else "messages"
            raise BadRequest(msg, code="invalid_field", param=field) from None
        return self.tokenizer.encode(prompt)


def _header_class(value: str | None) -> PrefixClass | None:
    if not value:
        return None
    cls = _PREFIX_CLASSES.get(value.strip().lower())
    if cls is None:
        raise _bad(
            "X-Prefix-Class",
            f"unknown prefix class {value!r}; known: {', '.join(sorted(_PREFIX_CLASSES))}",
        )
    return cls


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    opts = body.get("stream_options")
    wants_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "must be an object")
        inc = opts.get("include_usage", False)
        if not isinstance(inc, bool):
            raise _bad("stream_options.include_usage", "must be a boolean")
        wants_usage = inc
    return stream, wants_usage


def _max_tokens(body: dict[str, Any], default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _bad(name, "must be a positive integer")
        return value
    return default


_MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32
_CHECK_SLICE = 32_768  # ids checked per step: about 1.5 ms of C loops


def _token_ids_ok(seq: list[Any], slice_size: int = _CHECK_SLICE) -> bool:
    """Every element an ``int`` (not ``bool``) in ``[0, 2^32)``.

    Checked in slices with C loops (``map(type)``, ``min``, ``max``) rather
    than one generator: a million ids took 120 ms of bytecode on the parse
    thread, and the event loop waited for the GIL meanwhile; slices of C
    loops take a third of that and give the GIL back between slices.
    """
    for lo in range(0, len(seq), slice_size):
        part = seq[lo : lo + slice_size]
        if set(map(type, part)) != {int} or min(part) < 0 or max(part) > _MAX_TOKEN_ID:
            return False
    return True


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """A completions prompt as (text, None) or (None, token ids)."""
    if prompt is None:
        raise _bad("prompt", "missing required field", "missing_field")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise _bad("prompt", "a list prompt must hold only strings or only token ids")
            return "\n".join(prompt), None
        if isinstance(first, int) and not isinstance(first, bool):
            if not _token_ids_ok(prompt):
                raise _bad("prompt", "token ids must be integers in [0, 2^32)")
            return None, prompt
        if isinstance(first, list):
            flat: list[int] = []
            for i, seq in enumerate(prompt):
                if not isinstance(seq, list) or not _token_ids_ok(seq):
                    raise _bad(f"prompt[{i}]", "must be a list of token ids in [0, 2^32)")
                flat.extend(seq)
            return None, flat
    raise _bad("prompt", "must be a string, a list of strings or a list of token ids")
