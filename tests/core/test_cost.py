from __future__ import annotations

from dataclasses import replace

import pytest

from prefixrouter.core import CostModel, SpeedProfile, WorkerId, WorkerView

W = WorkerView(WorkerId("w"))


def test_prefill_grows_with_new_tokens_and_attended_context() -> None:
    p = SpeedProfile()
    assert p.prefill_time(0) == 0.0
    assert p.prefill_time(2_000) < p.prefill_time(4_000)
    assert p.prefill_time(1_000, 0) < p.prefill_time(1_000, 50_000)


def test_terms_separate_and_sum_to_ttft() -> None:
    cm = CostModel()
    w = replace(W, in_flight=12, pending_prefill_tokens=5_000, decoding=10,
                context_tokens=20_000, queued_prompt_tokens=6_000,
                decode_tokens_remaining=2_000)  # fmt: skip
    t = cm.predict(w, 8_000, 2_000, 1.0, 100)
    # the batch it shares: 10 decoding plus 2 queued ahead, with their prompts
    step = w.profile.decode_step_time(12, 26_000)
    # queued prefill, plus half of the decode step in flight
    assert t.queue_wait_s == pytest.approx(w.profile.prefill_time(5_000) + 0.5 * step)
    assert t.prefill_s == pytest.approx(w.profile.prefill_time(6_000, 2_000))
    assert t.decode_impact_s > 0 and t.memory_risk_s == 0
    assert t.ttft_s == pytest.approx(t.queue_wait_s + t.prefill_s + t.decode_impact_s)
    assert t.step_s == pytest.approx(step)  # the grain of the first token, not a term of it


def test_confidence_weighs_cached_prefill() -> None:
    cm = CostModel()
    sure = cm.predict(W, 10_000, 8_000, 1.0, 10).prefill_s
    half = cm.predict(W, 10_000, 8_000, 0.5, 10).prefill_s
    cold = cm.predict(W, 10_000, 0, 0.0, 10).prefill_s
    assert sure < half < cold
    assert half == pytest.approx((sure + cold) / 2)


def test_memory_risk_when_kv_is_short() -> None:
    cm = CostModel()
    roomy = replace(W, decoding=4, decode_tokens_remaining=400, kv_used_blocks=100)
    tight = replace(roomy, kv_capacity_blocks=200, kv_used_blocks=190)
    assert cm.predict(roomy, 4_000, 0, 0.0, 100).memory_risk_s == 0
    assert cm.predict(tight, 4_000, 0, 0.0, 100).memory_risk_s > 0


