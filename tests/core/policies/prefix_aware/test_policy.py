"""``prefix_aware`` as a whole: demand, determinism, parameters."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.core import (
    Outcome,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.policies.prefix_aware import (
    PrefixAwareParams,
    PrefixAwarePolicy,
)
from tests.core.conftest import NS, request, tokens, warm, workers

# --------------------------------------------- demand, determinism, parameters


def test_the_deprecated_name_builds_the_same_policy() -> None:
    old = create_policy("prefixrouter", {"min_match_tokens": 32})
    assert isinstance(old, PrefixAwarePolicy) and old.name == "prefix_aware"
    assert old.params == replace(PrefixAwareParams(), min_match_tokens=32)
    assert Router("prefixrouter").route(request("q", tokens(1, 100)), workers(2), 0.0).policy == (
        "prefix_aware"
    )


def test_demand_survives_a_clock_that_steps_back() -> None:
    r = Router()
    doc = tokens(1, 2_000)
    for t in (5.0, 1.0e9, 3.0):  # math.exp overflowed on the step back
        d = r.route(request(f"c{t}", doc + tokens(2, 10)), workers(2), t)
        r.on_routed(d, t)
    assert isinstance(r.policy, PrefixAwarePolicy)
    assert r.policy.prefix_rate(r.blocks_for(request("q", doc)).hashes[0], 3.0) > 0


def test_a_rejected_routing_is_taken_back_in_the_index_and_the_demand() -> None:
    router = Router()
    policy = router.policy
    assert isinstance(policy, PrefixAwarePolicy)
    ws = workers(2)
    doc = tokens(1, 2048)
    served = router.route(request("doc", doc), ws, 0.0)
    router.on_routed(served, 0.0)
    router.on_completed(served, Outcome(0, 0.1), 0.5)  # the engine holds the document
    before = (len(router.index), dict(policy._demand), router.index.speculative_entries)
    rates = {k: policy.prefix_rate(k, 5.0) for k in policy._demand}
    # a request past the context length: it shares the document and extends it
    too_long = request("long", [*doc, *tokens(2, 40_000)])
    d = router.route(too_long, ws, 1.0)
    assert d.worker_id == served.worker_id and d.predicted_cached_tokens > 0
    router.on_routed(d, 1.0)
    router.on_rejected(d, 1.2)  # the engine answered 400: no prefill
    assert (len(router.index), dict(policy._demand), router.index.speculative_entries) == before
    assert {k: policy.prefix_rate(k, 5.0) for k in policy._demand} == pytest.approx(rates)
    retry = router.route(request("long-retry", [*doc, *tokens(2, 40_000)]), ws, 2.0)
    assert retry.predicted_cached_tokens == served.prompt_tokens  # the document only
    # a new prefix refused outright leaves nothing: its retry is routed as never seen
    new = request("new", tokens(3, 4096))
    d = router.route(new, ws, 3.0)
    router.on_routed(d, 3.0)
    router.on_rejected(d, 3.0)
    again = router.route(request("new-retry", tokens(3, 4096)), ws, 4.0)
    assert again.predicted_cached_tokens == 0 and again.tier == "cold"
    assert router.blocks_for(new).hashes[0] not in policy._demand


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 5_000)), max_size=12),
    st.integers(0, 3),
    st.integers(1, 4_000),
)
def test_same_inputs_same_decision(
    history: list[tuple[int, int, int]], doc_id: int, max_tokens: int
) -> None:
    def build() -> tuple[Router, list[WorkerView]]:
        r = Router()
        ws = workers(3)
        for i, (w, d, pending) in enumerate(history):
            warm(r, WorkerId(f"w{w}"), tokens(d, 2_000), float(i))
            ws[w] = replace(ws[w], pending_prefill_tokens=pending)
        return r, ws

    q = RoutingRequest(RequestId("q"), NS, tokens=tokens(doc_id, 2_100), max_tokens=max_tokens)
    (r1, ws1), (r2, ws2) = build(), build()
    assert r1.route(q, ws1, 50.0).to_dict() == r2.route(q, ws2, 50.0).to_dict()


def test_params_validation_names_the_field() -> None:
    from prefixrouter.errors import ConfigError, UnknownNameError

    with pytest.raises(ConfigError, match="warm_margin_rell"):
        create_policy("prefix_aware", {"short": {"warm_margin_rell": 1}})
    with pytest.raises(ConfigError, match="'min_match_tokens' must be int"):
        create_policy("prefix_aware", {"min_match_tokens": "many"})
    with pytest.raises(UnknownNameError, match=r"known: .*round_robin"):
        create_policy("nope")
    p = create_policy("prefix_aware", {"long": {"decode_weight": 2}}).params
    assert isinstance(p, PrefixAwareParams) and p.long.decode_weight == 2.0
    assert p.long.warm_margin_rel == PrefixAwareParams().long.warm_margin_rel
