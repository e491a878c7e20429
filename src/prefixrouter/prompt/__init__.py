"""Prompt hygiene: deterministic normalization, stable assembly, and a linter.

* :mod:`.normalize`: :func:`normalize` (line endings, blanks, embedded JSON
  key order, Unicode form; code blocks verbatim) and :class:`Normalizer`
  (rules bound to a template version, and its stamp).
* :mod:`.assemble`: builders that put stable content first
  (:func:`doc_qa_request`, :func:`rag_request`, :class:`PinnedSession`), the
  ChatML rendering of a body (:func:`render_chat`) and prefix-class inference.
* :mod:`.lint`: :class:`Linter` (volatile fields before stable content) and
  :class:`LintObserver` (the gateway's observe mode).
"""

from prefixrouter.prompt.assemble import (
    PREFIX_CLASS_HEADER,
    TEMPLATE_VERSION_HEADER,
    AssembledRequest,
    Fragment,
    MessageSpan,
    PinnedSession,
    RenderedPrompt,
    StableLayer,
    canonical_tools,
    doc_qa_request,
    document_id,
    infer_prefix_class,
    order_fragments,
    rag_request,
    render_chat,
    render_fragments,
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

__all__ = [
    "DEFAULT_RULES",
    "FIXES",
    "PREFIX_CLASS_HEADER",
    "TEMPLATE_VERSION_HEADER",
    "AssembledRequest",
    "Finding",
    "Fragment",
    "LintObserver",
    "LintParams",
    "Linter",
    "MessageSpan",
    "NormalizeRules",
    "Normalizer",
    "PinnedSession",
    "RenderedPrompt",
    "StableLayer",
    "VolatileMatch",
    "canonical_json",
    "canonical_tools",
    "doc_qa_request",
    "document_id",
    "infer_prefix_class",
    "normalize",
    "normalize_messages",
    "order_fragments",
    "rag_request",
    "render_chat",
    "render_fragments",
    "scan_volatile",
    "stamp_version",
]
