"""The normalizer: idempotent, deterministic across processes, verbatim regions untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.prompt import Normalizer, NormalizeRules, normalize, stamp_version
from prefixrouter.prompt.normalize import normalize_messages

# Characters that exercise every rule: blanks, line endings, JSON syntax, fences,
# combining marks (NFC), a full-width letter and a non-BMP character.
ALPHABET = st.sampled_from(
    [" ", " ", "\t", "\n", "\n", "\r", "\r\n", "a", "b", "Z", "1", "{", "}", '"', ":", ",",
     "[", "]", "\\", "`", "```", "~~~", "e\u0301", "\u0301", "\u00e9", "Ａ", "\U0001f600", "x"]
)  # fmt: skip
TEXTS = st.lists(ALPHABET, max_size=60).map("".join)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(" ab\t\u0301é\n", max_size=4),
    lambda inner: (
        st.dictionaries(st.text("abé\u0301", max_size=3), inner, max_size=3)
        | st.lists(inner, max_size=3)
    ),
    max_leaves=8,
)


@given(TEXTS)
@settings(max_examples=400, deadline=None)
def test_idempotent_on_arbitrary_text(text: str) -> None:
    once = normalize(text)
    assert normalize(once) == once


@given(st.lists(st.one_of(TEXTS, JSONISH.map(json.dumps)), max_size=6).map(" ".join))
@settings(max_examples=200, deadline=None)
def test_idempotent_with_embedded_json(text: str) -> None:
    once = normalize(text)
    assert normalize(once) == once


@given(TEXTS)
@settings(max_examples=100, deadline=None)
def test_idempotent_under_every_rule_switched_off(text: str) -> None:
    for rules in (
        NormalizeRules(unicode_form=None),
        NormalizeRules(sort_json_keys=False),
        NormalizeRules(collapse_spaces=False, max_blank_lines=None),
        NormalizeRules(strip_trailing=False, strip_ends=False, max_blank_lines=0),
        NormalizeRules(unicode_form="NFD", line_endings=False),
    ):
        once = normalize(text, rules)
        assert normalize(once, rules) == once


PLAIN = st.text(st.sampled_from(list(' \t\nab{}:"é1')), max_size=40)
CODE = st.text(st.sampled_from(list(' \t\r\nxy{}"=:\u0301é')), max_size=40).filter(
    lambda s: not any(line.strip().startswith(("```", "~~~")) for line in s.splitlines())
)


@given(PLAIN, CODE, PLAIN, st.sampled_from(["```", "~~~", "````"]))
@settings(max_examples=300, deadline=None)
def test_fenced_code_is_verbatim(before: str, code: str, after: str, fence: str) -> None:
    block = f"{fence}python\n{code}\n{fence}"
    text = f"{before}\n{block}\n{after}"
    out = normalize(text)
    assert block in out
    assert normalize(out) == out


@given(PLAIN, CODE)
@settings(max_examples=100, deadline=None)
def test_unclosed_fence_keeps_the_rest_verbatim(before: str, code: str) -> None:
    out = normalize(f"{before}\n```\n{code}")
    assert out.endswith(f"```\n{code}")


@given(PLAIN, st.text(max_size=30), PLAIN)
@settings(max_examples=100, deadline=None)
def test_verbatim_markers(before: str, inner: str, after: str) -> None:
    rules = NormalizeRules(verbatim_markers=(("<keep>", "</keep>"),))
    region = f"<keep>{inner.replace('</keep>', '')}</keep>"
    out = normalize(f"{before}{region}{after}", rules)
    assert region in out


def test_each_rule_does_what_it_says() -> None:
    assert normalize("a\r\nb\rc") == "a\nb\nc"
    assert normalize("a  \t\nb   ") == "a\nb"
    assert normalize("a   b\t\tc") == "a b c"
    assert normalize("    indented   code") == "indented code"  # strip_ends at the start
    assert normalize("x\n    indented   code") == "x\n    indented code"
    assert normalize("a\n\n\n\n\nb") == "a\n\nb"
    assert normalize("a\n\n\n\nb", NormalizeRules(max_blank_lines=0)) == "a\nb"
    assert normalize('cfg {"b": 1,"a": {"d": 2, "c": [3, 4]}} end') == (
        'cfg {"a": {"c": [3, 4], "d": 2}, "b": 1} end'
    )
    assert normalize("e\u0301") == "\u00e9"
    assert normalize("{not json} and {}") == "{not json} and {}"


def test_json_key_order_does_not_change_the_output() -> None:
    a = 'Tools: {"name": "search", "params": {"q": "str", "k": "int"}}'
    b = 'Tools: {"params": {"k": "int", "q": "str"},   "name": "search"}'
    assert normalize(a) == normalize(b)


def test_messages_are_copied_not_mutated() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "a  b"},
        {"role": "x", "content": [
            {"type": "text", "text": "c\r\n"}, {"type": "image_url", "image_url": {"url": "u"}}
        ]},
    ]  # fmt: skip
    out = normalize_messages(msgs)
    assert out[0]["content"] == "a b" and out[1]["content"][0]["text"] == "c"
    assert msgs[0]["content"] == "a  b"


def test_template_version_stamp() -> None:
    n = Normalizer(template_version="rag-v3")
    stamped = n.stamp("Be  brief.")
    assert stamped.startswith(f"[prompt-template {n.version}]\n")
    assert n.stamp(stamped) == stamped
    assert stamp_version(stamped) == n.version
    assert (
        Normalizer(template_version="rag-v4").stamp(stamped).startswith("[prompt-template rag-v4+")
    )
    # the rules are part of the version: changing them changes the cache namespace
    assert Normalizer(NormalizeRules(max_blank_lines=2), "rag-v3").version != n.version
    with pytest.raises(ValueError):
        Normalizer(template_version="")


SAMPLE = 'Sys:  {"z": 1, "a": "é"}\r\n\r\n\r\n```\nkeep   this  \n```\n  tail  \u00e9 e\u0301'


def test_stable_across_processes() -> None:
    code = (
        "import sys, xxhash; from prefixrouter.prompt import normalize, NormalizeRules;"
        f"print(xxhash.xxh3_64_hexdigest(normalize({SAMPLE!r}).encode()),"
        " NormalizeRules().fingerprint())"
    )
    here = f"{__import__('xxhash').xxh3_64_hexdigest(normalize(SAMPLE).encode())} "
    here += NormalizeRules().fingerprint()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        assert out.stdout.strip() == here
