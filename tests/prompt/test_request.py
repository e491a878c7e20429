"""The pure request path: an OpenAI body -> options, prompt and class, or a named PromptError."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt.classify import ClassifierParams
from prefixrouter.prompt.render import PromptError
from prefixrouter.prompt.request import (
    _CHECK_SLICE,
    CHAT,
    COMPLETIONS,
    build_prompt_request,
    token_ids_ok,
)
from prefixrouter.tokenization import load_tokenizer, render_chat

SYS = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "hello"}


def test_text_mode() -> None:
    body = {"model": "tiny", "messages": [SYS, USER], "stream": True, "max_tokens": 9}
    req = build_prompt_request(body, CHAT)
    assert (req.options.model, req.options.stream, req.options.max_tokens) == ("tiny", True, 9)
    assert req.prompt.text == render_chat([SYS, USER]) and req.prompt.tokens is None
    assert req.prompt.text_chars == len(req.prompt.text)
    assert req.prompt.rendered is not None and req.prompt.rendered.text == req.prompt.text
    assert req.prompt.prefix_class is PrefixClass.SYSTEM and req.prompt.first_user_text == "hello"
    uncapped = build_prompt_request({"model": "m", "messages": [USER]}, CHAT)
    assert uncapped.options.max_tokens == 0  # none given: no cap


def test_token_mode() -> None:
    tok = load_tokenizer()
    req = build_prompt_request({"model": "tiny", "messages": [SYS, USER]}, CHAT, tokenizer=tok)
    assert req.prompt.text is None and req.prompt.text_chars == 0
    assert list(req.prompt.tokens or []) == tok.encode_chat([SYS, USER])
    assert req.prompt.rendered is not None  # the linter still reads the spans
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    # Media: routed on the tokens before the message that holds it (less the last).
    req = build_prompt_request({"model": "tiny", "messages": [SYS, image]}, CHAT, tokenizer=tok)
    before = tok.encode(render_chat([SYS], add_generation_prompt=False) + "<|im_start|>user\n")
    assert list(req.prompt.tokens or []) == before[:-1]
    assert build_prompt_request({"model": "tiny", "messages": [image]}, CHAT).prompt.text


def test_completions_and_the_stated_class() -> None:
    # A batch: each prompt is its own sequence, routed on the first, counted whole.
    req = build_prompt_request({"model": "m", "prompt": ["a", "bc"]}, COMPLETIONS)
    assert req.prompt.text == "a" and req.prompt.first_user_text is None
    assert req.prompt.text_chars == 3
    req = build_prompt_request({"model": "m", "prompt": [[1, 2], [3]]}, COMPLETIONS)
    assert list(req.prompt.tokens or []) == [1, 2] and req.prompt.rendered is None
    assert req.prompt.batch_tokens == 3
    req = build_prompt_request({"model": "m", "prompt": "x"}, COMPLETIONS, prefix_class="Session")
    assert req.prompt.prefix_class is PrefixClass.SESSION
    params = ClassifierParams(document_chars=3)
    req = build_prompt_request({"model": "m", "prompt": "xyz"}, COMPLETIONS, classifier=params)
    assert req.prompt.prefix_class is PrefixClass.DOCUMENT


@pytest.mark.parametrize(
    ("body", "kind", "field", "code"),
    [
        ([1, 2], CHAT, "", "invalid_field"),
        ({"messages": [SYS]}, CHAT, "model", "missing_field"),
        ({"model": "m"}, CHAT, "messages", "missing_field"),
        ({"model": "m", "messages": [SYS], "tools": {}}, CHAT, "tools", "invalid_field"),
        ({"model": "m", "messages": [{"role": ""}]}, CHAT, "messages[0].role", "invalid_field"),
        ({"model": "m", "prompt": [1, -2]}, COMPLETIONS, "prompt", "invalid_field"),
        ({"model": "m", "prompt": "x", "stream": 1}, COMPLETIONS, "stream", "invalid_field"),
    ],
)
def test_errors_name_the_field(body: Any, kind: str, field: str, code: str) -> None:
    with pytest.raises(PromptError) as info:
        build_prompt_request(body, kind)
    assert (info.value.field, info.value.code) == (field, code)


def test_an_unknown_stated_class_is_refused_after_the_prompt() -> None:
    with pytest.raises(PromptError) as info:
        build_prompt_request({"model": "m", "messages": [SYS]}, CHAT, prefix_class="bogus")
    assert info.value.field == "X-Prefix-Class"
    with pytest.raises(PromptError) as info:  # a bad message is reported first
        build_prompt_request({"model": "m", "messages": ["x"]}, CHAT, prefix_class="bogus")
    assert info.value.field == "messages[0]"


_ID_ELEMENTS = st.one_of(
    st.integers(min_value=-3, max_value=2**32 + 3),
    st.booleans(),
    st.floats(allow_nan=False, min_value=0, max_value=10),
    st.text(max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ID_ELEMENTS, max_size=40), st.integers(min_value=1, max_value=8))
def test_token_id_check_matches_the_element_rule_at_any_slice_size(
    seq: list[Any], slice_size: int
) -> None:
    expected = all(
        type(t) is int and 0 <= t < 2**32  # not a bool, a float or a string
        for t in seq
    )
    assert token_ids_ok(seq, slice_size) is expected


def test_a_bad_token_id_past_the_first_slice_is_refused() -> None:
    for bad in (True, -1, 2**32, 1.0):
        ids: list[Any] = list(range(2 * _CHECK_SLICE))
        ids[-1] = bad
        assert not token_ids_ok(ids)
