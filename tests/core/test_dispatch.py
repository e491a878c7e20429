"""The dispatcher: admissions, their settlement, the capacity mirror and worker and engine facts."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from prefixrouter.core import (
    BlockHasher,
    BlockStored,
    Dispatcher,
    EntrySource,
    Outcome,
    PromptBlocks,
    RequestId,
    Router,
    RoutingRequest,
    TokenEstimator,
    WorkerId,
    WorkerView,
    prefix_room_blocks,
)
from prefixrouter.core.dispatch import ROUTING_MODES, Admission, routing_mode
from prefixrouter.core.policy import create_policy
from prefixrouter.core.types import CacheNamespace
from prefixrouter.errors import NoWorkerAvailable
from tests.core.conftest import request, tokens, workers

W0, W1 = WorkerId("w0"), WorkerId("w1")
DOC = tokens(1, 16 * 20)  # 20 blocks of 16 tokens


def test_a_routing_mode_is_read_from_its_name_and_anything_else_is_refused_by_name() -> None:
    assert [routing_mode(name) for name in ("text", "token")] == ["text", "token"]
    assert set(ROUTING_MODES) == {"text", "token"}
    for bad in ("chars", "Token", " text", ""):
        with pytest.raises(ValueError, match=f"unknown routing mode {bad!r}: expected 'text' or"):
            routing_mode(bad)


def dispatcher(policy: str = "round_robin", **kw: Any) -> Dispatcher:
    return Dispatcher(Router(policy, **kw))


def counting_hashes(d: Dispatcher) -> list[RoutingRequest]:
    """Record every request the router hashes."""
    hashed: list[RoutingRequest] = []
    blocks_for = d.router.blocks_for

    def spy(request: RoutingRequest) -> PromptBlocks:
        hashed.append(request)
        return blocks_for(request)

    d.router.blocks_for = spy  # type: ignore[method-assign]
    return hashed


# ---------------------------------------------------------------- admissions


def test_admit_routes_records_the_routing_and_counts_it_in_flight() -> None:
    d = dispatcher()
    adm = d.admit(request("r", DOC, max_tokens=50), workers(2), 0.0)
    assert adm.worker in (W0, W1) and adm.request.request_id == "r"
    assert len(adm.blocks.hashes) == 20 and adm.decision.prompt_tokens == 320
    assert d.index_blocks(adm.worker) == 20  # speculative placement
    load = d.load(adm.worker)
    assert (load.in_flight, load.pending_prefill_tokens, load.queued_prompt_tokens) == (1, 320, 320)
    view = d.fill(WorkerView(adm.worker), 0.0)
    assert view.in_flight == 1 and view.queued_prompt_tokens == 320


def test_a_retry_reuses_the_hashes_and_avoids_every_worker_tried() -> None:
    d = dispatcher()
    hashed = counting_hashes(d)
    ws = workers(3)
    first = d.admit(request("r", DOC), ws, 0.0)
    d.reject(first, 0.1)
    second = d.retry(first, ws, 0.2)
    assert second.blocks is first.blocks and len(hashed) == 1  # hashed once
    assert second.worker != first.worker and second.tried == (first.worker,)
    d.reject(second, 0.3)
    third = d.retry(second, ws, 0.4)
    assert third.worker not in (first.worker, second.worker)
    assert third.tried == (first.worker, second.worker) and len(hashed) == 1
    d.reject(third, 0.5)
    with pytest.raises(NoWorkerAvailable):
        d.retry(third, ws, 0.6)  # every worker tried
    assert all(d.load(w.worker_id).in_flight == 0 for w in ws)


def test_a_retry_needs_the_previous_attempt_settled() -> None:
    d = dispatcher()
    first = d.admit(request("r", DOC), workers(2), 0.0)
    with pytest.raises(ValueError, match="settle"):
        d.retry(first, workers(2), 0.1)


def test_precomputed_blocks_are_routed_without_hashing_again() -> None:
    d = dispatcher()
    req = request("r", DOC)
    blocks = d.hash(req)
    hashed = counting_hashes(d)
    adm = d.admit(req, workers(2), 0.0, blocks)
    assert adm.blocks is blocks and hashed == []


def test_a_request_id_in_flight_is_refused_before_anything_changes() -> None:
    d = dispatcher()
    adm = d.admit(request("r", DOC), workers(1), 0.0)
    d.complete(adm, Outcome(0, 0.01), 0.5)
    first = d.admit(request("same", DOC), workers(1), 1.0)
    with pytest.raises(ValueError, match="already in flight"):
        d.admit(request("same", tokens(9, 160)), workers(1), 1.0)
    assert d.index_blocks(W0) == 20  # the refused request placed nothing
    assert d.load(W0).in_flight == 1
    d.reject(first, 2.0)


def test_reject_takes_the_routing_back() -> None:
    d = dispatcher()
    adm = d.admit(request("r", DOC), workers(1), 0.0)
    d.reject(adm, 0.1)
    assert d.index_blocks(W0) == 0 and d.load(W0).in_flight == 0
    assert adm.settled


def test_complete_confirms_and_reports_a_miss() -> None:
    d = dispatcher("prefix_aware")
    adm = d.admit(request("a", DOC), workers(1), 0.0)
    assert not d.complete(adm, Outcome(0, 0.05), 1.0)  # predicted cold, cold: no miss
    m = d.router.index.match(adm.blocks.hashes, 1.0)
    assert m[W0].blocks == 20 and m[W0].source is EntrySource.CONFIRMED
    again = d.admit(request("b", DOC), workers(1), 2.0)
    assert again.decision.predicted_cached_tokens > 0
    assert d.complete(again, Outcome(0, 0.05), 3.0)  # predicted warm, the engine missed
    assert d.load(W0).in_flight == 0


def test_a_request_routed_behind_a_running_prefill_is_no_evidence_against_the_worker() -> None:
    """Two requests for one document on one worker: the second was routed on the
    first's speculative entry while its prefill ran and reused only part of it.
    The worker keeps its trust (its next prediction is as confident), and the
    chain its answer confirms is the whole prompt."""
    d = dispatcher("prefix_aware")
    first = d.admit(request("a", DOC), workers(1), 0.0)
    second = d.admit(request("b", DOC), workers(1), 0.01)
    assert second.decision.predicted_cached_tokens > 0
    d.first_token(first, 0.5)
    d.complete(first, Outcome(0, 0.5), 0.6)
    assert d.complete(second, Outcome(16, 0.6), 0.7)  # a shortfall, reported as a miss
    index = d.router.index
    assert index.trust(W0, 0.7) == 1.0 and index.unconfirmed_misses == 1
    assert index.match(second.blocks.hashes, 0.7)[W0].source is EntrySource.CONFIRMED
    # The same shortfall against the confirmed chain lowers trust.
    third = d.admit(request("c", DOC), workers(1), 1.0)
    assert d.complete(third, Outcome(16, 0.1), 1.1)
    assert index.trust(W0, 1.1) < 1.0 and index.unexplained_misses == 1


def test_holds_prefix_names_a_decisions_prefix_while_the_index_holds_it() -> None:
    d = dispatcher("prefix_aware")
    adm = d.admit(request("a", DOC), workers(2), 0.0)
    d.complete(adm, Outcome(0, 0.05), 1.0)
    key, other = adm.decision.prefix_key, W1 if adm.worker == W0 else W0
    assert d.holds_prefix(adm.worker, key)
    assert not d.holds_prefix(other, key)
    assert not d.holds_prefix(adm.worker, "not-hex")
    d.worker_restarted(adm.worker, 2.0)  # an empty cache
    assert not d.holds_prefix(adm.worker, key)


def test_an_admission_settles_once() -> None:
    d = dispatcher()
    adm = d.admit(request("r", DOC), workers(1), 0.0)
    d.complete(adm, Outcome(320, 0.01), 1.0)
    held = d.index_blocks(W0)
    d.reject(adm, 2.0)  # too late: nothing taken back
    assert not d.complete(adm, Outcome(0, 0.01), 2.0)
    assert d.index_blocks(W0) == held and d.load(W0).in_flight == 0


def test_the_first_token_moves_the_prompt_from_queued_to_context() -> None:
    d = dispatcher()
    adm = d.admit(request("r", DOC, max_tokens=40), workers(1), 0.0)
    d.first_token(adm, 0.5)
    d.first_token(adm, 0.5)  # noted once
    load = d.load(W0)
    assert adm.first_token
    assert (load.queued_prompt_tokens, load.context_tokens, load.decoding) == (0, 320, 1)
    assert load.decode_tokens_remaining == 40
    d.complete(adm, Outcome(0, 0.01), 1.0)
    assert (load.in_flight, load.context_tokens, load.decoding) == (0, 0, 0)


def test_a_removed_workers_admissions_feed_nothing_back() -> None:
    d = dispatcher()
    adm = d.admit(request("r", DOC), workers(1), 0.0)
    late = d.admit(request("s", tokens(2, 64)), workers(1), 0.0)
    assert d.remove_worker(W0) == ["r", "s"]
    assert d.index_blocks(W0) == 0
    assert not d.complete(adm, Outcome(320, 0.01), 1.0)
    d.reject(late, 1.0)
    assert d.index_blocks(W0) == 0 and d.load(W0).in_flight == 0  # no entries of a gone worker


# ---------------------------------------------------------------- capacity


def test_the_mirror_leaves_room_for_running_requests_output() -> None:
    d = dispatcher()
    d.router.index.on_routed(W0, d.hash(request("doc", tokens(1, 1600))).hashes, 0.0)
    view = WorkerView(W0, kv_capacity_blocks=120, block_size=16)
    d.mirror_capacity([view])
    assert d.index_capacity(W0) == 120 and d.index_blocks(W0) == 100
    # 60 blocks in use, 20 of them running prompts: 40 blocks of output and
    # partial blocks leave room for 80 blocks of cached prefixes
    d.mirror_capacity([replace(view, kv_used_blocks=60, context_tokens=20 * 16)])
    assert d.index_capacity(W0) == 80 and d.index_blocks(W0) == 80
    assert d.router.index.match(d.hash(request("q", tokens(1, 1600))).hashes, 0.0)[W0].blocks == 80


def test_prompts_sent_and_not_decoding_count_as_prefix_blocks() -> None:
    view = WorkerView(W0, kv_capacity_blocks=1000, kv_used_blocks=500, block_size=16)
    assert prefix_room_blocks(view, 16.0) == 500  # nothing known in flight: all other
    decoding = replace(view, context_tokens=400 * 16)
    assert prefix_room_blocks(decoding, 16.0) == 900  # their prompts are cached prefixes
    # a prompt sent and not decoding yet is being prefilled (or waits): its
    # blocks, once held, are cached prefixes too, not room taken from them
    queued = replace(view, queued_prompt_tokens=400 * 16)
    assert prefix_room_blocks(queued, 16.0) == 900
    assert prefix_room_blocks(replace(decoding, kv_used_blocks=0), 16.0) == 1000  # never more


def test_text_mode_mirrors_in_character_chunk_blocks() -> None:
    hasher = BlockHasher(chunk_chars=256, estimator=TokenEstimator(4.0))
    d = Dispatcher(Router("round_robin", hasher), mode="text")
    assert d.index_block_tokens() == 64.0  # 256 characters at 4 per token
    d.mirror_capacity([WorkerView(W0, kv_capacity_blocks=1000, block_size=16)])
    assert d.index_capacity(W0) == 250  # 16,000 tokens in 64-token chunks
    token = Dispatcher(Router("round_robin", hasher), mode="token")
    token.mirror_capacity([WorkerView(W0, kv_capacity_blocks=1000, block_size=16)])
    assert token.index_capacity(W0) == 1000


def test_a_running_requests_prompt_outlives_the_prompts_that_pass_it() -> None:
    # The engine cannot evict a running request's blocks; the index keeps them
    # too until the request ends, then forgets them by recency like any other.
    d = dispatcher()
    d.router.set_worker_capacity(W0, 30)
    ws = workers(1)
    long = d.admit(request("long", DOC, max_tokens=2000), ws, 0.0)
    for i in range(5):  # 40 blocks pass through while it decodes
        short = d.admit(request(f"s{i}", tokens(10 + i, 16 * 8)), ws, 1.0 + i)
        d.complete(short, Outcome(0, 0.1), 1.5 + i)
    assert d.router.index.match(long.blocks.hashes, 6.0)[W0].blocks == 20
    assert d.router.index.pinned_blocks(W0) == 20
    d.complete(long, Outcome(0, 0.1), 7.0)
    assert d.router.index.pinned_blocks(W0) == 0
    for i in range(5):
        short = d.admit(request(f"t{i}", tokens(20 + i, 16 * 8)), ws, 8.0 + i)
        d.complete(short, Outcome(0, 0.1), 8.5 + i)
    assert d.router.index.match(long.blocks.hashes, 13.0) == {}


def test_every_end_of_a_routing_releases_its_pins() -> None:
    d = dispatcher()
    index = d.router.index
    ws = workers(2)

    def pinned() -> int:
        return index.pinned_blocks(W0) + index.pinned_blocks(W1)

    adm = d.admit(request("a", DOC), ws, 0.0)
    assert pinned() == 20
    d.reject(adm, 0.1)
    assert pinned() == 0
    retry = d.retry(adm, ws, 0.2)
    assert pinned() == 20
    d.complete(retry, Outcome(0, 0.1), 0.3)
    d.complete(retry, Outcome(0, 0.1), 0.4)  # settled once: released once
    assert pinned() == 0
    d.admit(request("b", DOC), ws, 0.5)
    d.admit(request("c", tokens(2, 64)), ws, 0.5)
    assert pinned() == 24
    d.remove_worker(W0)
    d.remove_worker(W1)
    assert pinned() == 0
    # A peer's routings: settled by its answer, by its going, by their age.
    origin, peer = Dispatcher(Router("round_robin"), record_facts=True), dispatcher()
    for i, settle in enumerate(("answer", "gone", "expire")):
        sent = origin.admit(request(f"p{i}", DOC), ws, float(i))
        for fact in origin.drain_facts():
            peer.apply_peer("a@1", fact, float(i))
        assert peer.router.index.pinned_blocks(sent.worker) == 20
        if settle == "answer":
            origin.complete(sent, Outcome(0, 0.1), float(i) + 0.5)
            for fact in origin.drain_facts():
                peer.apply_peer("a@1", fact, float(i) + 0.5)
        elif settle == "gone":
            peer.peer_gone("a@1")
        else:
            peer.peer_expire(before=float(i) + 1.0)
        assert peer.router.index.pinned_blocks(sent.worker) == 0, settle


# ---------------------------------------------------------------- worker and engine facts


def test_worker_down_restarted_and_event_gaps() -> None:
    d = dispatcher()
    doc = d.hash(request("doc", DOC)).hashes
    d.apply_event(BlockStored(W0, list(doc)), 0.0)
    d.apply_event(BlockStored(W1, list(doc)), 0.0)
    assert d.events_gap(W0, 1.0) == 20
    m = d.router.index.match(doc, 1.0)
    assert m[W0].source is EntrySource.SPECULATIVE and m[W1].source is EntrySource.EVENT
    assert d.worker_down(W1, 2.0) == 20
    d.worker_restarted(W0, 3.0)
    assert d.index_blocks(W0) == 0 and d.index_blocks(W1) == 20


def test_untrusted_events_enter_as_speculative() -> None:
    d = dispatcher()
    doc = d.hash(request("doc", DOC)).hashes
    d.apply_event(BlockStored(W0, list(doc)), 0.0, trusted=False)
    assert d.router.index.match(doc, 0.0)[W0].source is EntrySource.SPECULATIVE


def test_characters_per_token_and_block_size_observations() -> None:
    d = dispatcher()
    assert d.chars_per_token == 4.0
    d.observe_prompt_tokens(3000, 1000)  # 3 characters per token: the first answer replaces 4.0
    assert d.chars_per_token == pytest.approx(3.0)
    d.observe_prompt_tokens(5000, 1000)  # the second: an equal-weight mean
    assert d.chars_per_token == pytest.approx(4.0)
    estimator = d.router.hasher.estimator
    d.set_block_size(32)
    assert d.block_size == 32 and d.router.hasher.estimator is estimator  # learning kept
    req = RoutingRequest(RequestId("r"), CacheNamespace("m"), tokens=DOC)
    assert len(d.hash(req).hashes) == 10
    assert d.policy_name == "round_robin" and d.evicted_entries == 0


def _hot_document(proactive: bool, **params: float) -> tuple[Dispatcher, list[Admission], WorkerId]:
    """One document settled on a worker, then asked about 60 times a second."""
    policy = create_policy("prefix_aware", {"proactive_copy": proactive, **params})
    d = Dispatcher(Router(policy))
    doc = tokens(1, 4_000)
    views = workers(3)
    first = d.admit(request("r0", [*doc, *tokens(2, 20)]), views, 0.0)
    d.first_token(first, 0.4)
    d.complete(first, Outcome(0, 0.4), 0.5)
    admissions = []
    for k in range(1, 40):
        now = 0.5 + k / 60
        adm = d.admit(
            request(f"r{k}", [*doc, *tokens(100 + k, 20)]), [d.fill(v, now) for v in views], now
        )
        admissions.append(adm)
        if adm.worker != first.worker or adm.decision.warm_up is not None:
            break
    return d, admissions, first.worker


def test_a_hot_prefix_is_copied_by_the_users_request_without_proactive_copy() -> None:
    _, admissions, holder = _hot_document(False)
    copy = admissions[-1]
    assert copy.worker != holder and copy.decision.warm_up is None
    assert "hot prefix" in copy.decision.reason and copy.decision.predicted_cached_tokens == 0


def test_proactive_copy_keeps_the_request_warm_and_warms_the_copy_itself() -> None:
    d, admissions, holder = _hot_document(True)
    last = admissions[-1]
    target = last.decision.warm_up
    # The request that called for the copy stays on the holder, warm...
    assert target is not None and target != holder
    assert last.worker == holder and last.decision.predicted_cached_tokens > 0
    assert f"warming {target} with a prefill-only copy" in last.decision.reason
    assert last.decision.to_dict()["warm_up"] == target
    # ...and the router's own prefill-only request goes to the copy.
    views = [d.fill(v, last.decision.now) for v in workers(3)]
    warm = d.warm_up(last, views, last.decision.now)
    assert warm is not None and warm.worker == target
    assert warm.request.request_id == f"{last.request.request_id}:warm-up"
    assert warm.request.max_tokens == 1 and warm.blocks is last.blocks
    assert d.load(target).in_flight == 1  # counted in flight like any request
    d.first_token(warm, last.decision.now + 0.4)
    d.complete(warm, Outcome(0, None), last.decision.now + 0.5)
    assert d.load(target).in_flight == 0
    assert d.router.index.match(last.blocks.hashes, 2.0)[target].blocks > 0  # now a holder
    # No copy asked for, or the worker gone: nothing to admit.
    assert d.warm_up(admissions[0], views, 2.0) is None
    assert d.warm_up(last, [v for v in views if v.worker_id != target], 2.0) is None


def test_proactive_copies_stop_at_the_budget_and_resume_as_it_refills() -> None:
    # 10 % of a worker's time over 20 s: a 2 s burst of predicted prefill.
    d, admissions, _ = _hot_document(True, copy_budget_share=0.1, copy_budget_window_s=20.0)
    last = admissions[-1]
    target = last.decision.warm_up
    assert target is not None
    terms = next(c.terms for c in last.decision.candidates if c.worker_id == target)
    assert terms is not None
    prefill_s = terms.prefill_s
    assert 0 < prefill_s < 2.0
    views = [d.fill(v, last.decision.now) for v in workers(3)]

    def copies(now: float) -> int:
        """Copies sent one after another at ``now`` until the budget says no."""
        n = 0
        while (warm := d.warm_up(last, views, now)) is not None:
            d.first_token(warm, now)
            d.complete(warm, Outcome(0, None), now)
            n += 1
        return n

    t = last.decision.now
    burst = math.ceil(2.0 / prefill_s)  # while anything is left, the last one into debt
    assert copies(t) == burst
    debt = burst * prefill_s - 2.0
    assert copies(t + debt / 0.1 - 0.01) == 0  # still in debt: no copy
    assert copies(t + debt / 0.1 + 0.01) == 1  # out of it: one
    assert d.load(target).in_flight == 0  # nothing refused was counted in flight
