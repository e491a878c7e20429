"""The one prefix-class classifier, and the one reader of a stated class."""

from __future__ import annotations

from typing import Any

import pytest

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.classify import (
    ClassifierParams,
    classify,
    classify_tokens,
    parse_prefix_class,
)
from prefixrouter.prompt.render import PromptError, render_body


def _m(role: str, content: Any) -> dict[str, Any]:
    return {"role": role, "content": content}


def _cls(messages: list[dict[str, Any]], tools: Any = None, **params: Any) -> PrefixClass:
    body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    return classify(render_body(body), ClassifierParams(**params))


@pytest.mark.parametrize(
    ("messages", "tools", "expected"),
    [
        ([_m("user", "hi")], None, PrefixClass.UNKNOWN),
        ([_m("system", "s"), _m("user", "hi")], None, PrefixClass.SYSTEM),
        ([_m("developer", "s"), _m("user", "hi")], None, PrefixClass.SYSTEM),
        ([_m("user", "hi")], [{"type": "function"}], PrefixClass.SYSTEM),
        ([_m("system", "x" * 500), _m("user", "q")], None, PrefixClass.SYSTEM),
        ([_m("system", "s"), _m("user", "d" * 4000)], None, PrefixClass.DOCUMENT),
        ([_m("user", "d" * 3999)], None, PrefixClass.UNKNOWN),
        ([_m("user", '<document id="a">short</document>\n\nQ?')], None, PrefixClass.DOCUMENT),
        ([_m("user", "[1] a\n[2] b\nQ?")], None, PrefixClass.RAG),
        ([_m("user", "[1] a only")], None, PrefixClass.UNKNOWN),
        ([_m("user", "<document a/><document b/>")], None, PrefixClass.RAG),
        ([_m("user", "Source: a\nSource: b")], None, PrefixClass.RAG),
        ([_m("user", "Source:Source:")], None, PrefixClass.RAG),
        ([_m("user", "Source: once")], None, PrefixClass.UNKNOWN),
        ([_m("user", "[source: wiki] text")], None, PrefixClass.RAG),
        ([_m("user", "<context>\nx\n</context>\n\nQ?")], None, PrefixClass.RAG),
        ([_m("user", [{"type": "text", "text": "[1] [2]"}])], None, PrefixClass.RAG),
        ([_m("user", "hi"), _m("assistant", "yo"), _m("user", "more")], None, PrefixClass.SESSION),
        ([_m("user", "hi"), _m("tool", "{}"), _m("user", "x")], None, PrefixClass.SESSION),
        ([_m("user", "a"), _m("user", "b")], None, PrefixClass.SESSION),
        ([_m("user", "hi"), _m("assistant", "yo")], None, PrefixClass.UNKNOWN),
        ([_m("user", None), _m("system", "s")], None, PrefixClass.SYSTEM),
    ],
)
def test_rules(messages: list[dict[str, Any]], tools: Any, expected: PrefixClass) -> None:
    assert _cls(messages, tools) is expected


def test_rules_where_the_old_copies_disagreed() -> None:
    """One rule now; before, the gateway (G) and prompt/assemble (A) answered differently."""
    long_system = [_m("system", "d" * 5000), _m("user", "hi")]
    assert _cls(long_system) is PrefixClass.SYSTEM  # G: document (any message), A: system
    short_system = [_m("system", "Be brief."), _m("user", "hi")]
    assert _cls(short_system) is PrefixClass.SYSTEM  # G: system, A: unknown (< 400 chars)
    assert _cls([_m("user", "d" * 5000)]) is PrefixClass.DOCUMENT  # G: document, A: unknown
    rag_in_system = [_m("system", "<context>rules</context>"), _m("user", "hi")]
    assert _cls(rag_in_system) is PrefixClass.SYSTEM  # A: rag (any message), G: system


def test_thresholds_are_parameters() -> None:
    assert _cls([_m("user", "d" * 100)], document_chars=100) is PrefixClass.DOCUMENT
    assert _cls([_m("user", "@@ x")], rag_markers=("@@",)) is PrefixClass.RAG
    assert _cls([_m("user", "[1] [2]")], passage_pairs=()) is PrefixClass.UNKNOWN


def test_completions() -> None:
    assert classify(render_body({"prompt": "z" * 4000})) is PrefixClass.DOCUMENT
    assert classify(render_body({"prompt": "<context>a</context> q"})) is PrefixClass.RAG
    assert classify(render_body({"prompt": "short"})) is PrefixClass.UNKNOWN
    assert classify_tokens([1] * 1000) is PrefixClass.DOCUMENT  # 1,000 tokens ~ 4,000 chars
    assert classify_tokens([1] * 999) is PrefixClass.UNKNOWN


def test_stated_class_is_parsed_once() -> None:
    assert parse_prefix_class(" RAG ") is PrefixClass.RAG
    assert parse_prefix_class("") is None and parse_prefix_class(None) is None
    assert parse_prefix_class("bogus") is None
    assert parse_prefix_class(7) is None
    with pytest.raises(PromptError) as info:
        parse_prefix_class("bogus", strict=True)
    assert info.value.field == "X-Prefix-Class"
    assert str(info.value) == (
        "X-Prefix-Class: unknown prefix class 'bogus'; known: "
        "document, rag, session, system, unknown"
    )
