"""The simulation loop: every request completes, feedback reaches the router, runs repeat."""

from __future__ import annotations

from array import array

import pytest

from prefixrouter.core import PrefixClass, RequestId, WorkerId
from prefixrouter.core.dispatch import RoutingMode
from prefixrouter.core.policy import create_policy
from prefixrouter.sim.cluster import NO_MAX_TOKENS, ClusterConfig, Simulation
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import lower_bound_prefill_tokens, summarize, total_prefill_tokens
from prefixrouter.sim.scenarios import get_scenario
from prefixrouter.sim.workload import SIM_NAMESPACE, SimRequest, Workload

PROFILE = get_profile("llama3-8b-h100")


def _doc_workload(n_docs: int, per_doc: int, doc_tokens: int, gap: float) -> Workload:
    docs = [array("I", range(d * 100_000, d * 100_000 + doc_tokens)) for d in range(n_docs)]
    reqs = []
    for i in range(n_docs * per_doc):
        d = i % n_docs
        question = array("I", range(900_000 + i * 64, 900_000 + i * 64 + 40))
        reqs.append(
            SimRequest(
                RequestId(f"r{i:04d}"),
                i * gap,
                SIM_NAMESPACE,
                (docs[d], question),
                32,
                PrefixClass.DOCUMENT,
                f"doc{d}",
            )
        )
    return Workload("docs", "test", reqs, default_workers=4)


def test_every_request_completes_and_the_ledger_drains() -> None:
    wl = _doc_workload(4, 20, 8_000, 0.05)
    sim = Simulation(wl, ClusterConfig(4, PROFILE), "prefix_aware")
    run = sim.run()
    assert len(run.records) == 80 and all(
        r.completed > r.first_token > r.arrival for r in run.records
    )
    for w in range(4):
        load = sim.dispatch.load(WorkerId(f"w{w:02d}"))
        assert (load.in_flight, load.pending_prefill_tokens, load.decoding) == (0, 0, 0)


def test_prefix_routing_reuses_documents_and_predictions_match_engine() -> None:
    wl = _doc_workload(3, 20, 8_000, 0.05)  # 3 documents: round robin spreads each over 4
    ours = Simulation(wl, ClusterConfig(4, PROFILE, kv_events=True), "prefix_aware").run()
    rr = Simulation(wl, ClusterConfig(4, PROFILE), "round_robin").run()
    s_ours, s_rr = summarize(ours), summarize(rr)
    # each document is prefilled about once instead of once per replica
    assert s_ours["prefill_tokens"] < 0.6 * s_rr["prefill_tokens"]
    bound = lower_bound_prefill_tokens(wl)
    assert bound <= s_ours["prefill_tokens"] <= 1.5 * bound
    # with KV events the index is exact: warm predictions equal the engine's reuse
    warm = [r for r in ours.records if r.tier == "exact" and r.arrival > 1.0]
    assert warm and all(r.predicted_cached_tokens == r.cached_tokens for r in warm)


def test_lower_bound_counts_first_seen_blocks_only() -> None:
    wl = _doc_workload(2, 3, 1_600, 1.0)  # prompts of 1,640 tokens, blocks of 16
    # first request per doc prefills everything; the rest reuse 1,600 tokens each
    assert lower_bound_prefill_tokens(wl) == 2 * 1_640 + 4 * 40


def test_same_seed_same_report_and_policies_see_the_same_requests() -> None:
    wl = get_scenario("gsp").build(3, 200).scaled(20.0)
    cfg = ClusterConfig(4, PROFILE)
    a = summarize(Simulation(wl, cfg, "prefix_aware").run())
    b = summarize(Simulation(wl, cfg, "prefix_aware").run())
    assert a == b
    c = summarize(Simulation(wl, cfg, "round_robin").run())
    assert c["prompt_tokens"] == a["prompt_tokens"] and c["requests"] == a["requests"]


def _homes_per_worker(params: dict[str, object]) -> list[int]:
    """gsp at load 0.9 (seed 0): how many groups each worker was the first home of."""
    from prefixrouter.sim.runner import plan

    wl = get_scenario("gsp").build(0)
    p = plan(wl, PROFILE, ["prefix_aware"], load=0.9, mode="token")
    config = ClusterConfig(p.workers, p.profile, p.kv_blocks, mode=p.mode)
    run = Simulation(p.workload, config, create_policy("prefix_aware", params)).run()
    first: dict[str, str] = {}
    for r in sorted(run.records, key=lambda r: r.arrival):
        first.setdefault(r.group, r.worker)
    return sorted(list(first.values()).count(f"w{w:02d}") for w in range(p.workers))


