"""Stable assembly: stable content first, equal inputs give equal bytes, sessions only append."""

from __future__ import annotations

import itertools

import pytest

from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt import (
    PREFIX_CLASS_HEADER,
    Fragment,
    Normalizer,
    PinnedSession,
    StableLayer,
    classify,
    doc_qa_request,
    document_id,
    order_fragments,
    rag_request,
    render_body,
)
from prefixrouter.prompt.lint import common_prefix_len


def infer(body: dict) -> PrefixClass:  # type: ignore[type-arg]
    """The class the gateway, the linter and the analyzer give a body."""
    return classify(render_body(body))


DOC = "\n".join(f"Clause {i}: the supplier delivers item {i} on time." for i in range(80))
TOOLS = (
    {"type": "function", "function": {"name": "search", "parameters": {"q": "string"}}},
    {"type": "function", "function": {"name": "fetch", "parameters": {"url": "string"}}},
)
STABLE = StableLayer(
    "Answer from the context.",
    response_policy="Cite sources.",
    glossary="SLA: service level agreement.",
    rules="Never guess.",
    tool_profile="Use search first.",
    tools=TOOLS,
)


def test_doc_qa_keeps_the_document_before_the_question() -> None:
    a = doc_qa_request(model="m", instruction="Answer.", document=DOC, question="Clause 3?")
    b = doc_qa_request(model="m", instruction="Answer.", document=DOC, question="Clause 7?")
    ta, tb = render_body(a.body).text, render_body(b.body).text
    shared = common_prefix_len(ta, tb)
    assert ta.index("</document>") < shared  # the whole document is a shared prefix
    assert a.body["messages"][-1]["content"].endswith("Clause 3?")
    assert a.headers[PREFIX_CLASS_HEADER] == "document" == a.prefix_class.value
    assert infer(a.body) is PrefixClass.DOCUMENT
    # the per-call tail of the rendered prompt is the question
    rendered = render_body(a.body)
    assert rendered.text[rendered.tail_start :].startswith("Clause 3?")


def test_document_id_is_stable_and_content_derived() -> None:
    a = doc_qa_request(model="m", instruction="i", document=DOC + "\r\n", question="q")
    b = doc_qa_request(model="m", instruction="i", document=DOC, question="q")
    ident = document_id(DOC)
    assert f'<document id="{ident}">' in a.body["messages"][1]["content"]
    assert a.body == b.body  # normalization makes the two documents one
    assert document_id(DOC + "!") != ident
    c = doc_qa_request(model="m", instruction="i", document=DOC, question="q", doc_id="contract-7")
    assert '<document id="contract-7">' in c.body["messages"][1]["content"]


def test_rag_orders_fragments_by_score_then_source_then_position() -> None:
    frags = [
        Fragment("b", 2, 0.5, "B2"),
        Fragment("a", 9, 0.9, "A9"),
        Fragment("b", 1, 0.5, "B1"),
        Fragment("a", 3, 0.5, "A3"),
    ]
    assert [(f.source_id, f.position) for f in order_fragments(frags)] == [
        ("a", 9), ("a", 3), ("b", 1), ("b", 2),
    ]  # fmt: skip
    one = rag_request(model="m", stable=STABLE, fragments=frags, question="Q?")
    other = rag_request(model="m", stable=STABLE, fragments=frags[::-1], question="Q?")
    assert one.body == other.body
    user = one.body["messages"][1]["content"]
    assert user.index("A9") < user.index("A3") < user.index("B1") < user.index("B2")
    assert user.endswith("\n\nQ?")
    assert infer(one.body) is PrefixClass.RAG == one.prefix_class


def test_rag_stable_layer_comes_first_in_a_fixed_section_order() -> None:
    body = rag_request(model="m", stable=STABLE, fragments=[], question="Q").body
    system = body["messages"][0]["content"]
    heads = ["## Instructions", "## Response policy", "## Glossary", "## Rules", "## Tools"]
    assert [system.index(h) for h in heads] == sorted(system.index(h) for h in heads)
    assert [t["function"]["name"] for t in body["tools"]] == ["fetch", "search"]
    reordered = StableLayer(**{**_fields(STABLE), "tools": TOOLS[::-1]})
    again = rag_request(model="m", stable=reordered, fragments=[], question="Q").body
    assert render_body(again).text == render_body(body).text
    # the retrieved layer is the per-call tail: the stable part ends before it
    rendered = render_body(body)
    assert rendered.text[rendered.tail_start :].startswith("<context>")


def _fields(layer: StableLayer) -> dict:  # type: ignore[type-arg]
    return {f: getattr(layer, f) for f in layer.__dataclass_fields__}


def test_pinned_session_only_appends() -> None:
    frags = [Fragment("s", i, 1.0 / (i + 1), f"fact {i}") for i in range(4)]
    session = PinnedSession(model="m", stable=STABLE, fragments=frags)
    texts = []
    for turn in range(3):
        req = session.ask(f"question {turn}?")
        assert req.headers[PREFIX_CLASS_HEADER] == "session"
        texts.append(render_body(req.body).text)
        session.answer(f"answer {turn}")
    for before, after in itertools.pairwise(texts):
        # everything but the generation prompt of turn n is a prefix of turn n+1
        assert after.startswith(before[: -len("<|im_start|>assistant\n")])
    assert texts[2].count("<context>") == 1
    assert infer(session.ask("more?").body) is PrefixClass.SESSION
    with pytest.raises(ValueError):
        session.ask("again?")


def test_builders_use_the_normalizer_and_stamp_its_version() -> None:
    norm = Normalizer(template_version="qa-2")
    req = doc_qa_request(
        model="m", instruction="Be   brief.  ", document="x", question="why?", normalizer=norm,
        params={"max_tokens": 8},
    )  # fmt: skip
    assert req.body["messages"][0]["content"] == "Be brief."
    assert req.body["max_tokens"] == 8
    assert req.headers["X-Prompt-Template"] == norm.version
    with pytest.raises(ValueError):
        doc_qa_request(model="m", instruction="i", document="d", question="q", params={"model": 1})
