"""``prefix_aware`` copies: the hot-prefix rule, the idle copy, the room and the copy rule."""

from __future__ import annotations

from dataclasses import replace

from prefixrouter.core import (
    Decision,
    Router,
    WorkerView,
    create_policy,
)
from prefixrouter.core.policies.prefix_aware import (
    Choice,
    copy_room_filter,
    copy_rule,
    hot_prefix_rule,
    idle_copy_rule,
)
from tests.core.conftest import hold, request, tokens, warm, with_loads, workers
from tests.core.policies.prefix_aware.conftest import (
    SHORT,
    W0,
    W1,
    W2,
    W3,
    fill_cache,
    never,
    scored,
)

# ---------------------------------------------------------- rule 1: hot prefix


def test_hot_prefix_rule_warms_the_best_other_worker_when_demand_needs_it() -> None:
    cs = [scored("w0", 2.0), scored("w1", 1.5, queue=1.0), scored("w2", 1.2, queue=0.5)]
    demand = lambda: (40.0, 2)  # noqa: E731
    choice = hot_prefix_rule(cs, [0, 1, 2], [0], True, SHORT, demand)
    assert choice is not None and choice.index == 2 and not choice.abandoned
    assert choice.reason == "hot prefix: 40.0 req/s needs 2 replicas, 1 hold it; warming w2"
    assert hot_prefix_rule(cs, [0, 1, 2], [0, 2], True, SHORT, demand) is None  # 2 hold it
    assert hot_prefix_rule(cs, [0, 1, 2], [0], True, SHORT, lambda: (0.1, 1)) is None


def test_hot_prefix_rule_waits_for_a_settled_copy_and_a_free_other_worker() -> None:
    cs = [scored("w0", 2.0), scored("w1", 6.0, queue=5.0)]
    # only speculatively held: no demand read
    assert hot_prefix_rule(cs, [0, 1], [0], False, SHORT, never) is None
    # the other worker queues past the maximum wait (4 s): no demand read
    assert hot_prefix_rule(cs, [0, 1], [0], True, SHORT, never) is None
    # nobody else is eligible (the cold quota left only the holder)
    assert hot_prefix_rule(cs, [0], [0], True, SHORT, never) is None


def test_hot_prefix_warms_a_second_replica() -> None:
    doc = tokens(1, 8_000)

    def route_under_demand(
        requests_per_s: float,
        settled: bool = True,
        first_token: bool = False,
        proactive: bool = False,
        queued_on_holder: int = 9_000,
    ) -> Decision:
        # The rule's own verdict: the request itself goes to the new replica
        # (proactive copy off; with it on, the router sends the copy instead).
        r = Router(create_policy("prefix_aware", {"proactive_copy": proactive}))
        warm(r, W0, doc)
        ws = workers(2)
        ws[0] = replace(ws[0], pending_prefill_tokens=queued_on_holder)  # warm, but queued
        # a stream of this prefix at the given rate feeds the demand estimate
        for i in range(300):
            t = i / requests_per_s
            d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), ws, t)
            r.policy.on_routed(d.context, W0)
            if first_token and i == 0:
                r.on_first_token(replace(d, worker_id=W0), t)  # its prefill is done on w0
        now = 300 / requests_per_s
        if settled:
            hold(r, W0, doc, now)  # the engine has it (first copy prefilled)
        else:
            warm(r, W0, doc, now)  # only routed there: its first prefill may be running
        fill_cache(r, W1, 20_000, now)  # and w1 busy with other prefixes
        return r.route(request("x", doc + tokens(7, 50)), ws, now)

    calm, hot = route_under_demand(0.2), route_under_demand(50.0)
    assert calm.worker_id == W0 and "hot prefix" not in calm.reason
    assert hot.worker_id == W1 and "hot prefix" in hot.reason
    # The same demand while the only copy is still unconfirmed: no second copy yet.
    early = route_under_demand(50.0, settled=False)
    assert early.worker_id == W0 and "hot prefix" not in early.reason
    # Still unconfirmed in the index (the answer is decoding), but a first
    # token came from w0: the first copy is prefilled, so the second is warmed.
    prefilled = route_under_demand(50.0, settled=False, first_token=True)
    assert prefilled.worker_id == W1 and "hot prefix" in prefilled.reason
    # Proactive copy: the request stays warm (its first token sooner on the
    # holder's shorter queue), the copy is the router's.
    copied = route_under_demand(50.0, proactive=True, queued_on_holder=6_000)
    assert copied.worker_id == W0 and copied.warm_up == W1
    assert "warming w1 with a prefill-only copy" in copied.reason
    # A longer queue on the holder: the request's first token comes no later
    # on the copy, cold prefill included, so it warms the copy itself (rule 5)
    # and the router sends no copy of its own, though its score is higher
    # there (w1's long contexts decode slower): the rule compares first tokens.
    queued = route_under_demand(50.0, proactive=True)
    ttft = {c.worker_id: c.terms.ttft_s for c in queued.candidates if c.terms is not None}
    score = {c.worker_id: c.score for c in queued.candidates}
    assert ttft[W1] <= ttft[W0] and score[W1] > score[W0]
    assert queued.worker_id == W1 and queued.warm_up is None and "hot prefix" in queued.reason
    assert Router().policy.params.proactive_copy  # the default (decision_quality_notes.md)