def test_new_groups_spread_their_homes_evenly_over_the_workers() -> None:
    # 64 groups of 16 prompts on 8 workers, everything fits: each group's
    # first request makes the home its later requests follow. Placed by
    # the emptiest cache (new_home_rule) every worker gets 7 to 9 groups;
    # placed by that request's own first token they spread wider (6 to 10).
    even = _homes_per_worker({})
    assert sum(even) == 64 and max(even) - min(even) <= 2
    by_first_token = _homes_per_worker({"new_home_emptiest": False})
    assert max(by_first_token) - min(by_first_token) > max(even) - min(even)


def test_block_size_mismatch_is_refused() -> None:
    wl = _doc_workload(1, 1, 64, 1.0)
    wl.block_size = 32
    with pytest.raises(ValueError, match="16"):
        Simulation(wl, ClusterConfig(1, PROFILE), "round_robin")


def test_proactive_copies_are_the_routers_own_requests_and_leave_the_ledger_drained() -> None:
    # Forms asked for faster than one copy each serves: the hot-prefix rule copies them.
    wl = get_scenario("templates").build(0, 200).scaled(30.0)
    runs = {}
    for proactive in (False, True):
        policy = create_policy("prefix_aware", {"proactive_copy": proactive})
        sim = Simulation(wl, ClusterConfig(wl.default_workers, PROFILE), policy)
        runs[proactive] = sim.run()
        for w in range(wl.default_workers):
            load = sim.dispatch.load(WorkerId(f"w{w:02d}"))
            assert (load.in_flight, load.pending_prefill_tokens, load.decoding) == (0, 0, 0)
    off, on = runs[False], runs[True]
    assert off.warm_ups == 0 and on.warm_ups > 0
    # Only user requests are records: each once, none of the router's copies.
    assert sorted(r.request_id for r in on.records) == sorted(r.request_id for r in wl.requests)
    # A copy made by a user request is a cold decision; made by the router, it is none.
    cold_off = sum(1 for r in off.records if r.tier == "cold")
    cold_on = sum(1 for r in on.records if r.tier == "cold")
    assert cold_on < cold_off
    # The copies' prefill is reported apart and counted in the engines' total.
    s_on = summarize(on)
    assert s_on["warm_ups"] == on.warm_ups and s_on["warm_up_prefill_tokens"] > 0
    assert total_prefill_tokens(s_on) == sum(w.prefill_tokens for w in on.workers)
    assert "warm_ups" not in summarize(off)
    policy = create_policy("prefix_aware", {"proactive_copy": True})
    again = Simulation(wl, ClusterConfig(wl.default_workers, PROFILE), policy).run()
    assert summarize(again) == summarize(on) and again.warm_ups == on.warm_ups


@pytest.mark.parametrize("mode", ["token", "text"])
def test_clients_that_send_a_cap_are_expected_to_decode_what_answers_decoded(
    mode: RoutingMode,
) -> None:
    """Answers of 32 tokens under a cap of 2,048: the first requests are taken at the
    first guess (512), the later ones at what the answers decoded; exact clients at
    their word."""
    wl = _doc_workload(2, 20, 4_000, 0.25)
    decisions = {}
    for cap in (0, 2048, NO_MAX_TOKENS):
        config = ClusterConfig(4, PROFILE, mode=mode, client_max_tokens=cap, decision_log=40)
        run = Simulation(wl, config, "prefix_aware").run()
        assert all(r.output_tokens == 32 and r.completed > 0 for r in run.records)
        decisions[cap] = [d["expected_output_tokens"] for d in run.decisions_logged]
    assert set(decisions[0]) == {32}
    assert decisions[2048][0] == 512 and decisions[2048][-1] == 32
    # Clients that send no max_tokens: the guess, then what their answers decoded.
    assert decisions[NO_MAX_TOKENS][0] == 512 and decisions[NO_MAX_TOKENS][-1] == 32


def test_a_client_cap_below_none_is_refused() -> None:
    with pytest.raises(ValueError, match="client max_tokens"):
        ClusterConfig(4, PROFILE, client_max_tokens=-2)
