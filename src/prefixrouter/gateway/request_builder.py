"""Request body -> :class:`~prefixrouter.core.types.RoutingRequest`: the gateway's part.

The request path itself (validation, the prompt as the engine sees it, its
token ids in token mode, the prefix class) is
:func:`prefixrouter.prompt.request.build_prompt_request`, shared with every
other driver of the router. This module adds what only the gateway has:

* the parse of the bytes (done by the caller) and the bytes kept for forwarding;
* the tenant scope (:mod:`prefixrouter.gateway.tenancy`), resolved with the
  body's ``cache_salt`` between the request's options and its prompt, so a
  request that names a bad field and a bad key is answered as before;
* the model of a body that names none: the fleet's one model
  (``served_models``, :func:`~prefixrouter.prompt.request.request_options`);
* the namespace: model, tokenizer revision, adapter (a model name the workers
  list as a LoRA adapter, or SGLang's ``lora_path``), template version (in
  text mode with the request's template fields folded in, when it sets any:
  :attr:`~prefixrouter.prompt.request.TemplateOptions.key`) and the tenant's
  namespace;
* the mapping of :class:`~prefixrouter.prompt.render.PromptError` to the
  OpenAI-style 400 (:class:`~prefixrouter.gateway.errors.BadRequest`), the
  same message, ``param`` the field.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass
from itertools import count
from typing import Any

from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.types import CacheNamespace, RequestId, RoutingRequest
from prefixrouter.gateway.access_log import RequestNote
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.errors import BadRequest
from prefixrouter.gateway.tenancy import TenantScope
from prefixrouter.prompt.classify import ClassifierParams
from prefixrouter.prompt.render import PromptError, RenderedPrompt
from prefixrouter.prompt.request import (
    CHAT,
    COMPLETIONS,
    ChatTokenizer,
    build_prompt,
    request_options,
)

__all__ = ["CHAT", "COMPLETIONS", "BuiltRequest", "ChatTokenizer", "RequestBuilder", "bad_request"]

_NS_MEMO_MAX = 10_000


@dataclass(slots=True)
class BuiltRequest:
    """A validated request, ready to route and forward.

    Attributes:
        routing: What the router sees.
        body: The parsed body (forwarded as is unless a field must be set).
        raw: The body bytes as received.
        stream: The client asked for a stream.
        client_wants_usage: The client's ``stream_options.include_usage``:
            True or False (False too without ``stream_options``), None for
            ``stream_options`` without it: the engine's default
            (:meth:`usage_to_client`).
        scope: The tenant and its cache scope.
        text_chars: Characters of the rendered prompt (text mode; 0 otherwise;
            a batch's all): with the engine's ``prompt_tokens`` they teach the estimator.
        model: The requested model.
        prompt: The rendered prompt with its message spans (the linter reads
            it; None for a prompt of token ids).
        blocks: The prompt's block hashes, when hashed with the parse (large
            bodies, off the event loop); None: ``Router.route`` hashes it.
        note: The request's access-log note, filled in as it is served.
        client_id: The client's own ``X-Request-Id``, when sane
            (:func:`~prefixrouter.gateway.access_log.client_request_id`).
        batch: A completions batch (a list of prompts): routed on the first
            one's prefix, its load all of them (:meth:`RequestFlow.build
            <prefixrouter.gateway.flow.RequestFlow.build>`).
        batch_tokens: A batch in token mode: the tokens of all its prompts
            (``routing.tokens`` are the first one's); else 0.
    """

    routing: RoutingRequest
    body: dict[str, Any]
    raw: bytes
    stream: bool
    client_wants_usage: bool | None
    scope: TenantScope
    text_chars: int
    model: str
    prompt: RenderedPrompt | None = None
    blocks: PromptBlocks | None = None
    note: RequestNote | None = None
    client_id: str | None = None
    batch: bool = False
    batch_tokens: int = 0

    @property
    def reply_id(self) -> str:
        """The id the client gets in ``X-Request-Id``: its own if it sent one, else the router's.

        The router's id (``routing.request_id``) stays the gateway's own,
        unique per request: the load ledger and the replicas key on it.
        """
        return self.client_id or self.routing.request_id

    def usage_to_client(self, engine_default: bool) -> bool:
        """Whether the client gets the stream's usage chunk from a worker whose
        engine sends it by default when ``stream_options`` leaves it unset
        (``engine_default``: vLLM yes, SGLang and OpenAI no).

        The client gets what the engine behind would have given it; when
        that is no usage, the gateway still asks for the chunk (the usage is
        the only place a stream reports its prefix-cache reuse) and keeps it
        from the client.
        """
        wants = self.client_wants_usage
        return engine_default if wants is None else wants

    def cache_salt_on(self, takes_salt: bool) -> str | None:
        """The ``cache_salt`` to send to a worker (``takes_salt``: it takes one); None for none."""
        return self.scope.cache_salt if takes_salt else None


def bad_request(exc: PromptError) -> BadRequest:
    """The OpenAI-style 400 of a malformed field: its message, ``param`` the field."""
    return BadRequest(str(exc), code=exc.code, param=exc.field or None)


class RequestBuilder:
    """Builds :class:`BuiltRequest` objects; one per gateway.

    Args:
        config: The gateway configuration.
        adapters: Returns the adapter names the workers serve (a live set).
        tokenizer: The tokenizer for token mode (None = text mode).
        cache_model: A base model's name -> the name its cache namespace goes
            by, one for all its aliases
            (:meth:`~prefixrouter.gateway.workers.WorkerRegistry.cache_model`;
            default: its own).
    """

    def __init__(
        self,
        config: GatewayConfig,
        adapters: Callable[[], frozenset[str]],
        tokenizer: ChatTokenizer | None = None,
        cache_model: Callable[[str], str] = str,
    ) -> None:
        self.config = config
        self.cache_model = cache_model
        self.routing = config.routing
        self.tokenizer = tokenizer
        self.classifier = classifier_params(config)
        self._adapters = adapters
        self._tokenizer_revision = config.routing.tokenizer_revision or (
            tokenizer.revision if tokenizer is not None else ""
        )
        self._namespaces: dict[tuple[str, str, str, str], CacheNamespace] = {}
        self._ids = count(1)
        self._id_prefix = f"pr-{secrets.token_hex(4)}-"

    def new_request_id(self) -> str:
        """A process-unique request id (cheaper than a UUID)."""
        return f"{self._id_prefix}{next(self._ids)}"

    @property
    def tokenizer_revision(self) -> str:
        """The namespaces' tokenizer revision (configured, else the loaded tokenizer's)."""
        return self._tokenizer_revision

    def namespace(
        self, model: str, adapter: str, tenant_ns: str, template_key: str = ""
    ) -> CacheNamespace:
        """The (memoized) cache namespace.

        ``template_key``: text mode's request template fields
        (:attr:`~prefixrouter.prompt.request.TemplateOptions.key`), folded into
        the template version after a ``+``; ``""`` leaves it as configured,
        so a request that sets none keeps the namespace it always had.
        """
        key = (model, adapter, tenant_ns, template_key)
        ns = self._namespaces.get(key)
        if ns is None:
            if len(self._namespaces) >= _NS_MEMO_MAX:
                self._namespaces.clear()
            version = self.routing.template_version
            if template_key:
                version = f"{version}+{template_key}"
            ns = self._namespaces[key] = CacheNamespace(
                model_revision=model,
                tokenizer_revision=self._tokenizer_revision,
                adapter_id=adapter,
                template_version=version,
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
        served_models: Callable[[], Collection[str]] = frozenset,
    ) -> BuiltRequest:
        """Validate ``body`` and build the routing request.

        Args:
            body: The parsed JSON body.
            raw: The body bytes.
            kind: ``chat`` or ``completions``.
            scope_of: Resolves the tenant scope given the body's ``cache_salt``.
            prefix_class_header: The ``X-Prefix-Class`` header, if any.
            request_id: Use this id (default: a new one).
            served_models: The fleet's models, asked only for a body that
                names none (the one served model is its model).

        Raises:
            BadRequest: Naming the offending field.
            Unauthorized: From ``scope_of``.
        """
        try:
            options = request_options(body, self.routing.default_max_tokens, served_models)
            salt = body.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise PromptError("cache_salt", "must be a string")
            scope = scope_of(salt)
            prompt = build_prompt(body, kind, self.tokenizer, self.classifier, prefix_class_header)
        except PromptError as exc:
            raise bad_request(exc) from None
        model = options.model
        adapter = ""
        lora = body.get("lora_path")
        if isinstance(lora, str) and lora:
            adapter = lora
        elif model in self._adapters():
            adapter = model
        routing = RoutingRequest(
            request_id=RequestId(request_id or self.new_request_id()),
            # Token mode renders the template fields into the tokens themselves
            # (its key holds only a template the request brings).
            namespace=self.namespace(
                model if adapter else self.cache_model(model),
                adapter,
                scope.namespace,
                prompt.template_key,
            ),
            tokens=prompt.tokens,
            text=prompt.text,
            max_tokens=options.max_tokens,
            prefix_class=prompt.prefix_class,
            model="" if adapter == model else model,
            adapter=adapter,
            first_user_text=prompt.first_user_text,
            tenant=scope.tenant,
        )
        return BuiltRequest(
            routing=routing,
            body=body,
            raw=raw,
            stream=options.stream,
            client_wants_usage=options.wants_usage,
            scope=scope,
            text_chars=prompt.text_chars,
            model=model,
            prompt=prompt.rendered,
            batch=bool(prompt.batch_chars or prompt.batch_tokens),
            batch_tokens=prompt.batch_tokens,
        )


def classifier_params(config: GatewayConfig) -> ClassifierParams:
    """The prefix classifier's parameters from the configuration (``routing.document_chars``)."""
    return ClassifierParams(document_chars=config.routing.document_chars)
