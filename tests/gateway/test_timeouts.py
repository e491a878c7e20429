"""First-byte and stall timeouts, suspect workers, and the index through an outage.

Fake vLLM engines on loopback (one event loop): an engine that goes silent
before its first byte, one that stalls mid-stream, one whose health fails
for a while, one that restarts (a new ``process_start_time_seconds``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from prefixrouter.core.types import EntrySource, WorkerId
from prefixrouter.gateway.workers import Worker
from prefixrouter.real_engines.kv_events import EventTranslator
from prefixrouter.real_engines.kv_subscriber import WorkerFeed
from tests.gateway.fakes import FakeEngine
from tests.gateway.helpers import Env, gateway_env, run

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~2,700 chars
FAST = {
    "proxy": {"first_byte_timeout_floor_s": 0.5, "stall_timeout_s": 0.5},
    "health": {"backoff_initial_s": 0.1, "backoff_max_s": 0.2, "timeout_s": 0.5},
    "metrics_poll": {"interval_s": 0.5},
}


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _worker(env: Env, wid: str) -> Worker:
    return env.state.registry.workers[WorkerId(wid)]


async def _warm(env: Env) -> str:
    """Send LONG once; returns the worker that now holds it."""
    r = await env.chat(LONG)
    assert r.status == 200
    await r.read()
    return r.headers["X-Prefixrouter-Worker"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_silent_worker_is_retried_elsewhere_and_marked_suspect(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with gateway_env(n=2, overrides=FAST) as env:
            warm = await _warm(env)
            engine = env.engines[int(warm[1])]
            # Frozen (a SIGSTOPped engine): accepts requests and health
            # checks, answers neither.
            engine.delay_s = engine.health_delay_s = 30.0
            t0 = time.monotonic()
            r = await env.chat(LONG + " again?", stream=stream)
            text = await r.text()
            took = time.monotonic() - t0
            assert r.status == 200 and '"error"' not in text
            assert r.headers["X-Prefixrouter-Worker"] != warm
            # The first-byte timeout, once the worker was silent for its
            # liveness window (a poll interval and a check), not the 30 s freeze.
            assert took < 5.0
            (log,) = [d for d in await env.decisions() if d["attempts"] == 2]
            assert log["retried_from"] == [warm]
            # Out of routing: marked suspect by the timeout, or down by the
            # failed health check that ended the benefit of the doubt, whichever came first.
            assert f"worker {warm} suspect" in caplog.text or f"worker {warm} unhealthy" in (
                caplog.text
            )
            await _until(lambda: engine.cancelled >= 1, "the engine request to be aborted")
            # Thawed: back in routing, its index kept through the freeze.
            engine.delay_s = engine.health_delay_s = 0.0
            w = _worker(env, warm)
            await _until(lambda: w.healthy and not w.suspect, "the worker back in routing")
            assert w.view.healthy and env.state.dispatch.index_blocks(w.id) > 0

    run(body)


def test_a_suspect_worker_whose_check_fails_is_marked_down_and_keeps_its_index() -> None:
    async def body() -> None:
        async with gateway_env(n=2, overrides=FAST) as env:
            warm = await _warm(env)
            engine = env.engines[int(warm[1])]
            w = _worker(env, warm)
            engine.delay_s = 30.0
            env.state.registry.mark_suspect(w, "sent no first byte")
            assert not w.view.healthy  # out of routing at once
            engine.healthy = False  # and the check the mark triggers fails
            await _until(lambda: not w.healthy, "the suspect worker to be marked down")
            assert env.state.dispatch.index_blocks(w.id) > 0
            r = await env.chat(LONG + " again?", stream=True)
            await r.read()
            assert r.headers["X-Prefixrouter-Worker"] != warm
            logs = await env.decisions()
            assert all(d["attempts"] == 1 for d in logs)  # never sent to the suspect worker

    run(body)


def test_a_stream_that_stalls_after_its_first_byte_ends_with_an_error_event() -> None:
    async def body() -> None:
        engines = [FakeEngine(hang_after_chunks=2)]
        async with gateway_env(engines=engines, overrides=FAST) as env:
            t0 = time.monotonic()
            r = await env.chat(LONG, stream=True, max_tokens=6)
            text = ""
            async for line in r.content:
                text += line.decode()
                if '"content"' in line.decode():
                    # The engine freezes as a whole: its health checks hang too.
                    engines[0].health_delay_s = 30.0
            # The stall timeout once the worker was silent for its liveness
            # window, not the hour the stream would hang.
            assert time.monotonic() - t0 < 5.0
            assert r.status == 200
            assert text.count('"content"') == 2  # what came before the stall
            last = text.strip().split("\n\n")[-1]
            assert last.startswith("data: {") and '"error"' in last and '"504"' in last
            assert "stalled" in last
            await _until(lambda: engines[0].cancelled == 1, "the engine request to be aborted")
            (log,) = await env.decisions()
            assert log["status"] == 504 and log["attempts"] == 1  # never retried

    run(body)


async def _down_then_up(env: Env, engine: FakeEngine, w: Worker) -> None:
    engine.healthy = False
    await _until(lambda: not w.healthy, "the worker to be marked down")
    engine.healthy = True
    await _until(lambda: w.healthy, "the worker to be healthy again")


def test_a_short_outage_keeps_the_index_and_a_restart_clears_it() -> None:
    async def body() -> None:
        engines = [FakeEngine(start_time=1000.0), FakeEngine(start_time=1000.0)]
        async with gateway_env(engines=engines, overrides=FAST) as env:
            warm = await _warm(env)
            engine, w = env.engines[int(warm[1])], _worker(env, warm)
            index = env.state.dispatch.router.index
            held = index.blocks_of(w.id)
            assert held > 0
            cost = env.state.dispatch.router.cost
            others = [x for x in env.state.registry.workers if x != w.id]
            # Its factor from before the outage, above the others' (which go on learning).
            for o in others:
                cost._scale[o] = 0.9
            cost._scale[w.id] = 2.0
            await _down_then_up(env, engine, w)
            # Back from the outage: a hair below the fleet's best factor until observed.
            assert cost.scale(w.id) < min(cost.scale(o) for o in others)
            # The same engine process came back: its entries were kept, speculative.
            assert index.blocks_of(w.id) == held
            entries = index.entries(w.id)
            assert entries and all(e.source is EntrySource.SPECULATIVE for _, e in entries)
            # A new process (another start time): its cache is empty, so are its entries.
            engine.start_time = 2000.0
            await _until(lambda: index.blocks_of(w.id) == 0, "the restart to clear the index")
            assert w.restarts == 1

    run(body)


def test_prefix_cache_counters_going_back_count_as_a_restart() -> None:
    async def body() -> None:
        async with gateway_env(n=2, overrides=FAST) as env:
            warm = await _warm(env)
            engine, w = env.engines[int(warm[1])], _worker(env, warm)
            index = env.state.dispatch.router.index
            await _until(lambda: (w.engine.prefix_queries or 0) > 0, "a scrape of the counters")
            assert index.blocks_of(w.id) > 0
            engine.queries = engine.hits = 0  # a new engine process counts from 0
            await _until(lambda: index.blocks_of(w.id) == 0, "the restart to clear the index")

    run(body)


def test_a_unary_request_without_max_tokens_has_no_first_byte_timeout() -> None:
    """Its answer comes whole at the end of an unbounded generation: nothing to predict."""

    async def body() -> None:
        engines = [FakeEngine(delay_s=1.2)]  # longer than the 0.5 s floor
        async with gateway_env(engines=engines, overrides=FAST) as env:
            r = await env.chat(LONG, max_tokens=None)
            assert r.status == 200
            await r.read()
            (log,) = await env.decisions()
            assert log["attempts"] == 1 and log["status"] == 200
            assert not _worker(env, "w0").suspect

    run(body)


def test_a_restart_the_kv_events_reported_first_keeps_what_they_stored_since() -> None:
    async def body() -> None:
        engines = [FakeEngine(start_time=1000.0)]
        async with gateway_env(engines=engines, overrides=FAST) as env:
            w = _worker(env, "w0")
            feed = WorkerFeed(w.id, "kv@w0", EventTranslator(w.id, lambda _a, _s: 1))
            w.feed = feed
            await _warm(env)
            await _until(lambda: w.engine.start_time == 1000.0, "a scrape")
            # The new process's first events arrive before the next scrape: the
            # feed saw the sequence reset and cleared the worker itself; these
            # entries are the new process's own.
            feed.stats.restarts += 1
            held = env.state.dispatch.index_blocks(w.id)
            engines[0].start_time = 2000.0
            await _until(lambda: w.restarts == 1, "the scrape to see the new process")
            assert env.state.dispatch.index_blocks(w.id) == held
            engines[0].start_time = 3000.0  # another restart, the feed silent this time
            await _until(lambda: w.restarts == 2, "the scrape to see the new process")
            assert env.state.dispatch.index_blocks(w.id) == 0

    run(body)


def test_a_check_sent_before_the_worker_went_silent_does_not_clear_it() -> None:
    async def body() -> None:
        engines = [FakeEngine(health_delay_s=0.3), FakeEngine()]
        async with gateway_env(engines=engines, overrides=FAST) as env:
            reg, w = env.state.registry, _worker(env, "w0")
            early = asyncio.create_task(reg.check(w))  # in flight: answered in 0.3 s
            await asyncio.sleep(0.1)
            reg.mark_suspect(w, "sent no first byte")
            assert await early  # it passed...
            assert w.suspect and not w.view.healthy  # ...but it predates the silence
            await _until(lambda: not w.suspect, "the check the mark asked for")
            assert w.healthy and w.view.healthy

    run(body)


@pytest.mark.parametrize("stream", [True, False])
def test_every_worker_timing_out_is_a_504_not_a_502(stream: bool) -> None:
    """The gateway gave up waiting (a gateway timeout), not a worker it could
    not reach: every attempt timed out, so the client gets 504
    ``upstream_timeout`` naming each attempt, and the decision log says 504."""

    async def body() -> None:
        async with gateway_env(n=2, overrides=FAST) as env:
            for engine in env.engines:  # both frozen: accept, never answer
                engine.delay_s = engine.health_delay_s = 30.0
            t0 = time.monotonic()
            r = await env.chat(LONG, stream=stream)
            err = (await r.json())["error"]
            assert time.monotonic() - t0 < 10.0  # the first-byte timeouts, not the freeze
            assert r.status == 504 and err["code"] == "upstream_timeout"
            assert err["type"] == "upstream_error" and "FirstByteTimeout" in err["message"]
            (log,) = await env.decisions()
            assert log["status"] == 504 and log["attempts"] >= 1

    run(body)


def test_a_stream_whose_connection_breaks_takes_its_worker_out_until_a_check_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A killed engine breaks every stream it held: its worker leaves routing then, not
    when the next request routed there is refused, and returns when a check passes."""

    async def body() -> None:
        engines = [FakeEngine(die_after_chunks=2), FakeEngine()]
        async with gateway_env(engines=engines, overrides=FAST) as env:
            registry = env.state.registry
            registry.workers[WorkerId("w1")].draining = True
            registry._rebuild()
            # The engine dies mid-answer; its health check hangs from now on.
            engines[0].health_delay_s = 30.0
            r = await env.chat(LONG, stream=True, max_tokens=6)
            text = await r.text()
            assert text.count('"content"') == 2 and '"error"' in text
            w0 = _worker(env, "w0")
            # The mark comes as the gateway settles the request (the client may
            # read the end of the stream first).
            await _until(lambda: w0.suspect, "w0 marked suspect", timeout_s=2.0)
            assert not w0.view.healthy and "worker w0 suspect" in caplog.text
            registry.workers[WorkerId("w1")].draining = False
            registry._rebuild()
            # w0 holds the prompt's prefix, but it is out of routing: the next
            # request goes to w1 at its first attempt.
            again = await env.chat(LONG + " again?", stream=True, max_tokens=6)
            await again.read()
            assert again.headers["X-Prefixrouter-Worker"] == "w1"
            assert all(d["attempts"] == 1 for d in await env.decisions())
            # Alive after all (the connection broke, the engine did not): back.
            engines[0].health_delay_s = 0.0
            await _until(lambda: w0.healthy and not w0.suspect, "w0 back in routing")
            assert w0.view.healthy

    run(body)
