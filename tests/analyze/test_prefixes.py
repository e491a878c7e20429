"""Streaming prefix analysis: known reuse numbers, LRU limits, divergences, memory bounds."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from prefixrouter.analyze import (
    AnalyzeParams,
    LogRecord,
    PrefixCounter,
    SampledReuse,
    analyze_log,
    analyze_records,
    load_encoder,
)
from prefixrouter.core.hashing import hash_text_blocks
from prefixrouter.core.types import PrefixClass
from prefixrouter.prompt import Fragment, PinnedSession, StableLayer, doc_qa_request, render_body

SHARED_WORDS = [f"w{i}" for i in range(2000)]


def _write(path: Path, bodies: list[dict]) -> Path:  # type: ignore[type-arg]
    path.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in bodies))
    return path


def _records(bodies: list[dict]) -> list[LogRecord]:  # type: ignore[type-arg]
    return [LogRecord(i + 1, b, None, "ns") for i, b in enumerate(bodies)]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer: one token per whitespace-separated word."""
    words = [*SHARED_WORDS, *(f"q{i}x{j}" for i in range(10) for j in range(10))]
    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_same_2000_token_prefix_token_mode(tmp_path: Path, word_tokenizer: Path) -> None:
    # completions bodies render as their prompt: 2,000 shared words, then 10 unique words
    shared = " ".join(SHARED_WORDS)
    bodies = [
        {"model": "m", "prompt": shared + " " + " ".join(f"q{i}x{j}" for j in range(10))}
        for i in range(10)
    ]
    report, _ = analyze_log(_write(tmp_path / "log.jsonl", bodies), encoder=load_encoder(
        word_tokenizer))  # fmt: skip
    assert report["mode"] == "token"
    assert report["requests"] == 10
    assert report["prompt_tokens"] == 10 * 2010
    assert report["reusable_tokens_unlimited"] == 9 * 2000  # 125 whole blocks of 16
    assert report["reusable_share_unlimited"] == round(18000 / 20100, 4)
    assert report["reusable_tokens_kv"] == 9 * 2000  # 500,000 KV tokens hold it all
    (top,) = report["top_prefixes"]
    assert (top["tokens"], top["count"], top["saved_tokens"]) == (2000, 10, 9 * 2000)
    assert top["text_start"].startswith("w0 w1 w2")
    assert top["text_end"].endswith("w1998 w1999")
    assert report["shared_prefix_tokens"]["max"] == 2000
    assert report["shared_prefix_tokens"]["requests_sharing"] == 9


def test_same_2000_token_prefix_text_mode() -> None:
    # text mode: 8,000 characters = 2,000 estimated tokens = 125 chunks of 64 characters
    shared = "".join(f"{i:07d}," for i in range(1000))
    assert len(shared) == 8000
    bodies = [{"prompt": shared + f"question {i:02d} about it?".ljust(40, "!")} for i in range(10)]
    a = analyze_records(_records(bodies))
    assert a.mode == "text"
    assert a.prompt_tokens == 10 * 2010
    assert a.reusable_unlimited == 9 * 2000
    assert a.top_prefixes[0].tokens == 2000 and a.top_prefixes[0].count == 10


def test_kv_limited_reuse_is_below_unlimited_when_capacity_is_small() -> None:
    docs = [f"Document {d}. " + "".join(f"{d}:{i:06d} " for i in range(800)) for d in range(20)]
    bodies = [
        doc_qa_request(model="m", instruction="Answer.", document=docs[d], question=f"Q{r}?").body
        for r in range(2)
        for d in range(20)
    ]  # every document twice, 19 others in between
    small = analyze_records(_records(bodies), AnalyzeParams(kv_tokens=4_000))
    large = analyze_records(_records(bodies), AnalyzeParams(kv_tokens=10_000_000))
    assert small.reusable_unlimited == large.reusable_unlimited > 20 * 1900
    assert large.reusable_kv == large.reusable_unlimited
    assert small.reusable_kv < 0.05 * small.reusable_unlimited  # all evicted before reuse
    none = analyze_records(_records(bodies), AnalyzeParams(kv_tokens=0))
    assert none.reusable_kv == 0


def test_lru_keeps_the_start_of_a_prefix_longer_than_the_cache() -> None:
    reuse = SampledReuse(capacity_blocks=10, max_samples=1_000)
    chain = hash_text_blocks(1, "x" * 64 * 50, 64)  # 50 blocks, cache holds 10
    assert reuse.access(chain) == (0, 0)
    assert reuse.access(chain) == (50, 10)  # the first 10 blocks stayed: prefix-closed


