"""Behaviour of the simulated engine: timing, reuse, chunking, coalescing, KV waits, events."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from prefixrouter.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixrouter.core.hashing import hash_token_blocks
from prefixrouter.core.types import BlockHash, SpeedProfile, WorkerId
from prefixrouter.sim.engine import (
    Completed,
    EngineModel,
    EngineOutput,
    EngineRequest,
    FirstToken,
    KvEventOut,
)
from prefixrouter.sim.profiles import EngineProfile

BS = 16
SPEED = SpeedProfile(
    prefill_overhead_s=0.01,
    prefill_s_per_token=1e-4,
    prefill_s_per_token_context=1e-8,
    decode_step_s=0.005,
    decode_s_per_seq=1e-4,
    decode_s_per_context_token=1e-6,
    chunk_tokens=512,
)
PROFILE = EngineProfile(
    "test", "round numbers", SPEED, kv_blocks=2000, block_size=BS,
    max_num_seqs=8, max_batched_tokens=512,
)  # fmt: skip
W = WorkerId("w0")


def req(
    rid: str, prompt: int, output: int, arrival: float = 0.0, family: int | None = None
) -> EngineRequest:
    """A request whose prompt is ``prompt`` tokens of family ``family`` (default: unique)."""
    fam = family if family is not None else hash(rid) % 1_000_000 + 1_000
    tokens = [(fam * 7919 + i * 31) % 50_000 for i in range(prompt)]
    return EngineRequest(rid, hash_token_blocks(fam, tokens, BS), prompt, output, arrival)


def drive(
    engine: EngineModel, requests: Sequence[EngineRequest], until: float = 1e9
) -> list[EngineOutput]:
    """Submit each request at its arrival; advance the engine in between (advance first on ties)."""
    pending = sorted(requests, key=lambda r: r.arrival)
    out: list[EngineOutput] = []
    i = 0
    while True:
        wake = engine.next_wakeup()
        nxt = pending[i].arrival if i < len(pending) else None
        if nxt is not None and (wake is None or nxt < wake):
            engine.submit(pending[i], nxt)
            i += 1
        elif wake is not None and wake <= until:
            out.extend(engine.advance(wake))
        else:
            return out


def by_id(outputs: Sequence[EngineOutput]) -> dict[str, dict[str, EngineOutput]]:
    table: dict[str, dict[str, EngineOutput]] = {}
    for o in outputs:
        if isinstance(o, FirstToken):
            table.setdefault(o.request_id, {})["first"] = o
        elif isinstance(o, Completed):
            table.setdefault(o.request_id, {})["done"] = o
    return table


def first(outputs: Sequence[EngineOutput], rid: str) -> FirstToken:
    o = by_id(outputs)[rid]["first"]
    assert isinstance(o, FirstToken)
    return o


def done(outputs: Sequence[EngineOutput], rid: str) -> Completed:
    o = by_id(outputs)[rid]["done"]
    assert isinstance(o, Completed)
    return o


def test_single_request_ttft_is_the_prefill_time() -> None:
    e = EngineModel(W, PROFILE)
    out = drive(e, [req("a", 300, 1, arrival=2.0)])
    ft = first(out, "a")
    assert ft.time - 2.0 == pytest.approx(SPEED.prefill_time(300, 0))
    assert (ft.cached_tokens, ft.prompt_tokens, ft.queue_wait_s, ft.kv_wait_s) == (0, 300, 0, 0)
    assert done(out, "a").time == ft.time  # one output token: done with the first
    assert e.next_wakeup() is None and e.num_running == 0
    assert e.prefill_tokens_computed == 300
    assert e.busy_time == pytest.approx(ft.time - 2.0)


def test_decode_steps_follow_the_profile() -> None:
    e = EngineModel(W, PROFILE)
    out = drive(e, [req("a", 100, 4)])
    ttft = SPEED.prefill_time(100, 0)
    # Tokens 2..4 each take one decode step at context 101, 102, 103.
    decode = sum(SPEED.decode_step_time(1, 100 + g) for g in (1, 2, 3))
    assert done(out, "a").time == pytest.approx(ttft + decode)
    assert e.step_count == 4


def test_repeated_prompt_is_served_from_cache() -> None:
    e = EngineModel(W, PROFILE)
    out = drive(e, [req("a", 300, 2, family=1), req("b", 300, 2, arrival=5.0, family=1)])
    a, b = first(out, "a"), first(out, "b")
    assert a.cached_tokens == 0
    assert b.cached_tokens == (300 - 1) // BS * BS  # 288: whole blocks only
    assert b.time - 5.0 == pytest.approx(SPEED.prefill_time(300 - 288, 288))
    assert b.time - 5.0 < a.time
    assert e.cached_tokens_total == 288
    assert e.prefill_tokens_computed == 300 + 12


def test_fully_cached_prompt_recomputes_its_last_token() -> None:
    e = EngineModel(W, PROFILE)
    out = drive(e, [req("a", 320, 1, family=1), req("b", 320, 1, arrival=5.0, family=1)])
    assert first(out, "b").cached_tokens == 304  # 320 - 1 rounded down to blocks


def test_one_step_pays_the_fixed_overhead_once() -> None:
    e = EngineModel(W, PROFILE)
    e.submit(req("a", 200, 1), 0.0)
    e.submit(req("b", 100, 1), 0.0)
    out = drive(e, [])  # both fit in one 512-token step
    step = SPEED.prefill_time(200, 0) + SPEED.prefill_time(100, 0) - SPEED.prefill_overhead_s
    assert first(out, "a").time == pytest.approx(step)
    assert first(out, "b").time == pytest.approx(step)
    assert e.step_count == 1


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    e = EngineModel(W, PROFILE)
    out = drive(e, [req("a", 1300, 1)])
    expected = (
        SPEED.prefill_time(512, 0) + SPEED.prefill_time(512, 512) + SPEED.prefill_time(276, 1024)
    )
    assert first(out, "a").time == pytest.approx(expected)
    assert e.step_count == 3  # ceil(1300 / 512)


def boundary(t_first: float, prompt: int, now: float) -> tuple[float, int]:
    """For a lone request decoding since ``t_first``: the first step end at or after
    ``now`` and the tokens it has then."""
    t, g = t_first, 1
    while t < now:
        t += SPEED.decode_step_time(1, prompt + g)
        g += 1
    return t, g


def test_prefill_shares_steps_with_running_decodes() -> None:
    e = EngineModel(W, PROFILE)
    out = drive(e, [req("a", 100, 500), req("b", 1000, 1, arrival=0.5)])
    t, g = boundary(SPEED.prefill_time(100, 0), 100, 0.5)
    # b's two chunks ride with a's decode: the budget left is 511, then 489.
    expected = (
        t
        + SPEED.prefill_time(511, 0)
        + SPEED.decode_step_time(1, 100 + g)
        + SPEED.prefill_time(489, 511)
        + SPEED.decode_step_time(1, 100 + g + 1)
    )
    assert first(out, "b").time == pytest.approx(expected)
    assert first(out, "b").queue_wait_s == pytest.approx(t - 0.5)


def test_same_prompt_in_flight_reuses_only_computed_blocks() -> None:
    e = EngineModel(W, PROFILE)
    # b arrives while a's 1300-token prompt is half prefilled (after its first chunk).
    t_mid = SPEED.prefill_time(512, 0) * 1.5
    out = drive(e, [req("a", 1300, 1, family=3), req("b", 1300, 1, arrival=t_mid, family=3)])
    cached = first(out, "b").cached_tokens
    assert cached == 1024  # two chunks computed by the boundary where b is admitted


def workload(n: int, seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(8.0)
        fam = rng.choice([None, 1, 2])
        out.append(
            req(f"r{i}", rng.randrange(20, 900), rng.randrange(1, 120), arrival=t, family=fam)
        )
    return out


@pytest.mark.parametrize(("kv_blocks", "seed"), [(80, 3), (150, 3), (2000, 4)])
def test_coalesced_decodes_match_step_by_step_simulation(kv_blocks: int, seed: int) -> None:
    reqs = workload(60, seed=seed)
    fast = EngineModel(W, PROFILE, kv_blocks=kv_blocks)
    slow = EngineModel(W, PROFILE, kv_blocks=kv_blocks, coalesce_decodes=False)
    raw_fast = drive(fast, [replace(r) for r in reqs])
    raw_slow = drive(slow, [replace(r) for r in reqs])
    assert [(type(o), getattr(o, "request_id", None)) for o in raw_fast] == [
        (type(o), getattr(o, "request_id", None)) for o in raw_slow
    ]
    out_fast, out_slow = by_id(raw_fast), by_id(raw_slow)
    assert out_fast.keys() == out_slow.keys() and len(out_fast) == 60
    for rid, got in out_fast.items():
        ref = out_slow[rid]
        f, g = got["first"], ref["first"]
        assert isinstance(f, FirstToken) and isinstance(g, FirstToken)
        assert f.cached_tokens == g.cached_tokens, rid
        assert f.time == pytest.approx(g.time, rel=1e-9, abs=1e-9), rid
        assert f.queue_wait_s == pytest.approx(g.queue_wait_s, rel=1e-9, abs=1e-9), rid
        assert f.kv_wait_s == pytest.approx(g.kv_wait_s, rel=1e-9, abs=1e-9), rid
        assert got["done"].time == pytest.approx(ref["done"].time, rel=1e-9, abs=1e-9), rid
    assert fast.step_count == slow.step_count
    assert fast.busy_time == pytest.approx(slow.busy_time)
    assert fast.kv_wait_total == pytest.approx(slow.kv_wait_total)
    assert fast.evictions == slow.evictions
    if kv_blocks < 200:
        assert fast.kv_wait_total > 0  # the small cache made some requests wait
    assert fast.segments < slow.segments / 5  # and coalescing needed far fewer events


def test_submit_during_a_segment_truncates_it_at_the_next_step_boundary() -> None:
    e = EngineModel(W, PROFILE)
    t0 = SPEED.prefill_time(100, 0)
    drive(e, [req("a", 100, 200)], until=t0)  # a's prefill is done; one segment is left
    assert e.step_count == 1
    wake = e.next_wakeup()
    assert wake == pytest.approx(
        t0 + sum(SPEED.decode_step_time(1, 100 + g) for g in range(1, 200))
    )
    now = t0 + 0.3
    epoch = e.epoch
    e.submit(req("b", 50, 1, arrival=now), now)
    assert e.epoch > epoch
    t, _ = boundary(t0, 100, now)
    assert t > now
    assert e.next_wakeup() == pytest.approx(t)
    out = drive(e, [])
    assert first(out, "b").queue_wait_s == pytest.approx(t - now)
    ref = drive(
        EngineModel(W, PROFILE, coalesce_decodes=False),
        [req("a", 100, 200), req("b", 50, 1, arrival=now)],
    )
    assert first(out, "b").time == pytest.approx(first(ref, "b").time)
    assert done(out, "a").time == pytest.approx(done(ref, "a").time)
    assert e.step_count == 200  # b's prefill shared one of a's 199 decode steps


def test_request_that_does_not_fit_waits_for_kv() -> None:
    e = EngineModel(W, PROFILE, kv_blocks=20)
    out = drive(e, [req("a", 100, 150), req("b", 100, 10, arrival=0.2), req("c", 20, 1, 0.3)])
    a_done = done(out, "a").time
    b, c = first(out, "b"), first(out, "c")
    assert b.queue_wait_s == pytest.approx(a_done - 0.2)
    # b was found blocked at the first step boundary after it arrived, not at 0.2.
    assert 0 < b.kv_wait_s < b.queue_wait_s
    assert b.kv_wait_s > a_done - 0.2 - 0.05
    assert c.time > b.time - 1e-12  # FCFS: c queued behind the blocked head
    assert c.kv_wait_s == pytest.approx(a_done - 0.3)
    assert e.kv_wait_total == pytest.approx(b.kv_wait_s + c.kv_wait_s + 0.0)


def test_slot_limit_queues_without_kv_wait() -> None:
    profile = replace(PROFILE, max_num_seqs=2)
    e = EngineModel(W, profile)
    out = drive(e, [req(f"r{i}", 50, 30) for i in range(3)])
    r2 = first(out, "r2")
    assert r2.queue_wait_s == pytest.approx(min(done(out, "r0").time, done(out, "r1").time))
    assert r2.kv_wait_s == 0


def test_events_describe_the_cache() -> None:
    e = EngineModel(W, PROFILE, kv_blocks=120, emit_events=True)
    out = drive(e, workload(40, seed=5))
    held: set[BlockHash] = set()
    stored = removed = 0
    for o in out:
        if isinstance(o, KvEventOut):
            ev = o.event
            assert ev.worker_id == W
            if isinstance(ev, BlockStored):
                assert not held & set(ev.block_hashes)  # only new hashes are announced
                held.update(ev.block_hashes)
                stored += 1
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= held
                held.difference_update(ev.block_hashes)
                removed += 1
    assert stored > 0 and removed > 0 and e.evictions > 0
    assert e.kv.cached_blocks == len(held)
    assert all(h in e.kv for h in held)
    times = [o.time for o in out]
    assert times == sorted(times)
    e.kv.check()


def test_reset_cache_forgets_prefixes() -> None:
    e = EngineModel(W, PROFILE, emit_events=True)
    drive(e, [req("a", 300, 1, family=1)])
    assert e.reset_cache(10.0) == [KvEventOut(10.0, AllBlocksCleared(W))]
    out = drive(e, [req("b", 300, 1, arrival=11.0, family=1)])
    assert first(out, "b").cached_tokens == 0
    quiet = EngineModel(W, PROFILE)
    assert quiet.reset_cache(0.0) == []


def test_same_inputs_give_identical_outputs() -> None:
    reqs = workload(50, seed=11)
    runs = []
    for _ in range(2):
        e = EngineModel(W, PROFILE, kv_blocks=200, emit_events=True)
        runs.append(drive(e, [replace(r) for r in reqs]))
    assert runs[0] == runs[1]


def test_load_figures_track_the_queue() -> None:
    e = EngineModel(W, PROFILE, kv_blocks=20)
    e.submit(req("a", 100, 150), 0.0)
    e.submit(req("b", 100, 10), 0.0)
    assert e.num_waiting == 2 and e.waiting_prompt_tokens == 200
    e.advance(0.0)
    assert e.num_running == 1 and e.num_waiting == 1
    assert e.kv_used_blocks == 16 and e.kv_capacity_blocks == 20
    assert e.prefill_tokens_remaining == 100


def test_submit_rejects_impossible_requests() -> None:
    e = EngineModel(W, PROFILE, kv_blocks=4)
    with pytest.raises(ValueError, match="exceed"):
        e.submit(req("a", 60, 10), 0.0)
    with pytest.raises(ValueError):
        e.submit(EngineRequest("b", (), 10, 0, 0.0), 0.0)
    with pytest.raises(ValueError):
        e.submit(EngineRequest("c", (BlockHash(1), BlockHash(2)), 20, 1, 0.0), 0.0)