def _hot_copy_route(
    *, suffix_tokens: int = 50, pending_on_holder: int = 6_000, pending_on_target: int = 0
) -> Decision:
    """An 8,000-token document asked 50 times a second, held (settled) only on
    w0, whose queue holds ``pending_on_holder`` tokens; w1 busy with other
    prefixes and ``pending_on_target`` tokens of prefill. The next request's
    decision, proactive copies on."""
    doc = tokens(1, 8_000)
    r = Router(create_policy("prefix_aware", {"proactive_copy": True}))
    warm(r, W0, doc)
    ws = workers(2)
    ws[0] = replace(ws[0], pending_prefill_tokens=pending_on_holder)
    for i in range(300):
        t = i / 50.0  # 50 requests a second: hot
        d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), ws, t)
        r.policy.on_routed(d.context, W0)
    hold(r, W0, doc, 6.0)
    fill_cache(r, W1, 20_000, 6.0)
    ws[1] = replace(ws[1], pending_prefill_tokens=pending_on_target)
    return r.route(request("x", doc + tokens(7, suffix_tokens)), ws, 6.0)


def test_no_prefill_only_copy_of_a_prefix_that_is_a_small_part_of_the_prompt() -> None:
    """A copy is the request's whole prompt with max_tokens 1: for a hot prefix
    that is under ``copy_min_prefix_share`` of the prompt, most of the copy
    would be this request's own text. The request then makes the copy itself,
    as with proactive copies off."""
    short = _hot_copy_route(suffix_tokens=50)  # the prefix is nearly all of the prompt
    assert short.worker_id == W0 and short.warm_up == W1  # the router copies it
    long = _hot_copy_route(suffix_tokens=12_000)  # 8,000 of 20,000 tokens: the request goes
    assert long.warm_up is None
    assert long.worker_id == W1 and "hot prefix" in long.reason


def test_no_prefill_only_copy_into_a_worker_with_a_prefill_pending() -> None:
    """A chunked-prefill engine prefills every admitted request's chunk in one
    step and each first token comes at its end: a copy sent to a worker with a
    user's prefill pending would delay that user's first token by the copy's
    prefill. The router then sends no copy; a later request asks again."""
    idle = _hot_copy_route(pending_on_holder=2_000)  # warm, a little queued
    assert idle.worker_id == W0 and idle.warm_up == W1
    # another request's 500 tokens still to prefill on w1
    busy = _hot_copy_route(pending_on_holder=2_000, pending_on_target=500)
    assert busy.worker_id == W0 and busy.warm_up is None
    assert "prefill-only copy" not in busy.reason