def test_hidden_timestamp_divergence_position() -> None:
    rules = "\n".join(f"Rule {i}: be exact about topic {i} and cite it." for i in range(100))
    bodies = [
        {"messages": [
            {"role": "system", "content": f"You help. Time: 2024-05-01T10:00:{i:02d}Z\n{rules}"},
            {"role": "user", "content": f"question number {i}?"},
        ]}
        for i in range(12)
    ]  # fmt: skip
    a = analyze_records(_records(bodies))
    text = render_body(bodies[0]).text
    pos = text.index("2024-05-01T")
    (d,) = a.divergences
    assert d.char_position == pos
    assert d.token_position == round(pos / 4)
    assert d.text.startswith("2024-05-01T10:00:") and d.text.endswith("Z")
    assert d.requests == 12
    assert d.stable_tokens_after >= len(rules) // 4 - 2
    # the timestamp kills reuse: only the text before it is shared
    assert a.reusable_unlimited < 0.05 * a.prompt_tokens


def test_no_divergence_reported_when_only_the_question_differs() -> None:
    doc = "Some fixed document text. " * 200
    bodies = [{"prompt": f"{doc}\n\nQuestion {i}: what?"} for i in range(10)]
    assert analyze_records(_records(bodies)).divergences == []


def test_per_class_breakdown() -> None:
    stable = StableLayer("Answer from the context only. " * 30)
    frags = [Fragment("kb", i, 1.0, f"fact {i} " * 40) for i in range(3)]
    bodies: list[dict] = []  # type: ignore[type-arg]
    session = PinnedSession(model="m", stable=stable, fragments=frags)
    for turn in range(5):
        bodies.append(session.ask(f"turn {turn}?").body)
        session.answer(f"answer {turn} " * 30)
    doc = "Contract text. " * 600
    bodies += [
        doc_qa_request(model="m", instruction="Answer.", document=doc, question=f"Q{i}").body
        for i in range(5)
    ]
    system = "You are the support bot of ACME. " * 40
    sys_msg = {"role": "system", "content": system}
    bodies += [{"messages": [sys_msg, {"role": "user", "content": f"hi {i}"}]} for i in range(5)]
    bodies.append({"messages": [{"role": "user", "content": f"hello {random.random()}"}]})
    records = _records(bodies)
    records.append(LogRecord(99, {"prompt": "tagged " * 10}, None, "ns"))
    a = analyze_records(records)
    # a pinned session's first turn is one user turn with retrieved context: rag
    assert {k: v.requests for k, v in a.by_class.items()} == {
        "document": 5, "rag": 1, "session": 4, "system": 5, "unknown": 2,
    }  # fmt: skip
    for name in ("document", "session", "system"):
        s = a.by_class[name]
        assert s.reusable_unlimited > 0.5 * s.prompt_tokens, name
    assert a.by_class["unknown"].reusable_unlimited == 0
    explicit = analyze_records([LogRecord(1, bodies[0], _rag(), "ns")])
    assert set(explicit.by_class) == {"rag"}


def _rag() -> PrefixClass:
    return PrefixClass.RAG


def test_prefix_counter_respects_its_cap() -> None:
    counter = PrefixCounter(cap=100)
    hot = hash_text_blocks(7, "h" * 64 * 5, 64)
    rng = random.Random(1)
    for i in range(400):
        unique = hash_text_blocks(i, "".join(rng.choice("ab") for _ in range(64 * 4)), 64)
        counter.add(unique)
        if i % 4 == 0:
            counter.add(hot)
        assert len(counter) <= 100
    assert counter.prunes > 0 and counter.error_bound > 0
    # the hot prefix survives, its count a lower bound within the error bound
    assert 100 - counter.error_bound <= counter.count(hot[-1]) <= 100
    assert counter.depth(hot[-1]) == 4


def test_sampled_reuse_respects_its_cap_and_estimates() -> None:
    rng = random.Random(3)
    prompts = [hash_text_blocks(p, "p" * 64 * 50, 64) for p in range(200)]
    order = [p for p in range(200) for _ in range(5)]
    rng.shuffle(order)
    reuse = SampledReuse(capacity_blocks=10**9, max_samples=2_000)
    total = 0.0
    for p in order:
        hit, _ = reuse.access(prompts[p])
        total += hit
        assert len(reuse) <= 2_000
    assert reuse.rate < 0.5 and reuse.resamples > 0
    exact = 4 * 200 * 50  # every prompt's last four sends are full hits
    assert abs(total - exact) < 0.15 * exact


def test_params_validation() -> None:
    with pytest.raises(ValueError):
        AnalyzeParams(block_size=0)
    with pytest.raises(ValueError):
        AnalyzeParams(kv_tokens=-1)
