"""A model's own Jinja chat template, rendered with Hugging Face's conventions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixrouter.chat_template import ModelChatTemplate, find_chat_template
from prefixrouter.tokenizer import (
    ChatTemplateError,
    hf_tokenizer_dir,
    load_tokenizer,
    render_chat,
    tokenizer_path,
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
    assert isinstance(ChatTemplateError("x"), ValueError)  # the gateway answers 400


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