def test_copy_rule_lets_the_request_pay_the_copy_when_that_costs_it_nothing() -> None:
    cs = [scored("w0", 0.70, queue=0.6), scored("w1", 0.65), scored("w2", 0.9)]
    copy = Choice(1, "hot prefix: warming w1")
    kept = Choice(0, "warm within margin")
    assert copy_rule(cs, kept, copy) is copy  # sooner on the copy: the request goes
    assert copy_rule([*cs[:1], scored("w1", 0.70), cs[2]], kept, copy) is copy  # a tie too
    assert copy_rule([cs[0], scored("w1", 0.71), cs[2]], kept, copy) is kept  # later: stays
    assert copy_rule(cs, Choice(1, "lowest"), copy).reason == "lowest"  # already there


def test_copy_rule_compares_first_tokens_not_scores() -> None:
    """A score adds the answer's weighted decode (seconds) to a first token of
    tens of milliseconds: an idle copy target decodes faster, so its score can
    be lower while its cold prefill makes the first token three times later.
    The request then stays on the holder and the router's own copy warms the
    target (templates at load 0.6: four such requests were the p99)."""
    holder = scored("w0", 0.045, queue=0.01, decode=2.4, score=0.525)
    target = scored("w1", 0.150, decode=1.6, score=0.470)  # lower score, later first token
    kept = Choice(0, "the picker's holder within the band")
    copy = Choice(1, "hot prefix: warming w1")
    assert copy_rule([holder, target], kept, copy) is kept
    sooner = scored("w1", 0.045, decode=1.6, score=0.365)  # no later: it makes the copy
    assert copy_rule([holder, sooner], kept, copy) is copy


def test_copy_room_filter_keeps_workers_with_room_for_the_copy() -> None:
    ws = [
        WorkerView(W0, kv_capacity_blocks=1_000, kv_used_blocks=900),  # the holder
        WorkerView(W1, kv_capacity_blocks=1_000, kv_used_blocks=300),  # 300 + 500 <= 800
        WorkerView(W2, kv_capacity_blocks=1_000, kv_used_blocks=400),  # 400 + 500 > 800
    ]
    cs = [scored("w0", 1.0, matched=8_000), scored("w1", 2.0), scored("w2", 2.0)]
    assert copy_room_filter(ws, cs, [0, 1, 2], [0], 8_000, 0.8) == [0, 1]
    # a worker that reports no capacity is kept: nothing is known against it
    unknown = [ws[0], ws[1], WorkerView(W2)]
    assert copy_room_filter(unknown, cs, [0, 1, 2], [0], 8_000, 0.8) == [0, 1, 2]


def test_copy_room_filter_beside_holders_keeps_a_worker_less_full_than_every_holder() -> None:
    """The hot-prefix rule's reading: a copy past the share still has room when
    the worker would be less full of pinned blocks than the least full holder,
    where the request would otherwise wait for memory."""
    ws = [
        WorkerView(W0, kv_capacity_blocks=1_000, kv_used_blocks=960),  # holders: 96 %
        WorkerView(W1, kv_capacity_blocks=1_000, kv_used_blocks=980),  # and 98 % pinned
        WorkerView(W2, kv_capacity_blocks=1_000, kv_used_blocks=400),  # 900 < 960
        WorkerView(W3, kv_capacity_blocks=1_000, kv_used_blocks=460),  # 960: no less full
    ]
    cs = [scored("w0", 1.0, matched=8_000), scored("w1", 1.0, matched=8_000),
          scored("w2", 2.0), scored("w3", 2.0)]  # fmt: skip
    assert copy_room_filter(ws, cs, [0, 1, 2, 3], [0, 1], 8_000, 0.8) == [0, 1]
    beside = copy_room_filter(ws, cs, [0, 1, 2, 3], [0, 1], 8_000, 0.8, beside_holders=True)
    assert beside == [0, 1, 2]
    # Holders with room: the share alone decides, as without.
    roomy = [replace(ws[0], kv_used_blocks=500), *ws[1:]]
    kept = copy_room_filter(roomy, cs, [0, 1, 2, 3], [0, 1], 8_000, 0.8, beside_holders=True)
    assert kept == [0, 1]


