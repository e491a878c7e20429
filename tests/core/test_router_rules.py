"""The router's own rules, ahead of and around any policy: filters, the decision record, purity.

The default policy's rules have their tests in ``tests/core/policies/prefix_aware/``.
"""

from __future__ import annotations

import pytest

from prefixrouter.core import (
    CacheNamespace,
    Outcome,
    Router,
    WorkerId,
    WorkerView,
)
from prefixrouter.errors import NoWorkerAvailable
from tests.core.conftest import NS, request, tokens, warm, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")


@pytest.mark.parametrize(
    ("worker", "req_kw", "filter_name"),
    [
        (WorkerView(W0, healthy=False), {}, "health"),
        (WorkerView(W0, models=frozenset({"other"})), {"model": "m"}, "model"),
        (WorkerView(W0), {"adapter": "lora-x"}, "adapter"),
        (WorkerView(W0, tenants=frozenset({"acme"})), {"tenant": "b"}, "tenant"),
        (WorkerView(W0, pool="batch"), {"pool": "online"}, "pool"),
    ],
)
def test_filters_run_before_scoring(worker: WorkerView, req_kw: dict, filter_name: str) -> None:  # type: ignore[type-arg]
    r = Router()
    doc = tokens(1, 2_000)
    warm(r, W0, doc)  # the filtered worker is warm: permission still comes first
    other = WorkerView(
        W1,
        models=frozenset({"m"}),
        adapters=frozenset({"lora-x"}),
        pool=req_kw.get("pool", "default"),
    )
    ws = [worker, other]
    d = r.route(request("q", doc, **req_kw), ws, 1.0)
    assert d.worker_id == W1 and d.filtered == {W0: filter_name}
    with pytest.raises(NoWorkerAvailable, match=filter_name):
        r.route(request("q", doc, **req_kw), [worker], 1.0)


@pytest.mark.parametrize(
    "ns",
    [NS, CacheNamespace("m", tenant="tenant:alice")],  # alice shares her cache / keeps it apart
    ids=["sharing", "isolated"],
)
def test_a_workers_tenants_list_admits_the_tenant_by_name(ns: CacheNamespace) -> None:
    # Issue 12: the filter compared the namespace's tenant field ("" or
    # "tenant:alice") with the plain names, so a dedicated worker never matched.
    r = Router()
    ws = [WorkerView(W0, tenants=frozenset({"alice"})), WorkerView(W1, tenants=frozenset({"bob"}))]
    for i in range(4):
        d = r.route(request(f"a{i}", tokens(i, 500), ns=ns, tenant="alice"), ws, 1.0)
        assert d.worker_id == W0 and d.filtered == {W1: "tenant"}
    with pytest.raises(NoWorkerAvailable) as err:
        r.route(request("anon", tokens(9, 500), ns=ns), ws, 1.0)
    assert err.value.filtered == {W0: "tenant", W1: "tenant"}


def test_decision_record_names_everything() -> None:
    r = Router()
    doc = tokens(1, 3_000)
    warm(r, W0, doc)
    d = r.route(request("q1", doc, prefix_class="document"), workers(2), 1.0)
    rec = d.to_dict()
    assert rec["request_id"] == "q1" and rec["selected_worker"] == "w0"
    assert rec["namespace"] == NS.key and rec["tier"] == "exact" and rec["reason"]
    assert rec["predicted_cached_tokens"] == 2_992 and len(rec["prefix_key"]) == 16
    assert rec["prefix_class"] == "document" and rec["policy"] == "prefix_aware"
    assert rec["prompt_tokens"] == 3_000 and rec["time"] == 1.0
    assert rec["filtered"] == {} and rec["warm_abandoned"] is False
    assert d.context.request.request_id == "q1" and d.context.now == 1.0
    cands = {c["worker"]: c for c in rec["candidate_workers"]}
    assert set(cands) == {"w0", "w1"}
    for key in ("queue_wait_ms", "prefill_ms", "decode_impact_ms", "memory_risk_ms"):
        assert key in cands["w0"]
    assert cands["w0"]["prefill_ms"] < cands["w1"]["prefill_ms"]


def test_route_is_pure_and_feedback_calibrates() -> None:
    r = Router()
    doc = tokens(1, 3_000)
    q = request("q", doc)
    ws = workers(2)
    first = r.route(q, ws, 1.0).to_dict()
    assert r.route(q, ws, 1.0).to_dict() == first
    assert len(r.index) == 0  # routing alone indexed nothing
    d = r.route(q, ws, 1.0)
    r.on_routed(d, 1.0)
    predicted = d.predicted_ttft_s
    assert predicted is not None
    for _ in range(100):  # the engine is twice as slow as its profile says
        r.on_completed(d, Outcome(actual_cached_tokens=0, ttft_s=2 * predicted), 2.0)
    assert r.cost.scale(d.worker_id) == pytest.approx(2.0, rel=0.05)
