"""A model's own chat template, rendered as vLLM renders it (Jinja, Hugging Face conventions).

Token-mode routing is exact only if the gateway turns chat messages into the
very token ids the engine prefills. vLLM renders a chat request with the
model's Jinja template (``chat_template`` in ``tokenizer_config.json``, or a
``chat_template.jinja`` file beside it) and tokenizes the result without adding
special tokens (the template writes ``bos_token`` itself). This module does
the same:

* **Where the template comes from** (:func:`find_chat_template`): the folder's
  ``chat_template.jinja`` if present, else ``tokenizer_config.json``'s
  ``chat_template``: a string, or a list of ``{"name", "template"}`` of which
  ``default`` (else the first) is used, as ``transformers`` does.
* **The environment**: Jinja's immutable sandbox with ``trim_blocks`` and
  ``lstrip_blocks`` and the ``loopcontrols`` extension, the ``tojson`` filter
  with ``ensure_ascii=False`` (and ``indent``, ``separators``, ``sort_keys``),
  and the globals ``raise_exception`` and ``strftime_now``, which is what
  ``transformers`` (and hence vLLM) offers templates.
* **Variables**: ``messages``, ``tools`` (None when absent),
  ``add_generation_prompt`` and the special tokens of the config
  (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``), strings or
  ``{"content": ...}`` objects.

A template that raises (``raise_exception``) or fails to render gives
:class:`ChatTemplateError`, a ``ValueError`` the gateway answers with 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from prefixrouter.tokenizer import ChatTemplateError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ModelChatTemplate:
    """A compiled chat template and the special tokens it may use.

    Args:
        source: The Jinja source.
        special_tokens: ``bos_token`` etc. (missing ones render as empty).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text.

        Raises:
            ChatTemplateError: The template rejected the messages.
        """
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                **{k: self.special_tokens.get(k, "") for k in SPECIAL_TOKEN_KEYS},
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError(f"messages: the chat template failed: {exc}") from None


def find_chat_template(folder: Path) -> ModelChatTemplate | None:
    """The model folder's chat template, or None if it has none.

    Raises:
        ChatTemplateError: A template that is present but unusable.
    """
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"{config_file}: unreadable: {exc}") from None
        if isinstance(loaded, dict):
            config = loaded
    special = {
        k: text for k in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(k))) is not None
    }
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return ModelChatTemplate(jinja_file.read_text(encoding="utf-8"), special)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source:
        return None
    return ModelChatTemplate(source, special)