def _hot_doc_on_holders_pinned_full(beside_holders: bool) -> Decision:
    """An 8,000-token document asked 50 times a second, settled on w0, whose KV
    its readers pin to 97 %; w1 is finishing another document's questions
    (1,300 of 2,000 blocks pinned: 1,800 with the copy, past the 80 % share)."""
    doc = tokens(1, 8_000)
    params = {"proactive_copy": False, "copy_room_beside_holders": beside_holders}
    r = Router(create_policy("prefix_aware", params))
    warm(r, W0, doc)
    full = WorkerView(W0, in_flight=40, decoding=38, kv_capacity_blocks=2_000,
                      kv_used_blocks=1_940, pending_prefill_tokens=9_000)  # fmt: skip
    busy = WorkerView(W1, in_flight=20, decoding=20, kv_capacity_blocks=2_000, kv_used_blocks=1_300)
    for i in range(300):
        d = r.route(request(f"h{i}", doc + tokens(100 + i, 50)), [full, busy], i / 50.0)
        r.policy.on_routed(d.context, W0)
    hold(r, W0, doc, 6.0)
    return r.route(request("x", doc + tokens(7, 50)), [full, busy], 6.0)


def test_hot_prefix_warms_a_worker_less_full_than_its_pinned_holders() -> None:
    beside = _hot_doc_on_holders_pinned_full(True)
    assert beside.worker_id == W1 and "hot prefix" in beside.reason
    # The record says why a worker past the share had room.
    assert beside.reason.endswith(
        "(room beside its holders: 90% pinned with the copy, the holders at least 97%)"
    )
    alone = _hot_doc_on_holders_pinned_full(False)
    assert alone.worker_id == W0 and "hot prefix" not in alone.reason


def no_share() -> float:
    raise AssertionError("the traffic share must not be read")


def test_idle_copy_rule_warms_an_idle_worker_while_the_holders_are_busy() -> None:
    # A 4,000-token prefix on w0 and w1, 200-220 ms there; cold on the idle
    # workers 300 and 250 ms, of which 205 ms is the prefix's prefill.
    cs = [
        scored("w0", 0.20, matched=4_000),
        scored("w1", 0.22, matched=4_000),
        scored("w2", 0.30),
        scored("w3", 0.25),
    ]
    busy_two = with_loads(20, 20, 0, 0)
    choice = idle_copy_rule(cs, busy_two, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, lambda: 1.0)
    assert choice is not None and choice.index == 3 and not choice.abandoned
    assert choice.reason == (
        "hot prefix: 100% of the traffic, 4 of 4 workers' share, 2 hold it, all busy, "
        "w3 idle; warming w3"
    )
    # Half the traffic is two workers' share, and two hold it.
    assert (
        idle_copy_rule(cs, busy_two, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, lambda: 0.5)
        is None
    )
    assert (
        idle_copy_rule(cs, busy_two, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, lambda: 0.51)
        is not None
    )
    # An idle holder takes the prefix's next request: no copy, no share read.
    idle_holder = with_loads(20, 0, 0, 0)
    assert (
        idle_copy_rule(cs, idle_holder, [0, 1, 2, 3], [0, 1], 0, SHORT, 4_050, 0.2, no_share)
        is None
    )


def test_idle_copy_rule_copies_only_a_prefix_whose_prefill_keeps_the_idle_worker_out() -> None:
    """Warm, w3 would answer in 45 ms against the holders' 200: a copy pays.
    A 500-token prefix (29 ms of prefill) leaves it at 221 ms, no better than
    the holders: within the warm margin, so no copy."""
    busy = with_loads(20, 20, 0, 0)
    long_prefix = [scored("w0", 0.20, matched=4_000), scored("w1", 0.21), scored("w2", 0.3),
                   scored("w3", 0.25)]  # fmt: skip
    assert idle_copy_rule(long_prefix, busy, [0, 1, 2, 3], [0], 0, SHORT, 4_050, 0.2, lambda: 1.0)
    short_prefix = [replace(long_prefix[0], matched_tokens=500), *long_prefix[1:]]
    assert (
        idle_copy_rule(short_prefix, busy, [0, 1, 2, 3], [0], 0, SHORT, 4_050, 0.2, no_share)
        is None
    )


