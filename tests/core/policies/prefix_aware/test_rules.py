"""``prefix_aware`` step 4: the rules that may leave the picker's warm choice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import (
    BlockHash,
    Decision,
    InflightLedger,
    PrefixIndex,
    RequestId,
    Router,
    WorkerId,
    WorkerView,
    create_policy,
)
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.policies.prefix_aware import (
    PrefixAwareParams,
    PrefixAwarePolicy,
    cache_pressure,
    margin_limit,
    max_wait_rule,
    no_room_rule,
    switch_externality,
    switch_score,
    warm_margin_rule,
)
from prefixrouter.core.policy import CandidateScore
from tests.core.conftest import request, send, tokens, warm, workers
from tests.core.policies.prefix_aware.conftest import (
    SHORT,
    W0,
    W1,
    W2,
    candidate,
    fill_cache,
    never,
    scored,
)

# -------------------------------------------------------- rule 2: maximum wait


@pytest.mark.parametrize(
    ("warm_queue", "best_queue", "best_ttft", "leaves"),
    [
        (5.0, 0.0, 1.0, True),  # past 4 s; leaving avoids it and is sooner
        (3.0, 0.0, 1.0, False),  # within the maximum wait
        (5.0, 4.5, 4.8, False),  # the other queue is past it too (overload)
        (5.0, 0.0, 6.0, False),  # leaving would not bring the first token sooner
    ],
)
def test_max_wait_rule_leaves_a_warm_queue_past_the_limit(
    warm_queue: float, best_queue: float, best_ttft: float, leaves: bool
) -> None:
    cs = [
        scored("w0", warm_queue + 0.5, queue=warm_queue),
        scored("w1", best_ttft, queue=best_queue),
    ]
    choice = max_wait_rule(cs, 0, 1, SHORT)
    if not leaves:
        assert choice is None
        return
    assert choice is not None and choice.index == 1 and choice.abandoned
    assert choice.reason == "left warm w0: queue wait 5000 ms > max 4000 ms"


def test_max_wait_rule_counts_a_wait_for_kv_memory_as_a_wait() -> None:
    # No queue on the warm worker, but its memory is pinned: 5 s until running
    # requests release enough of it.
    pinned = CostTerms(0.0, 0.5, 0.0, 5.0, 0.0)
    cs = [
        CandidateScore(W0, 8_000, 1.0, pinned, pinned.ttft_s),
        scored("w1", 1.0),
    ]
    choice = max_wait_rule(cs, 0, 1, SHORT)
    assert choice is not None and choice.index == 1 and choice.abandoned
    assert choice.reason == "left warm w0: queue wait 5000 ms > max 4000 ms"


def test_max_wait_rule_stays_when_the_copy_would_cost_the_queued_more_than_it_saves() -> None:
    # Leaving saves this request 4.5 s, and puts 1.0 s of cold prefill before
    # the five requests that will queue on w1 (the warm prefill of 0.5 s is
    # spared before none): 5 s, weighed 1.
    cs = [scored("w0", 5.5, queue=5.0), scored("w1", 1.0)]
    external = switch_externality(cs[0].terms, cs[1].terms, 0, 5, 1.0)
    assert external == pytest.approx(5.0)
    assert max_wait_rule(cs, 0, 1, SHORT, external) is None
    assert max_wait_rule(cs, 0, 1, SHORT, 4.0) is not None  # 1.0 + 4.0 < 5.5


def test_waiting_counts_the_requests_not_past_their_first_token() -> None:
    assert WorkerView(W0, in_flight=6, decoding=2).waiting == 4  # queued or prefilling
    assert WorkerView(W1, in_flight=3, decoding=3).waiting == 0  # all decoding
    # a view drawn between a first token and its completion never goes below 0
    assert WorkerView(W2, in_flight=1, decoding=2).waiting == 0


def test_switch_externality_is_the_prefill_added_before_the_target_queue_less_the_spared() -> None:
    warm_, cold = scored("w0", 1.2, queue=1.0).terms, scored("w1", 0.8).terms
    # cold prefills 0.8 s before 3 waiting; warm would prefill 0.2 s before 4
    assert switch_externality(warm_, cold, 4, 3, 1.0) == pytest.approx(0.8 * 3 - 0.2 * 4)
    assert switch_externality(warm_, cold, 4, 3, 10.0) == pytest.approx(16.0)  # weighed
    assert switch_externality(warm_, cold, 0, 0, 10.0) == 0.0  # an idle target delays no one
    assert switch_externality(warm_, cold, 20, 3, 10.0) == 0.0  # staying delays more
    assert switch_externality(warm_, cold, 4, 3, 0.0) == 0.0  # off
    assert switch_externality(None, cold, 4, 3, 1.0) == 0.0


def test_a_warm_worker_past_the_max_wait_is_kept_when_the_copy_would_delay_a_busy_target() -> None:
    # w0 holds the 8,000-token prompt behind a queue of about 10 s; w1 is
    # cold. Idle, w1 takes the copy: no one queues behind it. With requests
    # waiting on it (a short queue, within the maximum wait), the copy's
    # prefill would delay each of the requests that follow them, and the
    # request stays warm.
    doc = tokens(1, 8_000)

    def route(cold_waiting: int, weight: float = 10.0) -> tuple[WorkerId, bool, str]:
        r = Router(PrefixAwarePolicy(PrefixAwareParams(switch_backlog_weight=weight)))
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], in_flight=4, pending_prefill_tokens=200_000)
        ws[1] = replace(ws[1], in_flight=cold_waiting, pending_prefill_tokens=200 * cold_waiting)
        d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
        return d.worker_id, d.warm_abandoned, d.reason

    assert route(0)[:2] == (W1, True)
    worker, abandoned, reason = route(6)
    assert (worker, abandoned) == (W0, False), reason
    assert route(6, weight=0.0)[:2] == (W1, True)  # this request's first token alone


def test_switch_externality_counts_the_arrivals_during_the_copy_and_credits_the_prefix() -> None:
    # The copy prefills 2 s on an idle w1; w0 would prefill 0.2 s behind 3 s of queue.
    warm_, cold = scored("w0", 3.2, queue=3.0).terms, scored("w1", 2.0).terms
    # 0.5 requests a second for other prefixes reach each worker: 1 arrives
    # during the copy (0.1 during the warm prefill it spares), weighed 10.
    assert switch_externality(warm_, cold, 0, 0, 10.0, other_rate=0.5) == pytest.approx(
        10.0 * (2.0 * 0.5 * 2.0 - 0.2 * 0.5 * 0.2)
    )
    # The prefix's own requests arriving during w0's 3 s wait could use the
    # copy instead: 0.4/s x 3^2 / 2 = 1.8 s saved, taken off the cost.
    charged = switch_externality(warm_, cold, 0, 0, 10.0, other_rate=0.5, own_rate=0.4)
    assert charged == pytest.approx(10.0 * (2.0 - 0.02) - 1.8)
    # A hot prefix's copy pays for itself: never below 0.
    assert switch_externality(warm_, cold, 0, 0, 10.0, other_rate=0.5, own_rate=10.0) == 0.0
    assert switch_externality(warm_, cold, 0, 0, 0.0, other_rate=0.5) == 0.0  # off


def test_a_long_copy_is_charged_the_fleet_traffic_it_delays_unless_its_prefix_makes_it() -> None:
    # w0 holds a 30,000-token prompt behind about 12 s of queue; w1 is idle
    # and cold. With no traffic in the last seconds the copy delays no one
    # and the request leaves. With 10 requests a second for other prefixes,
    # about 5 a second reach w1, and the copy's prefill of about 2 s would
    # delay those arriving during it: it stays. When the prefix's own
    # requests make that traffic (a hot document), they would use the copy:
    # it leaves.
    doc = tokens(1, 30_000)

    def route(traffic: str) -> tuple[WorkerId, bool, str]:
        r = Router(PrefixAwarePolicy())
        warm(r, W0, doc)
        ws = workers(2)
        for i in range(60):
            if traffic.startswith("other prefixes"):
                d = send(r, request(f"o{i}", tokens(100 + i, 300)), ws, W1, i * 0.1)
                if traffic == "other prefixes, all refused":
                    r.on_rejected(d, i * 0.1)  # the engine did no prefill: no arrival
            elif traffic == "its own prefix":
                send(r, request(f"d{i}", doc + tokens(500 + i, 50)), ws, W0, i * 0.1)
        ws[0] = replace(ws[0], in_flight=4, pending_prefill_tokens=200_000)
        d = r.route(request("q", doc + tokens(5, 200)), ws, 6.0)
        return d.worker_id, d.warm_abandoned, d.reason

    assert route("none")[:2] == (W1, True)
    worker, abandoned, reason = route("other prefixes")
    assert (worker, abandoned) == (W0, False), reason
    assert "of it the queue behind" in reason
    assert route("its own prefix")[:2] == (W1, True)
    assert route("other prefixes, all refused")[:2] == (W1, True)


# -------------------------------------------------------- rule 3: no room for a copy


@pytest.mark.parametrize(
    ("roomy", "needed", "kept"),
    [
        ([0, 2], 1, False),  # w2 has room for the copy: the margin rule decides
        ([0], 1, True),  # room nowhere else, one replica serves the demand: stay
        ([0], 2, False),  # room nowhere else, but the prefix needs a second replica
    ],
)
def test_no_room_rule_keeps_the_warm_worker_when_no_other_has_room(
    roomy: list[int], needed: int, kept: bool
) -> None:
    # w1, the best score, would wait 0.5 s for KV memory.
    waits = CostTerms(0.0, 0.5, 0.0, 0.5, 0.0)
    cs = [scored("w0", 2.0), CandidateScore(W1, 0, 1.0, waits, waits.ttft_s)]
    choice = no_room_rule(cs, 0, 1, [0], lambda: roomy, lambda: needed)
    if not kept:
        assert choice is None
        return
    assert choice is not None and choice.index == 0 and not choice.abandoned
    assert "no room for a copy elsewhere" in choice.reason
    # With room elsewhere, a best that holds the prefix too (moving copies
    # nothing) or a best with the memory free now, the demand is never computed.
    assert no_room_rule(cs, 0, 1, [0], lambda: [0, 1], lambda: int(never())) is None
    assert no_room_rule(cs, 0, 1, [0, 1], lambda: never(), lambda: int(never())) is None
    free = [cs[0], scored("w1", 1.0)]
    assert no_room_rule(free, 0, 1, [0], lambda: never(), lambda: int(never())) is None


def test_a_full_fleet_keeps_a_customer_on_its_warm_worker_the_margin_would_leave() -> None:
    # The warm worker is slower than the margin allows, but every other
    # worker's memory is pinned by running requests (the copy would wait for
    # them): one-off copies would thrash every cache.
    r = Router()
    doc = tokens(1, 8_000)
    warm(r, W0, doc)
    pinned = WorkerView(
        W1,
        in_flight=2,
        decoding=2,
        decode_tokens_remaining=200,
        kv_capacity_blocks=2_000,
        kv_used_blocks=1_800,
    )
    ws = [
        WorkerView(W0, in_flight=6, pending_prefill_tokens=40_000, kv_capacity_blocks=2_000),
        pinned,
    ]
    d = r.route(request("q", doc), ws, 1.0)
    assert d.worker_id == W0 and "no room for a copy elsewhere" in d.reason
    # The same with room on w1: the margin rule sends it there.
    ws[1] = WorkerView(W1, kv_capacity_blocks=2_000)
    d = r.route(request("q", doc), ws, 1.0)
    assert d.worker_id == W1 and "beyond margin" in d.reason


@pytest.mark.parametrize(
    ("pending", "max_wait", "reason"),
    [
        (60_000, None, "beyond margin"),  # ~3 s queue: too slow
        (200_000, None, "beyond margin"),  # ~10 s: no cap by default, the margin decides
        (60_000, 4.0, "beyond margin"),  # under a cap of 4 s, but too slow
        (200_000, 4.0, "max"),  # past the cap an operator set
    ],
)
def test_cold_wins_when_the_warm_queue_is_too_long(
    pending: int, max_wait: float | None, reason: str
) -> None:
    params = PrefixAwareParams()  # None: the default
    if max_wait is not None:
        params = replace(params, short=replace(params.short, max_warm_wait_s=max_wait))
    r = Router(PrefixAwarePolicy(params))
    doc = tokens(1, 8_000)
    warm(r, W0, doc)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=pending)
    d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
    assert d.worker_id == W1 and d.tier == "cold"
    assert d.warm_abandoned and reason in d.reason, d.reason


def test_no_cap_by_default_a_warm_queue_within_the_margin_keeps_the_request() -> None:
    # w0 holds the 8,000-token prompt behind about 4.2 s of queue; w1 is cold
    # with about 3.4 s of its own. Within the warm margin of w1's first token
    # (the copy's prefill on top of w1's queue: 4.35 s against 3.90 s, the
    # margin 0.5 s) the request stays: the old 4 s cap would have sent it to
    # w1, a copy whose prediction is no better by more than the margin, and
    # under overload every queue is past any cap.
    doc = tokens(1, 8_000)

    def route(max_wait: float | None) -> tuple[WorkerId, bool, str]:
        params = PrefixAwareParams(switch_backlog_weight=0.0)  # the defaults otherwise
        if max_wait is not None:
            params = replace(params, short=replace(params.short, max_warm_wait_s=max_wait))
        r = Router(PrefixAwarePolicy(params))
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], in_flight=4, pending_prefill_tokens=78_000)
        ws[1] = replace(ws[1], in_flight=4, pending_prefill_tokens=64_000)
        d = r.route(request("q", doc + tokens(5, 200)), ws, 1.0)
        return d.worker_id, d.warm_abandoned, d.reason

    worker, abandoned, reason = route(None)
    assert (worker, abandoned) == (W0, False) and "warm within margin" in reason, reason
    worker, abandoned, reason = route(4.0)
    assert (worker, abandoned) == (W1, True) and "max" in reason, reason


# --------------------------------------------------------- rule 3: warm margin


@pytest.mark.parametrize(
    ("warm_ttft", "pressure", "kept"),
    [
        (1.30, 1.0, True),  # 1.30 <= 1.0 + 1.0 * (1.0 * 0.25 + 0.05) = 1.30
        (1.31, 1.0, False),
        (1.15, 0.5, True),  # half the margin: limit 1.15
        (1.16, 0.5, False),
    ],
)
def test_warm_margin_rule_keeps_warm_within_the_margin(
    warm_ttft: float, pressure: float, kept: bool
) -> None:
    cs = [scored("w0", warm_ttft), scored("w1", 1.0)]
    choice = warm_margin_rule(cs, 0, 1, SHORT, pressure, 0.5)
    # Leaving the warm worker is marked: its wait made it too slow (a copy).
    assert choice.index == (0 if kept else 1) and choice.abandoned is not kept
    assert ("warm within margin" in choice.reason) is kept


def test_warm_margin_rule_counts_what_the_copy_costs_the_requests_queued() -> None:
    # 1.31 s warm against 1.0 s cold is past the margin (1.30) when the copy
    # delays no one; with one request to queue behind it on w1 the cold side
    # pays the 1.0 s of prefill it adds, less the warm's 0.31 s spared before none.
    cs = [scored("w0", 1.31, queue=1.0), scored("w1", 1.0)]
    assert warm_margin_rule(cs, 0, 1, SHORT, 1.0, 0.5).index == 1
    external = switch_externality(cs[0].terms, cs[1].terms, 0, 1, 1.0)
    kept = warm_margin_rule(cs, 0, 1, SHORT, 1.0, 0.5, external)
    assert kept.index == 0
    assert "(best cold w1 2000 ms, 1000 ms of it the queue behind)" in kept.reason


def test_warm_margin_rule_weighs_decode_by_the_switch_weight() -> None:
    # the warm worker decodes a big batch: 1 s more decode, weighed 0 for short answers
    cs = [scored("w0", 1.1, decode=2.0), scored("w1", 1.0, decode=1.0)]
    assert switch_score(cs[0], SHORT, 0.5) == pytest.approx(1.1)
    assert warm_margin_rule(cs, 0, 1, SHORT, 1.0, 0.5).index == 0
    weighs_decode = replace(SHORT, switch_decode_weight=1.0)
    assert switch_score(cs[0], weighs_decode, 0.5) == pytest.approx(3.1)
    assert warm_margin_rule(cs, 0, 1, weighs_decode, 1.0, 0.5).index == 1


def test_cache_pressure_is_how_full_the_cache_would_be() -> None:
    index = PrefixIndex()
    index.set_capacity(W0, 1_000)
    assert cache_pressure(index, W0, 250) == 0.25
    assert cache_pressure(index, W0, 5_000) == 1.0  # capped
    index.on_routed(W0, [BlockHash(h) for h in range(500)], 0.0)  # what it holds counts
    assert cache_pressure(index, W0, 250) == 0.75


def test_margin_limit_scales_with_the_best_ttft_not_its_score() -> None:
    best = scored("w1", 1.0, score=3.0)  # decode weighed into the score
    assert margin_limit(best, SHORT, 1.0) == pytest.approx(3.0 + 0.25 + 0.05)
    assert margin_limit(best, SHORT, 0.5) == pytest.approx(3.0 + 0.15)


@pytest.mark.parametrize(("cold_cache_full", "expected"), [(True, W0), (False, W1)])
def test_warm_wins_within_the_margin_when_a_copy_would_evict(
    cold_cache_full: bool, expected: WorkerId
) -> None:
    r = Router()
    doc = tokens(1, 1_000)
    warm(r, W0, doc)
    if cold_cache_full:
        fill_cache(r, W1)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=3_500)  # a short queue on the warm worker
    d = r.route(request("q", doc + tokens(5, 2_000)), ws, 1.0)
    c0, c1 = candidate(d, W0), candidate(d, W1)
    assert c0.score > c1.score  # type: ignore[attr-defined]  # pure cost says cold...
    # ...the margin keeps it warm when copying the prefix to w1 would evict others,
    # and vanishes when w1's cache has room (replicas warm up in parallel)
    assert d.worker_id == expected
    if cold_cache_full:
        assert "warm within margin" in d.reason


# ------------------------------------------------- rule 4a: prefill in progress


def _second_request_for_a_prefix_being_prefilled(
    gap_s: float, **params: object
) -> tuple[WorkerId, str]:
    """A 4,000-token prefix is routed to one worker of three and its prefill
    starts; ``gap_s`` later a second request for it arrives. Where does it go?"""
    r, ledger = Router(create_policy("prefix_aware", params)), InflightLedger()
    prefix = tokens(7, 4_000)
    views = [ledger.fill(WorkerView(w), 0.0) for w in (W0, W1, W2)]
    first = r.route(request("a", [*prefix, *tokens(8, 40)]), views, 0.0)
    r.on_routed(first, 0.0)
    ledger.on_routed(RequestId("a"), first.worker_id, 4_040, 4_040, 16, 0.0)
    views = [ledger.fill(WorkerView(w), gap_s) for w in (W0, W1, W2)]
    second = r.route(request("b", [*prefix, *tokens(9, 40)]), views, gap_s)
    holder = first.worker_id
    return (holder if second.worker_id == holder else WorkerId("idle")), second.reason


def test_a_prefill_just_started_is_not_waited_for_beside_an_idle_worker() -> None:
    # 10 ms into a ~200 ms prefill: waiting costs about as much as an idle
    # worker's cold prefill, and the requests that arrive meanwhile would
    # join this one's engine step; the margin alone kept it waiting.
    where, reason = _second_request_for_a_prefix_being_prefilled(0.01)
    assert where == "idle" and "its prefill in progress" in reason
    where, reason = _second_request_for_a_prefix_being_prefilled(0.01, wait_on_prefill=False)
    assert where != "idle" and "warm within margin" in reason


def test_a_prefill_nearly_done_is_waited_for() -> None:
    # 170 ms into it: what is left plus this request's own prefill comes
    # well before an idle worker's whole prefill.
    where, reason = _second_request_for_a_prefix_being_prefilled(0.17)
    assert where != "idle" and reason.startswith("warm, its prefill in progress")


def test_a_prefix_asked_for_slower_than_its_prefill_is_left_to_the_margin() -> None:
    # Asked for once per 2 s, a ~200 ms prefill is long done by the next
    # request: the rule does not apply (the margin rule decides).
    _, reason = _second_request_for_a_prefix_being_prefilled(2.0)
    assert "prefill in progress" not in reason


# ------------------------------------- rule 1a: every holder on its first prefill


def _after_three_first_prefills(
    shared: int, tails: tuple[int, int, int], tail: int, **params: object
) -> Decision:
    """Three prompts that share their first ``shared`` tokens, with tails of
    ``tails`` tokens, reach W0, W1 and W2 30 ms apart; at 90 ms, before any
    first token, a fourth with a ``tail``-token tail is routed."""
    r, ledger = Router(create_policy("prefix_aware", params)), InflightLedger()
    head = tokens(7, shared)
    for k, (w, n) in enumerate(zip((W0, W1, W2), tails, strict=True)):
        t = 0.03 * k
        rid = RequestId(f"r{k}")
        prompt = [*head, *tokens(10 + k, n)]
        d = r.route(request(rid, prompt), [ledger.fill(WorkerView(w), t)], t)
        r.on_routed(d, t)
        ledger.on_routed(rid, w, len(prompt), len(prompt), 16, t)
    views = [ledger.fill(WorkerView(w), 0.09) for w in (W0, W1, W2)]
    return r.route(request("q", [*head, *tokens(20, tail)]), views, 0.09)


def test_every_holder_on_its_first_prefill_the_one_that_ends_first_takes_it() -> None:
    # A shared 4,000-token prompt reached three workers 30 ms apart (a fleet
    # starting on one system prompt); at 90 ms none has sent a first token
    # and none is idle. The scores count each holder's whole queued prefill,
    # so the worker that started last (the shortest prompt) scored lowest;
    # the one whose prefill has run longest ends first.
    d = _after_three_first_prefills(4_000, (400, 200, 40), 40)
    assert d.worker_id == W0 and d.reason.startswith("every holder still on its first prefill")
    d = _after_three_first_prefills(4_000, (400, 200, 40), 40, earliest_prefill=False)
    assert d.worker_id == W2 and "first prefill" not in d.reason


def test_holders_of_a_short_shared_head_are_left_to_the_other_rules() -> None:
    # Three 4,000-token prompts that share only a 64-token head (a chat
    # template's first blocks) went to three workers 30 ms apart. Every
    # worker "holds" the head and none has answered, but their queues hold
    # other prompts: how long those have run says nothing of this request's
    # first token, so the rule stays out of it (unless the share is 0).
    tails = (4_000, 4_000, 4_000)
    assert "first prefill" not in _after_three_first_prefills(64, tails, 4_000).reason
    d = _after_three_first_prefills(64, tails, 4_000, earliest_prefill_min_share=0.0)
    assert d.reason.startswith("every holder")
