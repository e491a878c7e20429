"""EngineRuntime: the engine model's timeline on the wall clock."""

from __future__ import annotations

import asyncio

import pytest

from prefixrouter.core.hashing import hash_token_blocks
from prefixrouter.core.types import WorkerId
from prefixrouter.sim.engine import Completed, EngineModel, FirstToken
from prefixrouter.sim.profiles import get_profile
from prefixrouter.simulated_engine.runtime import EngineRuntime

PROFILE = get_profile("tiny-cpu")


class Recorder:
    def __init__(self) -> None:
        self.first: list[tuple[FirstToken, bool]] = []
        self.done: list[tuple[Completed, bool]] = []

    def first_token(self, out: FirstToken, handle: object, wall: float) -> None:
        self.first.append((out, handle is not None))

    def completed(self, out: Completed, handle: object, wall: float) -> None:
        self.done.append((out, handle is not None))


def _runtime(scale: float, rec: Recorder | None = None) -> EngineRuntime:
    return EngineRuntime(EngineModel(WorkerId("w"), PROFILE), scale, rec)


def _hashes(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(hash_token_blocks(7, range(start, start + n), PROFILE.block_size))


async def test_wall_time_is_simulated_time_over_scale() -> None:
    rt = _runtime(4.0)
    handle = rt.submit(_hashes(1000), 1000, 8)  # type: ignore[arg-type]
    first = await handle.first
    done = await handle.done
    assert first.cached_tokens == 0 and done.output_tokens == 8
    wall_ttft = handle.first_at - handle.submitted
    # The engine prices this prefill at ~0.11 s; at 4x that is ~28 ms of wall time.
    sim_ttft = first.time - handle.arrival
    assert sim_ttft > 0.05
    assert sim_ttft / 4.0 * 0.95 <= wall_ttft <= sim_ttft / 4.0 + 0.05
    assert rt.in_flight == 0


async def test_repeat_hits_the_cache_and_concurrent_requests_resolve() -> None:
    rt = _runtime(20.0)
    h1 = rt.submit(_hashes(512), 512, 4)  # type: ignore[arg-type]
    await h1.done
    handles = [rt.submit(_hashes(512), 512, 4) for _ in range(3)]  # type: ignore[arg-type]
    firsts = await asyncio.gather(*(h.first for h in handles))
    await asyncio.gather(*(h.done for h in handles))
    # Last-token rule: 512 tokens reuse 31 blocks of 16, not 32.
    assert [f.cached_tokens for f in firsts] == [496, 496, 496]


async def test_cancel_forgets_the_request_and_the_engine_aborts_it() -> None:
    rec = Recorder()
    rt = _runtime(1.0, rec)  # slow: the abort lands in the first prefill step (~26 ms)
    handle = rt.submit(_hashes(300), 300, 20)  # type: ignore[arg-type]
    rt.cancel(handle.request_id)  # admitted by the cancel's advance; leaves at the step end
    assert rt.in_flight == 0
    other = rt.submit(_hashes(32, 9999), 32, 2)  # type: ignore[arg-type]
    await other.done
    assert rt.engine.aborted == 1 and rt.engine.num_running == 0
    assert rt.engine.kv_used_blocks == 0 and rt.engine.next_wakeup() is None
    assert not handle.first.done() and not handle.done.done()
    # Only the other request ever came out of the engine.
    assert [(o.request_id, wanted) for o, wanted in rec.first] == [(other.request_id, True)]
    assert [(o.request_id, wanted) for o, wanted in rec.done] == [(other.request_id, True)]


async def test_reset_cache_and_stop() -> None:
    rt = _runtime(50.0)
    await rt.submit(_hashes(256), 256, 2).done  # type: ignore[arg-type]
    rt.reset_cache()
    again = rt.submit(_hashes(256), 256, 2)  # type: ignore[arg-type]
    assert (await again.first).cached_tokens == 0
    pending = rt.submit(_hashes(256, 5000), 256, 50)  # type: ignore[arg-type]
    rt.stop()
    assert pending.done.cancelled()
    with pytest.raises(RuntimeError):
        rt.submit(_hashes(16), 16, 1)  # type: ignore[arg-type]


async def test_engine_rejects_what_never_fits() -> None:
    rt = _runtime(1.0)
    too_long = PROFILE.kv_blocks * PROFILE.block_size
    with pytest.raises(ValueError):
        rt.submit(_hashes(too_long), too_long, 16)  # type: ignore[arg-type]
    assert rt.in_flight == 0


def test_time_scale_must_be_positive() -> None:
    with pytest.raises(ValueError):
        _runtime(0.0)