def test_the_freed_memory_wait_counts_what_finishing_requests_free_not_the_prefix_they_share() -> (
    None
):
    # 40 questions about one 20,000-token document (1,250 blocks, held by all
    # of them) each hold 12 blocks of their own: finishing frees those 480
    # blocks, not the document's. A request 240 blocks short waits for half
    # of the running batch to drain, not a seventh (memory_risk's reading).
    cm = CostModel()
    needed = -(-(100 + 100) // 16)  # the new request's question and answer, in blocks
    capacity = 1_800
    used = capacity - needed + 240
    tight = replace(W, decoding=40, decode_tokens_remaining=4_000, context_tokens=40 * 20_100,
                    kv_capacity_blocks=capacity, kv_used_blocks=used,
                    decoding_own_tokens=40 * 12 * 16)  # fmt: skip
    drain = 100 * W.profile.decode_step_time(40, 40 * 20_100)  # 100 tokens left each
    terms = cm.predict(tight, 20_100, 20_000, 1.0, 100)
    assert terms.memory_risk_freed_s == pytest.approx(240 / 480 * drain)
    assert terms.memory_risk_s == pytest.approx(240 / used * drain)  # unchanged, and in the TTFT
    assert terms.ttft_s == pytest.approx(
        terms.queue_wait_s + terms.prefill_s + terms.decode_impact_s + terms.memory_risk_s
    )
    # Without the ledger's count (a view no ledger filled) the used blocks stand in.
    unknown = cm.predict(replace(tight, decoding_own_tokens=0), 20_100, 20_000, 1.0, 100)
    assert unknown.memory_risk_freed_s == pytest.approx(unknown.memory_risk_s)
    # With room there is no wait either way.
    roomy = cm.predict(replace(tight, kv_used_blocks=100), 20_100, 20_000, 1.0, 100)
    assert roomy.memory_risk_freed_s == roomy.memory_risk_s == 0.0


def test_full_slots_add_a_wait() -> None:
    cm = CostModel()
    free = replace(W, max_slots=4, in_flight=3, decoding=3, decode_tokens_remaining=300)
    full = replace(W, max_slots=4, in_flight=6, decoding=4, decode_tokens_remaining=400)
    step = W.profile.decode_step_time(4, 0)
    assert cm.predict(free, 100, 0, 0.0, 10).queue_wait_s < step  # half a step in flight
    # two requests queue for slots: each of 4 running has 100 tokens left
    assert cm.predict(full, 100, 0, 0.0, 10).queue_wait_s > 3 * 100 * step / 4


def test_calibration_converges_and_is_bounded() -> None:
    cm = CostModel()
    for _ in range(200):
        t = cm.predict(W, 4_000, 0, 0.0, 10)
        cm.observe(W.worker_id, t, t.ttft_s / t.scale * 1.5)
    assert cm.scale(W.worker_id) == pytest.approx(1.5, rel=0.01)
    for _ in range(500):
        t = cm.predict(W, 4_000, 0, 0.0, 10)
        cm.observe(W.worker_id, t, t.ttft_s * 1000)
    assert cm.scale(W.worker_id) == pytest.approx(cm.params.max_scale)
    assert cm.scale(W.worker_id) <= cm.params.max_scale
    cm.forget(W.worker_id)
    assert cm.scale(W.worker_id) == 1.0


def test_a_restarted_worker_follows_the_lowest_factor_of_the_others_until_observed() -> None:
    cm = CostModel()
    a, b, c = WorkerId("a"), WorkerId("b"), WorkerId("c")
    for _ in range(300):  # c learned 1.6 under its old load; a and b warmed to 0.8 and 0.9
        for w, factor in ((a, 0.8), (b, 0.9), (c, 1.6)):
            t = cm.predict(replace(W, worker_id=w), 4_000, 0, 0.0, 10)
            cm.observe(w, t, t.ttft_s / t.scale * factor)
    cm.restarted(c)
    assert cm.scale(c) == pytest.approx(cm.scale(a), rel=1e-5) and cm.scale(c) < cm.scale(a)
    assert cm.scale(a) == pytest.approx(0.8, rel=0.01)
    assert cm.scale(b) == pytest.approx(0.9, rel=0.01)  # the others keep theirs
    # Unobserved, it follows the lowest live: b learns its way below a, then back up.
    for factor in (0.7, 1.2):
        for _ in range(300):
            t = cm.predict(replace(W, worker_id=b), 4_000, 0, 0.0, 10)
            cm.observe(b, t, t.ttft_s / t.scale * factor)
        lowest = min(cm.scale(a), cm.scale(b))
        assert cm.scale(c) == pytest.approx(lowest, rel=1e-5) and cm.scale(c) < lowest
    assert cm.scale(WorkerId("new")) == 1.0  # a worker never observed: the profile's own
    # Its first observation gives it its own factor, which the others no longer move.
    t = cm.predict(replace(W, worker_id=c), 4_000, 0, 0.0, 10)
    cm.observe(c, t, t.ttft_s / t.scale * 1.6)
    own = cm.scale(c)
    assert own > cm.scale(a)
    cm.forget(a)
    assert cm.scale(c) == own and cm.scale(WorkerId("new")) == 1.0
    alone = CostModel()
    alone.restarted(a)  # no fleet to learn from: the profile's own factor
    assert alone.scale(a) == 1.0
