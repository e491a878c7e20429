"""The log reader: bodies, wrapped records and decision logs; malformed lines skipped by number."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson

from prefixrouter.analyze import iter_records, parse_record
from prefixrouter.core.types import CacheNamespace, PrefixClass

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path: Path) -> None:
    lines = [
        orjson.dumps(BODY),  # 1
        b"{not json",  # 2
        b"",  # 3: blank, skipped silently
        b"[1, 2]",  # 4
        orjson.dumps({"prefix_key": "ab", "selected_worker": "w1"}),  # 5: no body, no length
        orjson.dumps({"messages": "nope"}),  # 6
        orjson.dumps({"messages": [1]}),  # 7
        orjson.dumps({"prompt": [1, 2, 3]}),  # 8
        b"\xff\xfe",  # 9: not UTF-8
        orjson.dumps({"prompt": "ok"}),  # 10
    ]
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    errors: list[tuple[int, str]] = []
    records = list(iter_records(path, lambda n, why: errors.append((n, why))))
    assert [r.line for r in records] == [1, 10]
    assert [n for n, _ in errors] == [2, 4, 5, 6, 7, 8, 9]
    reasons = dict(errors)
    assert reasons[2].startswith("invalid JSON")
    assert reasons[4] == "expected a JSON object, got list"
    assert reasons[5] == "decision record without a body or a prompt length"
    assert reasons[7] == "messages[0] is not an object"


def test_decision_records_and_wrappers(tmp_path: Path) -> None:
    decision = {
        "request_id": "r1",
        "namespace": "llama|tok||v3|acme",
        "prefix_class": "document",
        "selected_worker": "w2",
        "request": BODY,
        "usage": {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}},
    }
    rec = parse_record(decision, 3)
    assert not isinstance(rec, str)
    assert rec.line == 3 and rec.body == BODY
    assert rec.prefix_class is PrefixClass.DOCUMENT
    assert rec.namespace == "llama|tok||v3|acme"
    assert (rec.prompt_tokens, rec.cached_tokens) == (120, 96)
    wrapped = parse_record({"body": BODY, "headers": {"x-prefix-class": "RAG"}})
    assert not isinstance(wrapped, str) and wrapped.prefix_class is PrefixClass.RAG
    plain = parse_record(BODY)
    assert not isinstance(plain, str)
    assert plain.prefix_class is None and plain.namespace == CacheNamespace("m1").key
    unknown = parse_record({**decision, "prefix_class": "unknown"})
    assert not isinstance(unknown, str) and unknown.prefix_class is None  # infer it instead
    gz = tmp_path / "log.jsonl.gz"
    with gzip.open(gz, "wb") as fh:
        fh.write(orjson.dumps(decision) + b"\n" + orjson.dumps(BODY) + b"\n")
    assert [r.line for r in iter_records(gz)] == [1, 2]


def test_gateway_decision_log_without_bodies(tmp_path: Path) -> None:
    from prefixrouter.analyze import analyze_log

    def record(i: int, key: str, cls: str) -> dict:  # type: ignore[type-arg]
        # the fields prefixrouter.gateway.decision_log writes (no request body)
        return {
            "request_id": f"r{i}", "model": "m", "tenant": "t", "namespace": "m||||t",
            "prefix_key": key, "prefix_class": cls, "selected_worker": "w1",
            "predicted_cached_tokens": 0, "actual_cached_tokens": 900 if i else 0,
            "estimated_prompt_tokens": 2950, "prompt_tokens": 3000,
        }  # fmt: skip

    lines = [record(i, "k-doc", "document") for i in range(10)]
    lines += [record(10 + i, f"k-{i}", "unknown") for i in range(5)]
    path = tmp_path / "decisions.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    rec = next(iter_records(path))
    assert rec.prefix_key == "k-doc" and rec.body == {} and rec.prompt_tokens == 3000
    report, _ = analyze_log(path)
    assert report["mode"] == "prefix-key" and report["key_only_requests"] == 15
    assert report["prompt_tokens"] == 15 * 3000
    # the key stands for the first 1,024 tokens: reuse is counted up to that depth
    assert report["reusable_tokens_unlimited"] == 9 * 1024
    assert report["by_class"]["document"]["reusable_tokens_unlimited"] == 9 * 1024
    assert report["top_prefixes"][0]["count"] == 10
    assert report["top_prefixes"][0]["text_start"] == "prefix_key k-doc"
    assert report["observed_cached_share"] == round(14 * 900 / (15 * 3000), 4)
