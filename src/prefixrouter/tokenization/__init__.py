"""Tokenization: the project's tokenizer and the chat templates of models.

* :mod:`.tokenizer`: the project's own byte-level BPE tokenizer, built
  locally and deterministically (:func:`load_tokenizer`, :class:`Tokenizer`,
  :func:`hf_tokenizer_dir` for tools that load tokenizers by folder).
* :mod:`.chatml`: the project model's chat template, ChatML, rendered by
  :func:`prefixrouter.prompt.render.render_chat` (:func:`render_chat`) and its
  Jinja twin :data:`CHAT_TEMPLATE_JINJA`.
* :mod:`.chat_template`: a model folder's own Jinja chat template, rendered
  as vLLM renders it (:class:`ModelChatTemplate`).

Tokenization sits above :mod:`prefixrouter.prompt` (it imports the renderer,
never the other way round): the request path takes a tokenizer as an argument.
"""

from prefixrouter.tokenization.chat_template import (
    ModelChatTemplate,
    content_format,
    find_chat_template,
    vllm_messages,
)
from prefixrouter.tokenization.chatml import CHAT_TEMPLATE_JINJA, ChatTemplateError, render_chat
from prefixrouter.tokenization.tokenizer import (
    LONG_TEXT_CHARS,
    SPECIAL_TOKENS,
    TOKENIZER_VERSION,
    VOCAB_SIZE,
    Tokenizer,
    build_tokenizer_json,
    cache_dir,
    hf_tokenizer_dir,
    load_tokenizer,
    tokenizer_path,
)

__all__ = [
    "CHAT_TEMPLATE_JINJA",
    "LONG_TEXT_CHARS",
    "SPECIAL_TOKENS",
    "TOKENIZER_VERSION",
    "VOCAB_SIZE",
    "ChatTemplateError",
    "ModelChatTemplate",
    "Tokenizer",
    "build_tokenizer_json",
    "cache_dir",
    "content_format",
    "find_chat_template",
    "hf_tokenizer_dir",
    "load_tokenizer",
    "render_chat",
    "tokenizer_path",
    "vllm_messages",
]
