"""The decision log's records: fields, values and order, ring and file."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixrouter.core import (
    CacheNamespace,
    Decision,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.policy import Outcome
from prefixrouter.gateway import decision_log
from prefixrouter.gateway.decision_log import DecisionLog, RequestOutcome


def _decision(rid: str = "r1", text: str = "<|user|>\nhello\n" * 200) -> Decision:
    router = Router()
    views = [WorkerView(WorkerId(f"w{i}")) for i in range(3)]
    req = RoutingRequest(RequestId(rid), CacheNamespace("tiny"), text=text, max_tokens=8)
    d = router.route(req, views, 1.0)
    router.on_routed(d, 1.0)
    router.on_completed(d, Outcome(16, 0.01, True), 1.1)
    return d


def _outcome(**kw: Any) -> RequestOutcome:
    fields: dict[str, Any] = {
        "model": "tiny",
        "tenant": "acme",
        "status": 200,
        "actual_cached_tokens": 16,
        "prompt_tokens": 40,
        "ttft_s": 0.0123456,
        "latency_s": 0.0456789,
        "attempts": 2,
        "retried_from": ("w9",),
        "stream": True,
        "error": None,
        "ts": 1700000000.1234567,
    }
    fields.update(kw)
    return RequestOutcome(**fields)


def _expected(d: Decision, o: RequestOutcome) -> dict[str, Any]:
    """The record as the decision's own to_dict plus the outcome (the documented layout)."""
    rec = d.to_dict()
    terms = d.chosen.terms if d.chosen is not None else None
    actual, prompt = o.actual_cached_tokens, o.prompt_tokens
    rec.update(
        model=o.model,
        tenant=o.tenant,
        decision={"tier": d.tier, "reason": d.reason, "policy": d.policy},
        actual_cached_tokens=actual,
        queue_wait_ms=round(terms.queue_wait_s * 1e3, 3) if terms is not None else None,
        predicted_ttft_ms=round(terms.ttft_s * 1e3, 3) if terms is not None else None,
        prefill_tokens=(prompt - actual) if prompt is not None and actual is not None else None,
        estimated_prompt_tokens=d.prompt_tokens,
        prompt_tokens=prompt,
        ttft_ms=round(o.ttft_s * 1e3, 3) if o.ttft_s is not None else None,
        latency_ms=round(o.latency_s * 1e3, 3),
        status=o.status,
        attempts=o.attempts,
        retried_from=list(o.retried_from),
        stream=o.stream,
        error=o.error,
        ts=round(o.ts, 6),
    )
    return rec


def test_record_is_the_decision_plus_the_outcome_in_order() -> None:
    d = _decision()
    outcomes = [
        _outcome(),
        _outcome(actual_cached_tokens=None, prompt_tokens=None, ttft_s=None, retried_from=()),
        _outcome(status=502, error="w0: answered 503", stream=False),
    ]
    log = DecisionLog(None)
    for o in outcomes:
        log.record(d, o)
    got = log.recent(10)
    assert len(got) == 3
    for rec, o in zip(got, outcomes, strict=True):
        want = _expected(d, o)
        assert rec == want
        assert list(rec) == list(want)  # key order too: the file is read by people
    assert got[0]["candidate_workers"] and got[0]["queue_wait_ms"] is not None
    assert got[1]["retried_from"] == [] and got[1]["prefill_tokens"] is None


def test_ring_does_not_keep_the_routing_context() -> None:
    # The context holds the rendered prompt and its block hashes; the ring
    # must not keep them alive for its thousand entries.
    log = DecisionLog(None, ring_size=4)
    d = _decision()
    ctx_type = type(d.context)
    log.record(d, _outcome())
    del d
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is ctx_type and o.request.request_id == "r1"]
    assert log.recent(1)[0]["request_id"] == "r1"


def test_ring_keeps_the_newest_and_the_file_gets_every_record(tmp_path: Path) -> None:
    path = tmp_path / "log" / "d.jsonl"
    log = DecisionLog(path, ring_size=2)
    for i in range(3):
        log.record(_decision(f"r{i}"), _outcome())
    assert [r["request_id"] for r in log.recent(5)] == ["r1", "r2"]
    assert log.recent(0) == []
    assert log.flush() == 3 and log.flush() == 0
    log.close()
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2"]
    assert rows[0]["retried_from"] == ["w9"] and rows[0]["tenant"] == "acme"


def test_a_memory_only_log_opens_nothing_and_counts_every_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The file's own behaviour (refused at open, outages, the bound) is test_log_files.py's.
    monkeypatch.setattr(decision_log, "MAX_PENDING", 2)
    log = DecisionLog(None)
    log.open()  # no path: nothing to open, no error
    for _ in range(5):
        log.record(_decision(), _outcome())
    assert log.recorded == 5 and log.dropped == 0  # no file: nothing is waiting for one
