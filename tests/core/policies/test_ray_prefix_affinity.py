from __future__ import annotations

from prefixrouter.core import Router, WorkerId, create_policy
from prefixrouter.core.policies.common import request_rng
from prefixrouter.core.policies.ray_prefix_affinity import RayPrefixAffinity
from tests.core.conftest import request, send, tokens, with_loads

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
DOC = tokens(1, 1_000)


def test_low_match_rate_goes_to_smallest_trees_then_shortest_queue() -> None:
    r = Router("ray_prefix_affinity")
    ws = with_loads(0, 3, 1)
    send(r, request("a", DOC), ws, W0, 0.0)
    d = r.route(request("q", DOC[:64] + tokens(3, 936)), ws, 1.0)  # 64 of 1,000: rate 0.064
    assert (d.worker_id, d.tier) == (W2, "cache_miss")  # w1 and w2 have empty trees


def test_match_goes_to_deepest_node_then_shortest_queue() -> None:
    r = Router("ray_prefix_affinity")
    ws = with_loads(4, 2, 0)
    send(r, request("a", DOC), ws, W0, 0.0)
    send(r, request("b", DOC), ws, W1, 0.0)
    d = r.route(request("q", DOC[:200] + tokens(3, 800)), ws, 1.0)  # rate 0.19 >= 0.1
    assert (d.worker_id, d.tier) == (W1, "cache_hit")  # idle w2 holds nothing
    assert d.predicted_cached_tokens == 192


def test_finite_imbalance_threshold_uses_power_of_two_and_trees_are_capped() -> None:
    policy = create_policy(
        "ray_prefix_affinity", {"imbalanced_threshold": 5, "max_tree_chars": 640}
    )
    r = Router(policy)
    ws = with_loads(10, 0, 2)
    send(r, request("a", DOC), ws, W0, 0.0)
    assert isinstance(policy, RayPrefixAffinity) and policy.tree.size(W0) == 10  # 640 / 64
    d = r.route(request("q", DOC), ws, 1.0)
    i, j = request_rng("q", 0).sample(range(3), 2)
    assert d.tier == "balance"
    assert d.worker_id == min(ws[i], ws[j], key=lambda w: w.in_flight).worker_id