def test_idle_copy_rule_copies_only_where_it_costs_nothing() -> None:
    cs = [scored("w0", 0.20, matched=4_000), scored("w1", 0.30, eviction=0.2), scored("w2", 0.25)]
    busy = with_loads(20, 0, 1)
    # w1 is idle but its copy would evict cached prefixes; w2 has a request in flight.
    assert idle_copy_rule(cs, busy, [0, 1, 2], [0], 0, SHORT, 4_050, 0.2, no_share) is None
    # A prefill pending is work in progress too (the copy would delay its first token).
    pending = [busy[0], replace(busy[1], in_flight=0), replace(busy[2], in_flight=0)]
    pending[2] = replace(pending[2], pending_prefill_tokens=500)
    assert idle_copy_rule(cs, pending, [0, 1, 2], [0], 0, SHORT, 4_050, 0.2, no_share) is None
    # Outside the room filter (``eligible``): not a target either.
    assert (
        idle_copy_rule(cs, with_loads(20, 0, 0), [0, 1], [0], 0, SHORT, 4_050, 0.2, no_share)
        is None
    )
    choice = idle_copy_rule(
        cs, with_loads(20, 0, 0), [0, 1, 2], [0], 0, SHORT, 4_050, 0.2, lambda: 1.0
    )
    assert choice is not None and choice.index == 2


def test_idle_copy_rule_leaves_an_idle_worker_room_for_the_next_prefix() -> None:
    """An idle worker is where the next new prefix goes: a copy may take no
    more of its KV than the headroom the room filter keeps (1 - 0.8). Live,
    four replicas copied a 20,000-token document, 42 % of an engine's KV,
    into the last idle engine just before the next document came (doc-qa
    mean TTFT 820-1,525 ms against 743-753 ms without the copy)."""
    cs = [scored("w0", 0.20, matched=4_000), scored("w1", 0.25)]
    small = with_loads(20, 0)
    small[1] = replace(small[1], kv_capacity_blocks=1_000, block_size=16)  # 254 > 200 blocks
    assert idle_copy_rule(cs, small, [0, 1], [0], 0, SHORT, 4_050, 0.2, no_share) is None
    large = [small[0], replace(small[1], kv_capacity_blocks=2_000)]  # 254 <= 400 blocks
    assert idle_copy_rule(cs, large, [0, 1], [0], 0, SHORT, 4_050, 0.2, lambda: 1.0)


def _shared_prompt_on_two_busy_workers(**params: object) -> Decision:
    """A 4,000-token system prompt that every request shares, 7 requests a
    second, settled on w0 and w1, each with 20 requests in flight and 1,500
    tokens to prefill, beside two idle workers. Answers are short, so the
    demand read at the profile's speed is one replica's (live, the engines
    decoded slower than the profile: the two idle engines got no request for
    a whole run)."""
    prompt = tokens(1, 4_000)
    r = Router(create_policy("prefix_aware", params))
    ws = [
        replace(w, pending_prefill_tokens=1_500) if w.in_flight else w
        for w in with_loads(20, 20, 0, 0)
    ]
    for i in range(140):
        t = i / 7.0
        d = r.route(request(f"s{i}", prompt + tokens(100 + i, 50), max_tokens=64), ws, t)
        r.policy.on_routed(d.context, W0 if i % 2 else W1)
    hold(r, W0, prompt, 20.0)
    hold(r, W1, prompt, 20.0)
    return r.route(request("x", prompt + tokens(7, 50), max_tokens=64), ws, 20.0)


def test_a_prefix_all_traffic_shares_is_copied_to_an_idle_worker() -> None:
    d = _shared_prompt_on_two_busy_workers()
    assert d.worker_id in (W0, W1) and d.warm_up in (W2, W3)
    assert "2 hold it, all busy" in d.reason and "with a prefill-only copy" in d.reason
    # Without the rule the demand reads one replica: the idle workers stay idle.
    off = _shared_prompt_on_two_busy_workers(idle_copy=False)
    assert off.worker_id in (W0, W1) and off.warm_up is None
