"""The project model's chat template: ChatML, rendered by :mod:`prefixrouter.prompt.render`.

The tiny model's tokenizer folder (:func:`~prefixrouter.tokenization.hf_tokenizer_dir`)
carries :data:`CHAT_TEMPLATE_JINJA`; the gateway, the simulated engine and the
tokenizer render the same text in Python with :func:`render_chat`, which is
:func:`prefixrouter.prompt.render.render_chat` under the text-only template's
rules (:data:`~prefixrouter.prompt.render.TEMPLATE`). The two are tested equal
(``tests/tokenization/test_chatml.py``) and the Jinja one against vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefixrouter.prompt.render import TEMPLATE, PromptError
from prefixrouter.prompt.render import render_chat as _render

__all__ = ["CHAT_TEMPLATE_JINJA", "ChatTemplateError", "render_chat"]


class ChatTemplateError(PromptError):
    """Malformed chat messages or tools, or a template that failed; names the field
    (``messages[2].role``). A :class:`~prefixrouter.prompt.render.PromptError`, so the
    gateway answers it with a 400 naming that field."""

    @classmethod
    def of(cls, exc: PromptError) -> ChatTemplateError:
        """The same error, as a :class:`ChatTemplateError`."""
        return cls(exc.field, exc.message, exc.code, text=str(exc))


CHAT_TEMPLATE_JINJA = (
    # Roles are rendered as given; naming 'developer' here keeps vLLM from
    # rewriting developer messages to system ones (and merging them).
    "{#- ChatML; roles (system, user, assistant, tool, 'developer') as given -#}"
    "{%- macro obj(d) -%}{{ '{' }}"
    "{%- for k, v in d|dictsort(true) if v is not none -%}"
    "{{ (', ' if not loop.first else '') ~ k|tojson ~ ': ' }}"
    "{{ obj(v) if k == 'function' and v is mapping else v|tojson(sort_keys=true) }}"
    "{%- endfor -%}{{ '}' }}{%- endmacro -%}"
    "{%- set ns = namespace(section='', text='') -%}"
    "{%- if tools -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.section = ns.section ~ ('\\n' if not loop.first else '') ~ obj(tool) -%}"
    "{%- endfor -%}"
    "{%- set ns.section = '# Tools\\n\\n<tools>\\n' ~ ns.section ~ '\\n</tools>' -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n' ~ ns.section ~ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set ns.text = message['content'] or '' -%}"
    "{%- if message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set ns.text = (ns.text ~ '\\n' if ns.text else '') ~ '<tool_call>\\n{\"name\": '"
    " ~ call['function']['name']|tojson ~ ', \"arguments\": '"
    " ~ (call['function']['arguments'] or {})|tojson ~ '}\\n</tool_call>' -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if loop.first and tools and message['role'] == 'system' -%}"
    "{%- set ns.text = ns.text ~ '\\n\\n' ~ ns.section if ns.text else ns.section -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ ns.text ~ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""The same rendering as :func:`render_chat`, as Jinja (for ``tokenizer_config.json``).

Checked against vLLM 0.32 (``scripts/probe_vllm.py``): vLLM joins text parts,
turns tool-call ``arguments`` into objects and dumps tools with every field
(absent ones as null) before rendering, so the template writes arguments with
``tojson`` and drops null tool fields, as :func:`render_chat` does. It relies
on the ``tojson`` filter of transformers (``sort_keys``, no HTML escaping).
"""


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render OpenAI chat messages to the prompt text the model sees (ChatML).

    Pure and deterministic: the same messages give the same text, byte for
    byte. The format is :mod:`prefixrouter.prompt.render`'s; the rules are the
    text-only template's: any non-empty role, content a string, null or a
    list of text parts (other part types are refused), well-formed tool calls
    (``function.name`` a string) and tools (objects).

    Raises:
        ChatTemplateError: If a message or tool is malformed (names the field).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages", "must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages", "must not be empty")
    if tools is not None and (isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence)):
        raise ChatTemplateError("tools", "must be a list of tool objects")
    try:
        return _render(messages, tools, TEMPLATE, add_generation_prompt=add_generation_prompt).text
    except ChatTemplateError:
        raise
    except PromptError as exc:
        raise ChatTemplateError.of(exc) from None
