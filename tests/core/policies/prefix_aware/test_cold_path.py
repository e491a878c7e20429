"""``prefix_aware`` cold path: the cold pool, the new home and the rendezvous home."""

from __future__ import annotations

from array import array
from dataclasses import replace

from prefixrouter.core import (
    Decision,
    Router,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.policies.prefix_aware import (
    cold_pool_rule,
    new_home_rule,
    rendezvous_home,
)
from prefixrouter.core.router import replica_salt
from tests.core.conftest import request, send, tokens, warm, workers
from tests.core.policies.prefix_aware.conftest import (
    SHORT,
    W0,
    W1,
    W2,
    W3,
    scored,
)

# --------------------------------------- cold path: cold pool, rendezvous home


def test_cold_pool_rule_takes_the_pool_only_within_the_margin() -> None:
    ws = [WorkerView(W0), WorkerView(W1), WorkerView(WorkerId("c0"), pool="cold")]
    cs = [scored("w0", 1.0), scored("w1", 1.1), scored("c0", 1.2)]
    assert cold_pool_rule(cs, ws, 0, "cold", SHORT) == 2  # 1.2 <= 1.3
    cs[2] = scored("c0", 1.4)
    assert cold_pool_rule(cs, ws, 0, "cold", SHORT) is None  # a busy pool: not worth the wait
    assert cold_pool_rule(cs, ws, 0, "batch", SHORT) is None  # no such pool


def test_new_home_rule_takes_the_emptiest_cache_within_the_margin() -> None:
    r = Router()
    warm(r, W0, tokens(1, 3_200))  # 200 blocks
    warm(r, W1, tokens(2, 1_600))  # 100 blocks
    warm(r, W3, tokens(3, 800))  # 50 blocks; w2 holds nothing
    cs = [scored("w0", 1.0), scored("w1", 1.05), scored("w2", 1.4), scored("w3", 1.2)]
    ws = workers(4)
    # The margin of the best (1.0 s) ends at 1.3 s: w2, empty, is past it.
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 3
    cs[2] = scored("w2", 1.3)
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 2
    # Equal caches: the fewest in flight, then the score.
    warm(r, W2, tokens(4, 800))
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 3  # w2 and w3 hold 50: the score
    ws[2] = replace(ws[2], in_flight=0)
    ws[3] = replace(ws[3], in_flight=2)
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 10) == 2
    # One candidate within the margin: no rule.
    far = [cs[0], *(scored(f"w{i}", 2.0) for i in (1, 2, 3))]
    assert new_home_rule(r.index, far, ws, 0, SHORT, 10) is None
    # A cache without room for the prompt: no rule (full caches hold what recency left).
    r.index.set_capacity(W0, 205)
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 4) == 2
    assert new_home_rule(r.index, cs, ws, 0, SHORT, 5) is None


def _group(g: int, q: int) -> array[int]:
    """Group ``g``'s 1,600-token system prompt and its question ``q``."""
    return tokens(100 + g, 1_600) + tokens(1_000 * g + q, 64)


def test_a_new_group_goes_to_the_emptiest_cache_not_the_fewest_in_flight() -> None:
    def route_new_group(params: dict[str, object]) -> Decision:
        r = Router(create_policy("prefix_aware", params))
        ws = workers(3)
        # Group 0's home is w0 and its second question found it there: what
        # follows a new prompt is reused, so a new prompt makes a home.
        send(r, request("g0-0", _group(0, 0)), ws, W0, 0.0)
        send(r, request("g0-1", _group(0, 1)), ws, W0, 0.1)
        # w0 is idle now; w1 and w2 run one request each.
        busy = [ws[0], replace(ws[1], in_flight=1), replace(ws[2], in_flight=1)]
        return r.route(request("g1-0", _group(1, 0)), busy, 1.0)

    d = route_new_group({})
    assert d.tier == "cold" and d.worker_id in (W1, W2)
    assert "a new home: the emptiest cache" in d.reason
    # Off: the picker among all, by requests in flight.
    assert route_new_group({"new_home_emptiest": False}).worker_id == W0


def test_one_off_prompts_and_replicas_keep_the_picker_on_the_cold_path() -> None:
    ws = workers(3)
    busy = [ws[0], replace(ws[1], in_flight=1), replace(ws[2], in_flight=1)]
    r = Router()
    # Unique prompts that nobody reuses: the root's new content is one-off.
    for i in range(4):
        send(r, request(f"u{i}", tokens(500 + i, 1_664)), ws, W0, 0.1 * i)
    d = r.route(request("u", tokens(600, 1_664)), busy, 1.0)
    assert "new home" not in d.reason and d.worker_id == W0
    # A replica (salted) draws two as before, whatever a cache holds.
    rep = Router(replica_salt=replica_salt("r1"))
    send(rep, request("g0-0", _group(0, 0)), ws, W0, 0.0)
    send(rep, request("g0-1", _group(0, 1)), ws, W0, 0.1)
    assert "new home" not in rep.route(request("g1-0", _group(1, 0)), busy, 1.0).reason


def test_rendezvous_home_is_stable_and_among_the_near_workers() -> None:
    cs = [scored(f"w{i}", 1.0 + 0.01 * i) for i in range(4)]
    homes = {b: rendezvous_home(cs, 0, b, SHORT)[0] for b in range(64)}
    assert set(homes.values()) == {0, 1, 2, 3}  # prefixes partition over the workers
    assert all(rendezvous_home(cs, 0, b, SHORT)[0] == h for b, h in homes.items())
    cs[3] = scored("w3", 2.0)  # outside the margin: never a home
    assert rendezvous_home(cs, 0, 7, SHORT)[1] == 3
    assert all(rendezvous_home(cs, 0, b, SHORT)[0] != 3 for b in range(64))


def test_a_prefix_seen_before_and_evicted_everywhere_goes_home() -> None:
    r = Router()
    doc = tokens(1, 2_000)
    ws = workers(4)
    first = r.route(request("a", doc), ws, 0.0)
    r.on_routed(first, 0.0)  # counted in the demand: seen before
    r.index.clear_worker(first.worker_id)  # and evicted
    again = [r.route(request(f"b{i}", doc), ws, 1.0) for i in range(3)]
    assert {d.tier for d in again} == {"cold"} and len({d.worker_id for d in again}) == 1
    assert "its home among 4 within margin" in again[0].reason


def test_cold_pool_takes_cold_requests_and_warm_ones_stay_warm() -> None:
    policy = create_policy("prefix_aware", {"cold_pool": "cold"})
    r = Router(policy)
    doc = tokens(1, 10_000)
    warm(r, W0, doc)
    ws = [*workers(2), WorkerView(WorkerId("c0"), pool="cold")]
    cold = r.route(request("u", tokens(77, 3_000)), ws, 1.0)
    assert cold.worker_id == "c0" and cold.tier == "cold_pool"
    hot = r.route(request("h", doc + tokens(2, 100)), ws, 1.0)
    assert hot.worker_id == W0 and hot.tier == "exact"
