"""A model's own Jinja chat template, rendered with Hugging Face's conventions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from prefixrouter.tokenization import (
    ChatTemplateError,
    hf_tokenizer_dir,
    load_tokenizer,
    render_chat,
    tokenizer_path,
)
from prefixrouter.tokenization.chat_template import (
    ModelChatTemplate,
    content_format,
    find_chat_template,
)

# The shape of Llama 3's template: BOS from the config, headers, tojson for tools.
LLAMA3_LIKE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Tools: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi é"}]


def model_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(tokenizer_path(), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_renders_like_transformers_conventions(tmp_path: Path) -> None:
    folder = model_dir(
        tmp_path, {"chat_template": LLAMA3_LIKE, "bos_token": {"content": "<|endoftext|>"}}
    )
    template = find_chat_template(folder)
    assert template is not None
    text = template.render(MESSAGES, [{"type": "function", "function": {"name": "é"}}])
    assert text == (
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\n"
        'Tools: [{"type": "function", "function": {"name": "é"}}]<|eot_id|>'
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi é<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_prompt = template.render(MESSAGES, add_generation_prompt=False)
    assert no_prompt.endswith("Hi é<|eot_id|>")


def test_raise_exception_and_broken_templates_are_chat_template_errors(tmp_path: Path) -> None:
    template = ModelChatTemplate(LLAMA3_LIKE)
    with pytest.raises(ChatTemplateError, match="unsupported role tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ModelChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError):
        ModelChatTemplate("{{ messages[0]['content'] + 1 }}").render(MESSAGES)
    assert isinstance(ChatTemplateError("messages", "x"), ValueError)  # the gateway answers 400


def test_template_sources_in_order_of_precedence(tmp_path: Path) -> None:
    folder = model_dir(
        tmp_path,
        {
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D"},
            ]
        },
    )
    t = find_chat_template(folder)
    assert t is not None and t.render(MESSAGES) == "D"
    (folder / "chat_template.jinja").write_text("J")
    t = find_chat_template(folder)
    assert t is not None and t.render(MESSAGES) == "J"
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text("{}")
    assert find_chat_template(folder) is None


def test_load_tokenizer_uses_the_models_template_but_not_our_own(tmp_path: Path) -> None:
    ours = load_tokenizer(hf_tokenizer_dir())
    assert ours.template is None
    assert ours.apply_chat_template(MESSAGES) == render_chat(MESSAGES)
    folder = model_dir(tmp_path, {"chat_template": LLAMA3_LIKE, "bos_token": "<|endoftext|>"})
    theirs = load_tokenizer(folder)
    assert theirs.template is not None
    assert theirs.apply_chat_template(MESSAGES).startswith("<|endoftext|><|start_header_id|>")
    assert theirs.encode_chat(MESSAGES)[0] == theirs.token_to_id("<|endoftext|>")
    # A different template is a different tokenizer revision: no stale routing state.
    assert theirs.revision != ours.revision


# Writes each message's content and its tool calls' arguments as the template sees them.
SHOWS_ARGUMENTS = (
    "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] | tojson }}"
    "{% for c in m['tool_calls'] or [] %} {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}]{% endfor %}"
)
# Loops over a message's content: vLLM hands it a list of text parts.
LOOPS_OVER_CONTENT = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% if message['content'] is string %}S{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}<{{ part['type'] }}={{ part['text'] }}>"
    "{% endfor %}{% endif %};{% endfor %}"
)
AS_SENT: list[dict[str, Any]] = [
    {"role": "system", "content": None},
    {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"text": "c"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "1",
                "type": "function",
                "function": {"name": "f", "arguments": '{"b": 1, "a": [2]}'},
            },
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
            {"id": "3", "type": "function", "function": {"name": "h", "arguments": "not json"}},
            {"id": "4", "type": "function", "function": {"name": "k", "arguments": ""}},
            {"id": "5", "type": "function", "function": {"name": "m", "arguments": {"z": 0}}},
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, "r2"]},
    {"role": "assistant", "content": "done", "tool_calls": []},
]


def test_messages_reach_the_template_as_vllm_sends_them() -> None:
    """Text parts joined with a newline (null content is ""), tool-call arguments as objects
    (keys in their order; {} for anything that is not a JSON object), no empty tool_calls."""
    text = ModelChatTemplate(SHOWS_ARGUMENTS).render(AS_SENT, add_generation_prompt=False)
    assert text == (
        '[system:""][user:"a\\nb\\nc"]'
        '[assistant:"" f{"b": 1, "a": [2]} g{} h{} k{} m{"z": 0}]'
        '[tool:"r1\\nr2"][assistant:"done"]'
    )
    # The caller's messages are left as they were.
    assert AS_SENT[2]["tool_calls"][0]["function"]["arguments"] == '{"b": 1, "a": [2]}'
    # The project's own ChatML (render_chat) and its Jinja twin agree on them.
    from prefixrouter.tokenization import CHAT_TEMPLATE_JINJA

    assert ModelChatTemplate(CHAT_TEMPLATE_JINJA).render(AS_SENT) == render_chat(AS_SENT)


def test_a_template_that_loops_over_content_gets_text_parts() -> None:
    """vLLM's content-format detection: such a template gets a list of text parts, even for
    string content; a tool message's text parts are still joined."""
    template = ModelChatTemplate(LOOPS_OVER_CONTENT)
    assert template.content_format == "openai"
    assert ModelChatTemplate(LLAMA3_LIKE).content_format == "string"
    text = template.render(AS_SENT[:2] + AS_SENT[3:], add_generation_prompt=False)
    assert text == "system:;user:<text=a><text=b><text=c>;tool:Sr1\nr2;assistant:<text=done>;"


def test_content_parts_other_than_text_are_refused_by_model_templates() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content\[0\]\.type"):
        ModelChatTemplate(SHOWS_ARGUMENTS).render([{"role": "user", "content": [image]}])


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set ms = messages[1:] %}{% set more = ms | list %}"
            "{% for m in more %}{% for p in m['content'] | list %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(x, c=none) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(1, c=m.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m['tool_calls']) }}{% endfor %}",
            "string",
        ),
        ("{% set content = messages[0]['content'] %}{% for p in content %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% for c in (m['content'] or []) %}{% endfor %}{% endfor %}",
            "string",
        ),
        (
            "{% for m in messages %}{% for x in messages[0]['content'] %}{% endfor %}{% endfor %}",
            "string",
        ),
        ("{% for %}", "string"),
    ],
)
def test_content_format_is_detected_as_vllm_does(source: str, expected: str) -> None:
    """Each answer is the one vLLM's ``_detect_content_format`` gives (checked with vLLM 0.32)."""
    assert content_format(source) == expected
