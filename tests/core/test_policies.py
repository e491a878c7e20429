from __future__ import annotations

from dataclasses import replace

from prefixrouter.core import Router, policy_names
from prefixrouter.core.policy import ALIASES, POLICIES, alias_note, canonical_policy_name
from tests.core.conftest import request, tokens, workers


def test_registry_lists_ours_first_and_the_cache_blind_baselines() -> None:
    names = policy_names()
    assert names[0] == "prefix_aware"
    assert {"round_robin", "least_loaded"} <= set(names)
    for name in names:
        assert POLICIES[name].name == name
    assert not set(ALIASES) & set(names)  # deprecated names are not listed


def test_a_deprecated_name_resolves_to_the_registered_one_with_a_note() -> None:
    assert canonical_policy_name("prefixrouter") == "prefix_aware"
    assert canonical_policy_name("round_robin") == "round_robin"
    assert canonical_policy_name("nope") == "nope"  # create_policy names the unknown one
    assert alias_note("prefixrouter") == (
        "policy name 'prefixrouter' is deprecated, use 'prefix_aware' (same policy)"
    )
    assert alias_note("prefix_aware") is None and alias_note("nope") is None
    assert set(ALIASES.values()) <= set(policy_names())


def test_round_robin_cycles_in_worker_order_and_select_is_pure() -> None:
    r = Router("round_robin")
    ws = workers(3)[::-1]  # given out of order: the router sorts by id
    q = request("q", tokens(1, 100))
    assert r.route(q, ws, 0.0).worker_id == r.route(q, ws, 0.0).worker_id == "w0"
    seen = []
    for i in range(6):
        d = r.route(request(f"r{i}", tokens(i, 100)), ws, float(i))
        r.on_routed(d, float(i))
        seen.append(d.worker_id)
    assert seen == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_loaded_picks_fewest_in_flight_ties_to_lowest_id() -> None:
    r = Router("least_loaded")
    ws = workers(3)
    assert r.route(request("q", tokens(1, 64)), ws, 0.0).worker_id == "w0"
    ws[0] = replace(ws[0], in_flight=5)
    ws[1] = replace(ws[1], in_flight=2)
    ws[2] = replace(ws[2], in_flight=3)
    assert r.route(request("q", tokens(1, 64)), ws, 0.0).worker_id == "w1"
