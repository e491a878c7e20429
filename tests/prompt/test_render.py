"""The one chat renderer: ChatML text, spans, strict and lenient rules, content to text."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.prompt.render import (
    GATEWAY,
    LENIENT,
    TEMPLATE,
    PromptError,
    content_text,
    render_body,
    render_chat,
)


def test_render_chat_spans_tail_and_live_content() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "reply", "tool_calls": [{"id": "c1"}]},
            {"role": "user", "content": [{"type": "text", "text": "doc\n\nquestion"}]},
        ],
    }
    r = render_body(body)
    assert [s.role for s in r.spans] == ["system", "user", "assistant", "user"]
    assert r.content(r.spans[0]) == "sys"
    assert '{"id": "c1"}' in r.text  # a malformed tool call, rendered deterministically
    assert r.text[r.tail_start :].startswith("question")
    assert [s.index for s in r.live] == [0, 3]  # history (turns 1-2) is not live
    assert r.text.endswith("<|im_start|>assistant\n")
    prompt = render_body({"prompt": "a\n\nb"})
    assert prompt.text == "a\n\nb" and prompt.tail_start == 3
    assert render_body({"prompt": ["a", "b"]}).text == "a\nb"


def test_tools_span_points_at_the_tools_section() -> None:
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"b": 1}}}]
    for messages in ([{"role": "user", "content": "U"}], [{"role": "system", "content": "S"}]):
        r = render_chat(messages, tools)
        (span,) = [s for s in r.spans if s.role == "tools"]
        assert r.content(span).startswith("# Tools") and r.content(span).endswith("</tools>")


_msg = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.text(max_size=30)
        | st.none()
        | st.lists(st.text(max_size=10).map(lambda t: {"type": "text", "text": t}), max_size=3),
    }
)


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_msg, min_size=1, max_size=5))
def test_spans_hold_each_messages_content(messages: list[dict[str, Any]]) -> None:
    r = render_chat(messages, None, GATEWAY)
    assert [s.index for s in r.spans] == list(range(len(messages)))
    for span, msg in zip(r.spans, messages, strict=True):
        assert r.content(span) == content_text(msg["content"])
        assert r.text[: span.start].endswith(f"<|im_start|>{msg['role']}\n")
        assert r.text.startswith("<|im_end|>\n", span.end)


def test_parts_that_are_not_text_become_stable_placeholders() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:a", "detail": "low"}}
    same = {"image_url": {"detail": "low", "url": "data:a"}, "type": "image_url"}
    other = {"type": "image_url", "image_url": {"url": "data:b"}}
    a = content_text(["x", image], rules=GATEWAY)
    assert a.startswith("x\n<image_url:") and a == content_text(["x", same], rules=LENIENT)
    assert a != content_text(["x", other], rules=GATEWAY)
    with pytest.raises(PromptError) as info:
        content_text([image], "messages[0].content", TEMPLATE)
    assert info.value.field == "messages[0].content[0].type"


@pytest.mark.parametrize(
    ("messages", "rules", "field", "code"),
    [
        (["x"], GATEWAY, "messages[0]", "invalid_field"),
        ([{"content": "x"}], GATEWAY, "messages[0].role", "missing_field"),
        ([{"role": 3}], GATEWAY, "messages[0].role", "invalid_field"),
        ([{"role": "wizard"}], GATEWAY, None, None),  # any role, as vLLM (Llama's ipython)
        ([{"role": ""}], GATEWAY, "messages[0].role", "invalid_field"),
        ([{"role": "wizard"}], TEMPLATE, None, None),  # a template takes any role
        ([{"role": ""}], TEMPLATE, "messages[0].role", "invalid_field"),
        ([{"role": "user", "content": 5}], GATEWAY, "messages[0].content", "invalid_field"),
        ([{"role": "assistant", "tool_calls": [{"x": 1}]}], GATEWAY, None, None),
        (
            [{"role": "assistant", "tool_calls": [{"x": 1}]}],
            TEMPLATE,
            "messages[0].tool_calls[0].function.name",
            "invalid_field",
        ),
        (
            [{"role": "assistant", "tool_calls": {"x": 1}}],
            TEMPLATE,
            "messages[0].tool_calls",
            "invalid_field",
        ),
    ],
)
def test_strict_rules_name_the_field(
    messages: list[Any], rules: Any, field: str | None, code: str | None
) -> None:
    if field is None:
        render_chat(messages, None, rules)
        return
    with pytest.raises(PromptError) as info:
        render_chat(messages, None, rules)
    assert info.value.field == field and info.value.code == code
    assert str(info.value).startswith(field + ": ")
    render_chat(messages, None, LENIENT)  # never raises


@settings(max_examples=200, deadline=None)
@given(body=st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["messages", "role", "content", "tool_calls", "tools", "prompt",
                         "type", "text", "function", "name", "arguments"]), inner, max_size=4),
    max_leaves=20,
))  # fmt: skip
def test_lenient_rendering_never_raises(body: Any) -> None:
    if isinstance(body, dict):
        r = render_body(body)
        assert r.tail_start <= len(r.text)
        _ = r.live
