"""The request-to-prompt path: rendering, classification, the request path, assembly, lint.

* :mod:`.render`: the one chat renderer (:func:`render_chat`: ChatML, the text
  the engine sees, with message spans; strict or lenient by
  :class:`RenderRules`), :func:`render_body` for any logged body, the one
  content-to-text function (:func:`content_text`) and :class:`PromptError`.
* :mod:`.classify`: the one prefix-class classifier (:func:`classify`,
  parameters :class:`ClassifierParams`) and the one reader of a stated class
  (:func:`parse_prefix_class`, the ``X-Prefix-Class`` header).
* :mod:`.request`: an OpenAI body -> model, options, prompt text or token
  ids, prefix class (:func:`build_prompt_request`): the path the gateway and
  any other driver build requests through.
* :mod:`.normalize`: :func:`normalize` (line endings, blanks, embedded JSON
  key order, Unicode form; code blocks verbatim) and :class:`Normalizer`
  (rules bound to a template version, and its stamp).
* :mod:`.assemble`: builders that put stable content first
  (:func:`doc_qa_request`, :func:`rag_request`, :class:`PinnedSession`).
* :mod:`.lint`: :class:`Linter` (volatile fields before stable content) and
  :class:`LintObserver` (the gateway's observe mode).
"""

from prefixrouter.prompt.assemble import (
    TEMPLATE_VERSION_HEADER,
    AssembledRequest,
    Fragment,
    PinnedSession,
    StableLayer,
    canonical_tools,
    doc_qa_request,
    document_id,
    order_fragments,
    rag_request,
    render_fragments,
)
from prefixrouter.prompt.classify import (
    PREFIX_CLASS_HEADER,
    ClassifierParams,
    classify,
    parse_prefix_class,
)
from prefixrouter.prompt.lint import (
    FIXES,
    Finding,
    Linter,
    LintObserver,
    LintParams,
    VolatileMatch,
    scan_volatile,
)
from prefixrouter.prompt.normalize import (
    DEFAULT_RULES,
    Normalizer,
    NormalizeRules,
    canonical_json,
    normalize,
    normalize_messages,
    stamp_version,
)
from prefixrouter.prompt.render import (
    GATEWAY,
    LENIENT,
    TEMPLATE,
    MessageSpan,
    PromptError,
    RenderedPrompt,
    RenderRules,
    content_text,
    render_body,
    render_chat,
)
from prefixrouter.prompt.request import PromptRequest, build_prompt_request

__all__ = [
    "DEFAULT_RULES",
    "FIXES",
    "GATEWAY",
    "LENIENT",
    "PREFIX_CLASS_HEADER",
    "TEMPLATE",
    "TEMPLATE_VERSION_HEADER",
    "AssembledRequest",
    "ClassifierParams",
    "Finding",
    "Fragment",
    "LintObserver",
    "LintParams",
    "Linter",
    "MessageSpan",
    "NormalizeRules",
    "Normalizer",
    "PinnedSession",
    "PromptError",
    "PromptRequest",
    "RenderRules",
    "RenderedPrompt",
    "StableLayer",
    "VolatileMatch",
    "build_prompt_request",
    "canonical_json",
    "canonical_tools",
    "classify",
    "content_text",
    "doc_qa_request",
    "document_id",
    "normalize",
    "normalize_messages",
    "order_fragments",
    "parse_prefix_class",
    "rag_request",
    "render_body",
    "render_chat",
    "render_fragments",
    "scan_volatile",
    "stamp_version",
]
