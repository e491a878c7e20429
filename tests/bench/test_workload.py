"""Scenarios as live text traffic: shared segments become shared text, deterministically."""

from __future__ import annotations

import pytest

from prefixrouter.bench.workload import (
    BenchWorkload,
    build_bench_workload,
    live_scenarios,
    warmup_requests,
)
from prefixrouter.errors import ConfigError
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.tokenization import load_tokenizer, render_chat

PROFILE = get_profile("llama3-8b-h100")


def _build(name: str, **kw: object) -> BenchWorkload:
    args: dict[str, object] = {
        "requests": 24, "rate": 8.0, "scale": 0.1, "workers": 2, "profile": PROFILE,
        "tokenizer": load_tokenizer(),
    }  # fmt: skip
    args.update(kw)
    return build_bench_workload(name, **args)  # type: ignore[arg-type]


def test_doc_qa_requests_share_their_document_text_and_nothing_else() -> None:
    w = _build("doc-qa")
    by_group: dict[str, set[str]] = {}
    for r in w.requests:
        system, user = r.body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        doc, _question = user["content"].rsplit("\n\n", 1)
        by_group.setdefault(r.group, set()).add(system["content"] + doc)
        assert r.body["stream"] and r.body["ignore_eos"] and r.body["max_tokens"] >= 1
    assert len(by_group) == 3 and all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3


def test_text_length_follows_the_scaled_token_count() -> None:
    tok = load_tokenizer()
    w = _build("unique", requests=10)
    base = get_scenario("unique").build(0, 10).lengths_scaled(0.1)
    for r, s in zip(w.requests, base.requests, strict=True):
        n = len(tok.encode(render_chat(r.body["messages"], None, add_generation_prompt=True)))
        assert abs(n - s.prompt_tokens) <= 0.2 * s.prompt_tokens + 8


def test_multi_turn_prompts_extend_the_previous_turn() -> None:
    w = _build("multi-turn", requests=30)
    last: dict[str, list[dict[str, str]]] = {}
    extended = 0
    for r in w.requests:
        msgs = r.body["messages"]
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * (len(msgs) // 2 - 1) + [
            "user"
        ]
        prev = last.get(r.group)
        if prev is not None:
            assert msgs[: len(prev)] == prev
            extended += 1
        last[r.group] = msgs
    assert extended > 0


def test_deterministic_and_timed_at_the_rate() -> None:
    a, b = _build("system-prompt", seed=3), _build("system-prompt", seed=3)
    assert a.requests == b.requests
    offsets = [r.offset_s for r in a.requests]
    assert offsets == sorted(offsets) and 1.0 < offsets[-1] < 8.0  # 24 requests at 8/s


def test_time_scale_puts_the_fleet_at_the_load() -> None:
    lo = _build("doc-qa", load=0.4)
    hi = _build("doc-qa", load=0.8)
    assert lo.time_scale == pytest.approx(2 * hi.time_scale)
    fixed = _build("doc-qa", time_scale=1.0)
    assert fixed.time_scale == 1.0 and fixed.load > 0
    assert hi.kv_blocks == 600  # 6,000 blocks x 0.1


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="live scenarios"):
        _build("mooncake-conversation")
    with pytest.raises(ConfigError, match="scale"):
        _build("doc-qa", scale=1.5)
    assert "doc-qa" in live_scenarios()


def test_warmup_prompts_are_unique() -> None:
    reqs = warmup_requests(5, tokens=100, tokenizer=load_tokenizer())
    texts = {r.body["messages"][0]["content"][3:50] for r in reqs}
    assert len(texts) == 5 and all(r.body["max_tokens"] == 1 for r in reqs)
