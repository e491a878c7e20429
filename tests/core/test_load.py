from __future__ import annotations

import pytest

from prefixrouter.core import InflightLedger, RequestId, WorkerId, WorkerView

A, B = WorkerId("a"), WorkerId("b")


def test_ledger_tracks_prefill_then_decode_then_release() -> None:
    led = InflightLedger()
    led.on_routed(
        RequestId("r1"), A, uncached_tokens=900, prompt_tokens=1000, output_tokens=50, now=0.0
    )
    led.on_routed(
        RequestId("r2"), A, uncached_tokens=100, prompt_tokens=1000, output_tokens=20, now=0.1
    )
    v = led.fill(WorkerView(A), 0.2)
    assert (v.in_flight, v.pending_prefill_tokens, v.decoding) == (2, 1000, 0)
    led.on_first_token(RequestId("r1"), 0.2)
    led.on_first_token(RequestId("r1"), 0.2)  # repeated: counted once
    v = led.fill(WorkerView(A), 0.2)
    assert (v.pending_prefill_tokens, v.decoding, v.decode_tokens_remaining) == (100, 1, 50)
    assert v.context_tokens == 1000
    # What r1's end frees: it prefilled 900 of its 1,000 tokens itself, so
    # its prompt is how a prefix entered the cache (readers may share it):
    # its answer only.
    assert v.decoding_own_tokens == 50
    led.on_first_token(RequestId("r2"), 0.3)
    v = led.fill(WorkerView(A), 0.3)
    # r2 reused 900 cached tokens: its uncached tail and its answer are its own.
    assert v.decoding_own_tokens == 50 + 100 + 20
    led.on_completed(RequestId("r1"))
    v = led.fill(WorkerView(A), 0.3)
    assert v.decoding_own_tokens == 100 + 20
    led.on_completed(RequestId("r2"))  # and reported twice: ignored
    v = led.fill(WorkerView(A), 0.2)
    assert (v.in_flight, v.pending_prefill_tokens, v.decoding, v.context_tokens) == (0, 0, 0, 0)
    assert v.decoding_own_tokens == 0


def test_duplicate_routing_is_refused() -> None:
    led = InflightLedger()
    led.on_routed(RequestId("r"), A, 1, 1, 1, 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        led.on_routed(RequestId("r"), B, 1, 1, 1, 0.0)


def test_drop_worker_returns_its_requests() -> None:
    led = InflightLedger()
    led.on_routed(RequestId("r2"), A, 1, 1, 1, 0.0)
    led.on_routed(RequestId("r1"), A, 1, 1, 1, 0.0)
    led.on_routed(RequestId("r3"), B, 1, 1, 1, 0.0)
    assert led.drop_worker(A) == ["r1", "r2"]
    assert led.worker_of(RequestId("r1")) is None and led.worker_of(RequestId("r3")) == B


def test_the_ledger_times_the_prefill_in_progress_from_its_start() -> None:
    """Elapsed time on the head of the prefill queue: from the routing that found
    nothing pending, then from each first token that ends a prefill (a fully
    cached request's first token is not the end of one); 0 when nothing is pending."""
    led = InflightLedger()
    led.on_routed(
        RequestId("r1"), A, uncached_tokens=900, prompt_tokens=1000, output_tokens=5, now=1.0
    )
    led.on_routed(
        RequestId("r2"), A, uncached_tokens=0, prompt_tokens=1000, output_tokens=5, now=1.2
    )
    led.on_routed(
        RequestId("r3"), A, uncached_tokens=300, prompt_tokens=1000, output_tokens=5, now=1.3
    )
    assert led.fill(WorkerView(A), 1.5).prefill_elapsed_s == pytest.approx(0.5)  # r1 since 1.0
    led.on_first_token(RequestId("r2"), 1.6)  # cached: r1 is still the head
    assert led.fill(WorkerView(A), 1.7).prefill_elapsed_s == pytest.approx(0.7)
    led.on_first_token(RequestId("r1"), 1.8)  # r1 done: r3 is the head from now
    assert led.fill(WorkerView(A), 2.0).prefill_elapsed_s == pytest.approx(0.2)
    led.on_first_token(RequestId("r3"), 2.1)
    assert led.fill(WorkerView(A), 3.0).prefill_elapsed_s == 0.0  # nothing pending
    led.on_routed(
        RequestId("r4"), A, uncached_tokens=50, prompt_tokens=60, output_tokens=5, now=3.0
    )
    assert led.fill(WorkerView(A), 3.25).prefill_elapsed_s == pytest.approx(0.25)
    assert led.fill(WorkerView(B), 3.25).prefill_elapsed_s == 0.0


def test_time_since_routed_counts_from_the_last_request_sent() -> None:
    led = InflightLedger()
    assert led.fill(WorkerView(A), 5.0).since_routed_s == float("inf")  # never sent one
    led.on_routed(RequestId("r1"), A, uncached_tokens=9, prompt_tokens=9, output_tokens=5, now=1.0)
    assert led.fill(WorkerView(A), 1.5).since_routed_s == pytest.approx(0.5)
    led.on_routed(RequestId("r2"), A, uncached_tokens=9, prompt_tokens=9, output_tokens=5, now=2.0)
    # First tokens and completions are not sendings: the count stays from r2.
    led.on_first_token(RequestId("r1"), 2.1)
    led.on_completed(RequestId("r1"))
    assert led.fill(WorkerView(A), 2.5).since_routed_s == pytest.approx(0.5)
    assert led.fill(WorkerView(A), 1.9).since_routed_s == 0.0  # a clock behind: never negative
    assert led.fill(WorkerView(B), 2.5).since_routed_s == float("inf")
