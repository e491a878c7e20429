"""EngineModel.abort: a disconnected client's request leaves the engine as in vLLM.

A waiting request leaves the queue at once; an admitted one leaves the batch at
the end of the step in flight, with no more outputs and its KV freed. The
coalesced engine must agree with the step-by-step reference under aborts too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.sim.engine import (
    Completed,
    EngineModel,
    EngineOutput,
    EngineRequest,
    FirstToken,
    KvEventOut,
)
from tests.sim.test_engine import PROFILE, SPEED, W, by_id, drive, first, req, workload


def run(
    engine: EngineModel,
    requests: Sequence[EngineRequest],
    aborts: Sequence[tuple[float, str]] = (),
) -> tuple[list[EngineOutput], dict[str, tuple[bool, int]]]:
    """Drive ``engine`` with submits and aborts at their times (advance first on ties).

    Returns:
        The outputs, and per aborted id what ``abort`` returned and how many
        outputs had come out before it.
    """
    events = sorted(
        [(r.arrival, 0, r.request_id, r) for r in requests]
        + [(t, 1, rid, None) for t, rid in aborts],
        key=lambda e: (e[0], e[1]),
    )
    out: list[EngineOutput] = []
    result: dict[str, tuple[bool, int]] = {}
    i = 0
    while True:
        wake = engine.next_wakeup()
        if i < len(events) and (wake is None or events[i][0] < wake):
            t, _, rid, r = events[i]
            i += 1
            out.extend(engine.advance(t))  # the protocol: advance to now first
            if r is not None:
                engine.submit(r, t)
            else:
                result[rid] = (engine.abort(rid, t), len(out))
        elif wake is not None:
            out.extend(engine.advance(wake))
        else:
            return out, result


def ids(outputs: Sequence[EngineOutput]) -> list[tuple[type, str | None]]:
    return [(type(o), getattr(o, "request_id", None)) for o in outputs]


def assert_idle_and_empty(e: EngineModel) -> None:
    assert e.next_wakeup() is None
    assert e.num_running == e.num_waiting == e.num_decoding == 0
    assert e.waiting_prompt_tokens == e.prefill_tokens_remaining == 0
    assert e.decode_context_tokens == 0
    assert e.kv_used_blocks == 0
    e.kv.check()


def test_aborting_a_waiting_request_takes_it_out_of_the_queue() -> None:
    e = EngineModel(W, replace(PROFILE, max_num_seqs=1))
    for r in (req("a", 100, 30), req("b", 200, 30), req("c", 50, 30)):
        e.submit(r, 0.0)
    e.advance(0.0)  # a runs; b and c wait for the one slot
    assert (e.num_running, e.num_waiting, e.waiting_prompt_tokens) == (1, 2, 250)
    epoch = e.epoch
    assert e.abort("b", 0.01)
    assert (e.num_running, e.num_waiting, e.waiting_prompt_tokens) == (1, 1, 50)
    assert e.aborted == 1 and e.epoch == epoch  # a's step is untouched
    assert not e.abort("b", 0.02)  # twice: nothing more
    assert not e.abort("nobody", 0.02)
    out = drive(e, [])
    table = by_id(out)
    assert "b" not in table
    # c took the slot b would have: at a's completion.
    assert first(out, "c").queue_wait_s == pytest.approx(table["a"]["done"].time)
    assert not e.abort("a", 100.0)  # finished: a no-op
    assert (e.completed, e.aborted) == (2, 1)
    assert_idle_and_empty(e)


def test_aborting_a_prefilling_request_stops_it_at_the_step_end() -> None:
    # 200 blocks: a (2000 + 50 tokens, 129 blocks) leaves no room for b (76 blocks).
    e = EngineModel(W, PROFILE, kv_blocks=200, emit_events=True)
    a = req("a", 2000, 50, family=5)
    b = req("b", 1200, 10, arrival=0.001)
    t1 = SPEED.prefill_time(512, 0)
    t2 = t1 + SPEED.prefill_time(512, 512)
    out = drive(e, [a, b], until=t1)
    assert e.num_running == 1 and e.num_waiting == 1
    now = (t1 + t2) / 2  # a's second chunk is being computed
    assert e.abort("a", now)
    # The step in flight runs as planned (vLLM takes aborts between steps).
    assert e.next_wakeup() == pytest.approx(t2)
    assert e.num_running == 1 and e.kv_used_blocks == 129
    tail = e.advance(t2)
    assert not [o for o in tail if getattr(o, "request_id", None) == "a"]
    stored = [o for o in tail if isinstance(o, KvEventOut)]
    assert len(stored) == 1  # the chunk computed before the abort is announced
    assert e.aborted == 1 and e.prefill_tokens_computed == 1024
    assert e.num_running == 1 and e.num_waiting == 0  # b took the freed memory at t2
    assert e.kv_used_blocks == 76
    out += tail + drive(e, [])
    assert "a" not in by_id(out)
    assert first(out, "b").queue_wait_s == pytest.approx(t2 - 0.001)
    assert_idle_and_empty(e)
    # a's computed blocks stayed in the prefix cache, as a finished request's do.
    again = drive(e, [req("a2", 2000, 1, arrival=10.0, family=5)])
    assert first(again, "a2").cached_tokens == 1024


def test_aborting_a_one_step_request_loses_its_only_output() -> None:
    e = EngineModel(W, PROFILE)
    e.submit(req("a", 300, 1), 0.0)
    e.advance(0.0)
    assert e.abort("a", 0.001)
    assert drive(e, []) == []
    assert e.completed == 0 and e.aborted == 1
    assert_idle_and_empty(e)


def test_abort_mid_segment_cuts_it_at_the_next_step_boundary() -> None:
    reqs = [req("a", 100, 300), req("b", 120, 200), req("c", 50, 400, arrival=0.2)]
    aborts = [(0.9, "a")]
    fast = EngineModel(W, PROFILE)
    # Up to the abort by hand, to look at the segment it cuts.
    drive(fast, [replace(r) for r in reqs], until=0.9)
    planned = fast.next_wakeup()
    assert planned is not None and planned > 1.0  # one segment up to b's completion
    used = fast.kv_used_blocks
    assert fast.abort("a", 0.9)
    cut = fast.next_wakeup()
    assert cut is not None and 0.9 < cut < 0.9 + SPEED.decode_step_time(3, 2000)
    assert fast.num_running == 3  # a is in the step in flight
    assert fast.advance(cut) == []
    assert fast.num_running == fast.num_decoding == 2
    assert fast.kv_used_blocks == used - 25  # a's 100 + 300 tokens
    drive(fast, [])
    assert_idle_and_empty(fast)

    # The same with a driver, against the step-by-step reference.
    fast = EngineModel(W, PROFILE)
    slow = EngineModel(W, PROFILE, coalesce_decodes=False)
    out_fast, res_fast = run(fast, [replace(r) for r in reqs], aborts)
    out_slow, res_slow = run(slow, [replace(r) for r in reqs], aborts)
    assert res_fast == res_slow == {"a": (True, res_fast["a"][1])}
    assert ids(out_fast) == ids(out_slow)
    assert ids(out_fast[res_fast["a"][1] :]).count((Completed, "a")) == 0
    assert "done" not in by_id(out_fast)["a"]
    for o, ref in zip(out_fast, out_slow, strict=True):
        assert o.time == pytest.approx(ref.time, rel=1e-9, abs=1e-9)
    assert fast.step_count == slow.step_count
    assert fast.busy_time == pytest.approx(slow.busy_time)
    assert fast.segments < slow.segments / 5  # still coalesced after the cut


def test_an_unknown_abort_changes_nothing() -> None:
    reqs = workload(30, seed=2)
    plain = drive(EngineModel(W, PROFILE, kv_blocks=150), [replace(r) for r in reqs])
    e = EngineModel(W, PROFILE, kv_blocks=150)
    out, res = run(e, [replace(r) for r in reqs], [(0.5, "nobody"), (1.0, "r-missing")])
    assert out == plain
    assert {rid: ok for rid, (ok, _) in res.items()} == {"nobody": False, "r-missing": False}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    kv_blocks=st.sampled_from([80, 150, 2000]),
    share=st.floats(0.1, 0.9),
)
def test_coalesced_engine_matches_step_by_step_under_aborts(
    seed: int, kv_blocks: int, share: float
) -> None:
    """Random workloads with aborts of waiting, prefilling, decoding and finished requests."""
    reqs = workload(40, seed=seed)
    rng = random.Random(seed)
    aborts = [
        (r.arrival + rng.uniform(0.0, 3.0), r.request_id) for r in reqs if rng.random() < share
    ]
    aborts.append((rng.uniform(0.0, 5.0), "unknown"))
    fast = EngineModel(W, PROFILE, kv_blocks=kv_blocks, emit_events=True)
    slow = EngineModel(W, PROFILE, kv_blocks=kv_blocks, emit_events=True, coalesce_decodes=False)
    out_fast, res_fast = run(fast, [replace(r) for r in reqs], aborts)
    out_slow, res_slow = run(slow, [replace(r) for r in reqs], aborts)

    assert [hit for hit, _ in res_fast.values()] == [hit for hit, _ in res_slow.values()]
    assert ids(out_fast) == ids(out_slow)
    for o, ref in zip(out_fast, out_slow, strict=True):
        assert o.time == pytest.approx(ref.time, rel=1e-9, abs=1e-9)
        if isinstance(o, FirstToken):
            assert isinstance(ref, FirstToken)
            assert o.cached_tokens == ref.cached_tokens
            assert o.kv_wait_s == pytest.approx(ref.kv_wait_s, rel=1e-9, abs=1e-9)
        elif isinstance(o, KvEventOut):
            assert isinstance(ref, KvEventOut) and o.event == ref.event
    assert fast.step_count == slow.step_count
    assert fast.busy_time == pytest.approx(slow.busy_time)
    assert fast.kv_wait_total == pytest.approx(slow.kv_wait_total)
    assert fast.evictions == slow.evictions
    assert (fast.completed, fast.aborted) == (slow.completed, slow.aborted)

    # Per request: an abort that hit leaves no output after it and never a completion.
    table = by_id(out_fast)
    hit = {rid for rid, (ok, _) in res_fast.items() if ok}
    assert fast.aborted == len(hit) and fast.completed + fast.aborted == len(reqs)
    for rid, (ok, before) in res_fast.items():
        if ok:
            assert all(getattr(o, "request_id", None) != rid for o in out_fast[before:])
            assert "done" not in table.get(rid, {})
    for r in reqs:
        if r.request_id not in hit:
            assert {"first", "done"} <= table[r.request_id].keys()
    for e in (fast, slow):
        assert_idle_and_empty(e)
