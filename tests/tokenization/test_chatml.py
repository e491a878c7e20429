"""The project model's Jinja chat template renders what the Python renderer renders.

vLLM renders the tiny model's prompts with ``CHAT_TEMPLATE_JINJA``; the
gateway hashes and encodes :func:`prefixrouter.prompt.render.render_chat`'s
text. Both must be the same bytes on every input the template accepts.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.prompt.render import GATEWAY, LENIENT
from prefixrouter.prompt.render import render_chat as render_prompt
from prefixrouter.tokenization import CHAT_TEMPLATE_JINJA, ModelChatTemplate, render_chat

JINJA = ModelChatTemplate(CHAT_TEMPLATE_JINJA)

_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_args = (
    st.dictionaries(_text, _json, max_size=3)
    | st.dictionaries(_text, _json, max_size=3).map(
        lambda d: __import__("json").dumps(d, ensure_ascii=False)
    )
    | st.sampled_from(["", "not json", "[1, 2]", "7", "{}"])
)
_call = st.builds(
    lambda name, args: {
        "id": "c",
        "type": "function",
        "function": {"name": name, "arguments": args},
    },
    _text,
    _args,
)
_content = (
    _text
    | st.none()
    | st.lists(
        _text.map(lambda t: {"type": "text", "text": t}) | _text,
        max_size=3,
    )
)


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool", "developer"]))
    msg: dict[str, Any] = {"role": role, "content": draw(_content)}
    if role == "assistant" and draw(st.booleans()):
        msg["tool_calls"] = draw(st.lists(_call, max_size=2))
    return msg


_tool = st.builds(
    lambda name, desc, params, extra: {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": params},
        **extra,
    },
    _text,
    st.none() | _text,
    st.dictionaries(_text, _json, max_size=3),
    st.sampled_from([{}, {"strict": None}, {"x-meta": {"b": 1, "a": [2]}}]),
)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(_message(), min_size=1, max_size=5),
    tools=st.none() | st.lists(_tool, max_size=2),
    generation=st.booleans(),
)
def test_jinja_template_equals_the_python_renderer(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
) -> None:
    expected = render_chat(messages, tools, add_generation_prompt=generation)
    assert JINJA.render(messages, tools, add_generation_prompt=generation) == expected
    # The gateway's and the lenient rules render the same text for what the template takes.
    assert render_prompt(messages, tools, GATEWAY, add_generation_prompt=generation).text == (
        expected
    )
    assert render_prompt(messages, tools, LENIENT, add_generation_prompt=generation).text == (
        expected
    )


CASES = [
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
    [{"role": "user", "content": "U"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "U"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get", "arguments": "{}"}},
                {"id": "2", "type": "function", "function": {"name": "get", "arguments": {"x": 1}}},
            ],
        },
        {"role": "tool", "content": "42"},
        {"role": "developer", "content": "é ünïcode \u2028 {{ not a template }}"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"b": 1, "a": 2}}}]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", CASES)
def test_jinja_equals_python_on_fixed_cases(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    assert JINJA.render(messages, tools) == render_chat(messages, tools)
