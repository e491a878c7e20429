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
* **Variables**: ``messages``, ``tools`` (None when absent), ``documents``,
  ``add_generation_prompt``, the special tokens of the config
  (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``), strings or
  ``{"content": ...}`` objects, and the request's ``chat_template_kwargs``;
  ``continue_final_message`` cuts the text after the final message
  (:func:`continue_final`).
* **The messages as vLLM hands them over** (:func:`vllm_messages`), copies,
  other fields kept:

  - ``content``: vLLM looks at the template (``--chat-template-content-format
    auto``, :func:`content_format`). A template that loops over a message's
    content gets a list of ``{"type": "text", "text": ...}`` parts (a string
    is one part, null none); any other gets a string, the text parts joined
    with a newline (null: ``""``). A tool message's text parts are joined
    either way. Text only (a ``refusal`` part is text), as
    :func:`~prefixrouter.tokenization.render_chat`: other part types are
    refused here; the request path renders a prompt with media only up to
    the message that holds it
    (:func:`~prefixrouter.prompt.render.first_media_message`).
  - an assistant's ``tool_calls``: each ``function.arguments`` is an object
    (OpenAI's JSON text parsed, keys in their order; ``{}`` for anything that
    is not a JSON object); an empty list is dropped.

A template that raises (``raise_exception``) or fails to render gives
:class:`ChatTemplateError`, a ``ValueError`` the gateway answers with 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes

from prefixrouter.prompt.render import (
    PromptError,
    content_parts,
    content_text,
    tool_call_arguments,
    tool_call_function,
)
from prefixrouter.tokenization.chatml import ChatTemplateError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

ContentFormat = Literal["string", "openai"]


def _raise_exception(message: str) -> None:
    # The template's own words, as the 400's message; the field is the messages.
    raise ChatTemplateError("messages", message, text=message)


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


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _refers(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (``name[key]`` or ``name.key`` given a key), through
    filters, tests and slices (vLLM's ``_is_var_or_elems_access``)."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _refers(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _refers(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _refers(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        return _is_name(node.node, name) and isinstance(arg, nodes.Const) and arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _message_names(ast: nodes.Template) -> set[str]:
    """The loop variables that hold one message: ``for m in messages`` (or in a
    variable set from it, ``set loop_messages = messages[1:]``)."""
    lists, todo = {"messages"}, ["messages"]
    while todo:
        name = todo.pop()
        for assign in ast.find_all(nodes.Assign):
            target = assign.target
            if not isinstance(target, nodes.Name) or target.name in lists:
                continue
            if _refers(assign.node, name):
                lists.add(target.name)
                todo.append(target.name)
    return {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_refers(loop.iter, n) for n in lists)
    }


def _content_loops(ast: nodes.Template, messages: set[str]) -> Iterator[nodes.For]:
    """Loops over a message's content: ``for part in message['content']``, over a
    macro parameter that is given a message's content, or over ``content``
    outside macros (vLLM's ``_iter_nodes_assign_content_item``)."""

    def is_content(node: nodes.Node) -> bool:
        return any(_refers(node, m, "content") for m in messages)

    params_of: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        names = [a.name for a in macro.args]
        params: set[str] = set()
        for call in ast.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                params.update(n for n, a in zip(names, call.args, strict=False) if is_content(a))
                params.update(k.key for k in call.kwargs if k.key in names and is_content(k.value))
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_of[id(loop)] = params
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        named = isinstance(it, nodes.Name) and (
            it.name in params_of.get(id(loop), ())
            or (id(loop) not in in_macros and it.name == "content")
        )
        if named or is_content(it):
            yield loop


def content_format(source: str) -> ContentFormat:
    """How vLLM passes message content to this template (its ``auto`` detection).

    ``"openai"`` (a list of text parts) when the template loops over a
    message's content, else ``"string"``; ``"string"`` too for a template that
    does not parse.
    """
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateError:
        return "string"
    return "openai" if next(_content_loops(ast, _message_names(ast)), None) else "string"


def vllm_messages(
    messages: Sequence[Mapping[str, Any]], fmt: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """Copies of chat messages as vLLM hands them to a template (module docstring).

    Raises:
        ChatTemplateError: A malformed message, content part or tool call (names the field).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages", "must be a list of message objects")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(where, "must be an object")
        m = dict(msg)
        role, content = m.get("role"), m.get("content")
        if fmt == "openai" and role != "tool":
            texts = _checked(content_parts, content, f"{where}.content")
            m["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            m["content"] = _checked(content_text, content, f"{where}.content")
        calls = m.get("tool_calls")
        if role == "assistant" and isinstance(calls, list):
            if not calls:
                del m["tool_calls"]
            else:
                m["tool_calls"] = [
                    _vllm_tool_call(call, f"{where}.tool_calls[{j}]")
                    for j, call in enumerate(calls)
                ]
        out.append(m)
    return out


def _checked(read: Any, value: Any, where: str) -> Any:
    """``read(value, where)`` with the text-only template's rules; its errors as ours."""
    try:
        return read(value, where)
    except PromptError as exc:
        raise ChatTemplateError.of(exc) from None


def _vllm_tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = _checked(tool_call_function, call, where)
    return {**call, "function": {**fn, "arguments": tool_call_arguments(fn)}}


class ModelChatTemplate:
    """A compiled chat template and the special tokens it may use.

    Args:
        source: The Jinja source.
        special_tokens: ``bos_token`` etc. (missing ones render as empty).

    Attributes:
        content_format: How message content reaches it (:func:`content_format`).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError("", f"chat template does not compile: {exc}") from None
        self.content_format = content_format(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Sequence[Any] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of the messages as vLLM hands them over (:func:`vllm_messages`).

        Args:
            messages: The chat messages.
            tools: The tool definitions, if any.
            add_generation_prompt: The template's variable of that name.
            continue_final_message: Cut the text after the final message's
                text (:func:`continue_final`), as Hugging Face does.
            documents: The template's ``documents`` (RAG templates).
            variables: More variables (a request's ``chat_template_kwargs``:
                Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``);
                they may override the special tokens, not the above.

        Raises:
            ChatTemplateError: A malformed message, or the template rejected the messages.
        """
        prepared = vllm_messages(messages, self.content_format)
        context: dict[str, Any] = {k: self.special_tokens.get(k, "") for k in SPECIAL_TOKEN_KEYS}
        context.update(variables or {})
        context.update(
            messages=prepared,
            tools=[dict(t) for t in tools] if tools else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            text = self._template.render(**context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ChatTemplateError("messages", f"the chat template failed: {exc}") from None
        if continue_final_message and prepared:
            text = continue_final(text, prepared[-1].get("content"))
        return text


def continue_final(text: str, final_content: Any) -> str:
    """``text`` cut just after the final message's text: ``continue_final_message``.

    Hugging Face's rule, which vLLM applies: the final message's content (a
    string, or the text of its last text part), stripped, is looked for from
    the end of the rendered text, and everything after it (the end-of-turn
    tokens) is dropped, so the model continues that message.

    Raises:
        ChatTemplateError: The final message has no text, or the template did not render it.
    """
    final = final_content
    if isinstance(final, list):
        texts = [p["text"] for p in final if isinstance(p, Mapping) and "text" in p]
        if not texts:
            raise ChatTemplateError(
                "continue_final_message", "the final message has no text to continue"
            )
        final = texts[-1]
    stripped = str(final or "").strip()
    at = text.rfind(stripped)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message",
            "the final message does not appear in the chat after applying the chat template",
        )
    return text[: at + len(stripped)]


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
            raise ChatTemplateError("", f"{config_file}: unreadable: {exc}") from None
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
