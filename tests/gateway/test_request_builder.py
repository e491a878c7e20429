"""Request body -> routing request: the gateway's 400s, prompt text, namespace, prefix class.

The pure request path has its own tests (``tests/prompt/test_request.py``);
these hold the gateway's side: the same field errors as OpenAI-style 400s,
the tenancy and namespace, and what the router gets."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.core.types import PrefixClass
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.errors import BadRequest
from prefixrouter.gateway.request_builder import (
    CHAT,
    COMPLETIONS,
    BuiltRequest,
    RequestBuilder,
)
from prefixrouter.gateway.tenancy import Tenancy, TenantScope
from prefixrouter.prompt.classify import classify
from prefixrouter.prompt.render import render_body
from prefixrouter.tokenization import render_chat

SYS: dict[str, Any] = {"role": "system", "content": "You are a careful assistant."}


def _builder(data: dict[str, Any] | None = None, tokenizer: Any = None) -> RequestBuilder:
    cfg = config_from_dict(data or {})
    return RequestBuilder(cfg, lambda: frozenset({"lora-a"}), tokenizer)


def _build(body: Any, kind: str = CHAT, header: str | None = None, **kw: Any) -> BuiltRequest:
    b = kw.pop("builder", None) or _builder()
    scope = kw.pop("scope", TenantScope("", "", None))
    return b.build(body, orjson.dumps(body), kind, lambda salt: scope, header)


def _chat(*messages: object, **extra: Any) -> dict[str, Any]:
    """A chat body; its messages may be malformed on purpose (the bad-input cases)."""
    return {"model": "tiny", "messages": list(messages), **extra}


@pytest.mark.parametrize(
    ("body", "kind", "param", "code"),
    [
        ([1, 2], CHAT, None, "invalid_field"),
        ({"messages": [SYS]}, CHAT, "model", "missing_field"),
        ({"model": 3, "messages": [SYS]}, CHAT, "model", "invalid_field"),
        ({"model": "tiny"}, CHAT, "messages", "missing_field"),
        ({"model": "tiny", "messages": []}, CHAT, "messages", "invalid_field"),
        ({"model": "tiny", "messages": "hi"}, CHAT, "messages", "invalid_field"),
        (_chat(SYS, {"content": "x"}), CHAT, "messages[1].role", "missing_field"),
        (_chat({"role": "", "content": "x"}), CHAT, "messages[0].role", "invalid_field"),
        (_chat({"role": "user", "content": 5}), CHAT, "messages[0].content", "invalid_field"),
        (_chat(SYS, "not an object"), CHAT, "messages[1]", "invalid_field"),
        (_chat(SYS, stream="yes"), CHAT, "stream", "invalid_field"),
        (_chat(SYS, stream_options=[]), CHAT, "stream_options", "invalid_field"),
        (
            _chat(SYS, stream_options={"include_usage": 1}),
            CHAT,
            "stream_options.include_usage",
            "invalid_field",
        ),
        (_chat(SYS, max_tokens=0), CHAT, "max_tokens", "invalid_field"),
        (_chat(SYS, max_completion_tokens="8"), CHAT, "max_completion_tokens", "invalid_field"),
        # Both are checked, as vLLM checks them, though the first one given counts.
        (_chat(SYS, max_completion_tokens=8, max_tokens="x"), CHAT, "max_tokens", "invalid_field"),
        (_chat(SYS, tools={"a": 1}), CHAT, "tools", "invalid_field"),
        (_chat(SYS, cache_salt=7), CHAT, "cache_salt", "invalid_field"),
        ({"model": "tiny"}, COMPLETIONS, "prompt", "missing_field"),
        ({"model": "tiny", "prompt": 5}, COMPLETIONS, "prompt", "invalid_field"),
        ({"model": "tiny", "prompt": ["a", 1]}, COMPLETIONS, "prompt", "invalid_field"),
        ({"model": "tiny", "prompt": [1, -2]}, COMPLETIONS, "prompt", "invalid_field"),
        ({"model": "tiny", "prompt": [2**32]}, COMPLETIONS, "prompt", "invalid_field"),
        ({"model": "tiny", "prompt": [[1], "x"]}, COMPLETIONS, "prompt[1]", "invalid_field"),
    ],
)
def test_bad_fields_are_named(body: Any, kind: str, param: str | None, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        _build(body, kind)
    assert info.value.param == param
    assert info.value.code == code
    assert info.value.status == 400
    if param:
        assert param in info.value.message


def test_unknown_prefix_class_header_is_a_bad_request() -> None:
    with pytest.raises(BadRequest) as info:
        _build(_chat(SYS), header="bogus")
    assert info.value.param == "X-Prefix-Class"


def test_text_mode_routes_the_text_the_engine_sees() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    msgs: list[dict[str, Any]] = [
        SYS,
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"},
    ]
    rr = _build(_chat(*msgs, tools=tools)).routing
    swapped = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    assert rr.text == _build(_chat(*msgs, tools=swapped)).routing.text  # canonical tool JSON
    assert rr.text == render_chat(msgs, tools)  # the bundled model's chat template, exactly
    assert rr.text is not None and rr.text.startswith(
        "<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n"
    )
    assert "<|im_start|>user\nhi<|im_end|>\n" in rr.text
    assert rr.first_user_text == "hi"
    user = _build(_chat({"role": "user", "content": "x"})).routing.text
    assert user != _build(_chat({"role": "system", "content": "x"})).routing.text


def test_built_request_fields() -> None:
    body = _chat(SYS, {"role": "user", "content": "q"}, stream=True, max_tokens=12, temperature=0)
    built = _build(body)
    rr = built.routing
    assert built.stream and not built.client_wants_usage
    assert rr.max_tokens == 12 and rr.model == "tiny" and rr.text is not None
    assert built.text_chars == len(rr.text) and rr.tokens is None
    assert rr.namespace.model_revision == "tiny" and rr.namespace.tenant == ""
    assert rr.prefix_class is PrefixClass.SYSTEM
    built = _build(_chat(SYS, stream=True, stream_options={"include_usage": True}))
    assert built.client_wants_usage


def test_adapters_and_tenants_enter_the_namespace() -> None:
    built = _build(_chat(SYS, model="lora-a"))
    assert built.routing.adapter == "lora-a" and built.routing.model == ""
    assert built.routing.namespace.adapter_id == "lora-a"
    a = _build(_chat(SYS), scope=TenantScope("acme", "tenant:acme", "salt")).routing.namespace
    b = _build(_chat(SYS), scope=TenantScope("globex", "tenant:globex", "salt2")).routing.namespace
    assert a.seed != b.seed
    b2 = _builder({"routing": {"template_version": "v2"}})
    assert _build(_chat(SYS), builder=b2).routing.namespace.template_version == "v2"


def test_completions_prompts() -> None:
    assert _build({"model": "tiny", "prompt": "abc"}, COMPLETIONS).routing.text == "abc"
    rr = _build({"model": "tiny", "prompt": [1, 2, 3]}, COMPLETIONS).routing
    assert list(rr.tokens or []) == [1, 2, 3] and rr.prompt_tokens == 3
    batch = _build({"model": "tiny", "prompt": [[1, 2], [3]]}, COMPLETIONS)
    assert list(batch.routing.tokens or []) == [1, 2]  # a batch routes on its first prompt
    assert batch.batch and batch.batch_tokens == 3
    long = _build({"model": "tiny", "prompt": "x" * 5000}, COMPLETIONS).routing
    assert long.prefix_class is PrefixClass.DOCUMENT


def _m(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


@pytest.mark.parametrize(
    ("messages", "tools", "expected"),
    [
        ([_m("user", "hi")], None, PrefixClass.UNKNOWN),
        ([_m("system", "s"), _m("user", "hi")], None, PrefixClass.SYSTEM),
        ([_m("user", "hi")], [{"type": "function"}], PrefixClass.SYSTEM),
        ([_m("system", "s"), _m("user", "d" * 4000)], None, PrefixClass.DOCUMENT),
        ([_m("user", "[1] a\n[2] b\nQ?")], None, PrefixClass.RAG),
        ([_m("user", "Source: a\nSource: b")], None, PrefixClass.RAG),
        ([_m("user", "hi"), _m("assistant", "yo"), _m("user", "more")], None, PrefixClass.SESSION),
        ([_m("user", "hi"), _m("tool", "{}"), _m("user", "x")], None, PrefixClass.SESSION),
    ],
)
def test_prefix_class_inference(
    messages: list[dict[str, Any]], tools: list[Any] | None, expected: PrefixClass
) -> None:
    body = _chat(*messages, **({"tools": tools} if tools else {}))
    assert _build(body).routing.prefix_class is expected


def test_document_chars_of_the_config_feed_the_classifier() -> None:
    body = _chat(_m("user", "d" * 1000))
    assert _build(body).routing.prefix_class is PrefixClass.UNKNOWN
    b = _builder({"routing": {"document_chars": 1000}})
    assert _build(body, builder=b).routing.prefix_class is PrefixClass.DOCUMENT


_CLASS_CASES = [
    ([_m("user", "hi")], None),
    ([_m("system", "s"), _m("user", "hi")], None),
    ([_m("developer", "s"), _m("user", "hi")], None),
    ([_m("user", "hi")], [{"type": "function"}]),
    ([_m("system", "s"), _m("user", "d" * 4000)], None),
    ([_m("system", "d" * 4000), _m("user", "hi")], None),
    ([_m("user", "[1] a\n[2] b\nQ?")], None),
    ([_m("user", "[1] a only")], None),
    ([_m("user", "<document a/><document b/>")], None),
    ([_m("user", "<document a/> once")], None),
    ([_m("user", "Source: a\nSource: b")], None),
    ([_m("user", "Source:Source:")], None),
    ([_m("user", "Source: once")], None),
    ([_m("user", "[1] [2]"), _m("user", "plain")], None),
    ([_m("user", "hi"), _m("assistant", "yo"), _m("user", "more")], None),
    ([_m("user", "hi"), _m("tool", "{}"), _m("user", "x")], None),
    ([_m("user", "hi"), _m("assistant", "yo")], None),
    ([{"role": "user", "content": [{"type": "text", "text": "[1] [2]"}]}], None),
    ([{"role": "user", "content": None}, _m("system", "s")], None),
]


@pytest.mark.parametrize("mode", ["text", "token"])
@pytest.mark.parametrize(("messages", "tools"), _CLASS_CASES)
def test_built_class_is_the_inferred_class(
    messages: list[dict[str, Any]], tools: list[Any] | None, mode: str
) -> None:
    # The gateway's class is the one classifier's, in either mode (what the
    # linter and the analyzer give the same body).
    from prefixrouter.tokenization import load_tokenizer

    tok = load_tokenizer() if mode == "token" else None
    b = _builder({"routing": {"mode": mode}}, tokenizer=tok)
    body = _chat(*messages, **({"tools": tools} if tools else {}))
    rr = _build(body, builder=b).routing
    assert rr.prefix_class is classify(render_body(body))
    assert (rr.text is None) is (mode == "token")
    users = [m["content"] for m in messages if m["role"] == "user"]
    first_user = None
    if users:
        c = users[0]
        first_user = c if isinstance(c, str) else "\n".join(p["text"] for p in c or [])
    assert rr.first_user_text == first_user


def test_tool_calls_follow_the_message_text() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msgs = [_m("user", "hi"), {"role": "assistant", "content": "ok", "tool_calls": calls}]
    assert _build(_chat(*msgs)).routing.text == (
        "<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\nok\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_prefix_class_header_wins() -> None:
    built = _build(_chat(SYS), header="RAG")
    assert built.routing.prefix_class is PrefixClass.RAG


def test_token_mode_uses_the_chat_template_and_tokenizer() -> None:
    from prefixrouter.tokenization import load_tokenizer

    tok = load_tokenizer()
    b = _builder({"routing": {"mode": "token"}}, tokenizer=tok)
    built = _build(_chat(SYS, {"role": "user", "content": "hello"}), builder=b)
    rr = built.routing
    assert rr.text is None and rr.tokens is not None
    assert list(rr.tokens) == tok.encode(tok.apply_chat_template([SYS, _m("user", "hello")]))
    assert rr.namespace.tokenizer_revision == tok.revision and built.text_chars == 0
    comp = _build({"model": "tiny", "prompt": "hello"}, COMPLETIONS, builder=b).routing
    assert list(comp.tokens or []) == tok.encode("hello")


def test_tenancy_scope_is_used() -> None:
    cfg = config_from_dict(
        {"tenants": {"acme": {"share_cache": False}}, "api_keys": {"k": "acme", "k2": "globex"}}
    )
    ten = Tenancy(cfg)
    b = RequestBuilder(cfg, frozenset)
    body = _chat(SYS)
    built = b.build(body, b"", CHAT, lambda s: ten.resolve("Bearer k", None, s), None)
    assert built.scope.tenant == "acme" and built.routing.namespace.tenant == "tenant:acme"
    # The tenant the workers' lists admit, also for tenants that share (empty namespace field).
    assert built.routing.tenant == "acme"
    shared = b.build(body, b"", CHAT, lambda s: ten.resolve("Bearer k2", None, s), None)
    assert shared.routing.tenant == "globex" and shared.routing.namespace.tenant == ""


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]) | _json},
    optional={"content": _json, "name": _json, "tool_calls": _json},
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", ""]) | _json,
        "messages": st.lists(_message | _json, max_size=3) | _json,
        "prompt": _json | st.lists(st.integers(0, 2**33), max_size=5),
        "stream": _json,
        "stream_options": _json,
        "max_tokens": _json,
        "tools": _json,
        "cache_salt": _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(body=_body | _json, kind=st.sampled_from([CHAT, COMPLETIONS]))
def test_any_json_body_is_a_routing_request_or_a_named_400(body: Any, kind: str) -> None:
    from prefixrouter.core.router import Router
    from prefixrouter.core.types import WorkerId, WorkerView

    try:
        built = _build(body, kind)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message
        return
    # whatever passed validation can be routed
    Router().route(built.routing, [WorkerView(WorkerId("w0"))], 0.0)


@pytest.mark.parametrize("mode", ["text", "token"])
def test_one_render_per_request_with_the_linter_on(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observer lints the prompt the builder rendered for routing; it renders nothing."""
    from prefixrouter.prompt import lint as lint_mod
    from prefixrouter.prompt import request as request_mod
    from prefixrouter.prompt.lint import LintObserver
    from prefixrouter.prompt.render import render_chat as render_prompt
    from prefixrouter.tokenization import load_tokenizer

    renders: list[int] = []
    real = render_prompt  # what request_mod.render_chat names

    def counted(*args: Any, **kw: Any) -> Any:
        renders.append(1)
        return real(*args, **kw)

    def refused(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the observer rendered the body again")

    monkeypatch.setattr(request_mod, "render_chat", counted)
    monkeypatch.setattr(lint_mod, "render_body", refused)
    b = _builder({"routing": {"mode": mode}}, load_tokenizer() if mode == "token" else None)
    rules = "\n".join(f"Rule {i}: cite the minutes of meeting {i}." for i in range(80))
    body = _chat(_m("system", f"Report generated 2024-05-01T10:00:00Z.\n{rules}"), _m("user", "q"))
    built = _build(body, builder=b)
    obs = LintObserver()
    assert obs.observe(built.prompt, built.routing.prefix_class) == {"timestamp": 1}
    assert renders == [1] and obs.requests() == {"system": 1}
