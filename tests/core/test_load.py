from __future__ import annotations

import pytest

from prefixrouter.core import InflightLedger, RequestId, WorkerId, WorkerView

A, B = WorkerId("a"), WorkerId("b")


def test_ledger_tracks_prefill_then_decode_then_release() -> None:
    led = InflightLedger()
    led.on_routed(RequestId("r1"), A, uncached_tokens=900, prompt_tokens=1000, output_tokens=50)
    led.on_routed(RequestId("r2"), A, uncached_tokens=100, prompt_tokens=1000, output_tokens=20)
    v = led.fill(WorkerView(A))
    assert (v.in_flight, v.pending_prefill_tokens, v.decoding) == (2, 1000, 0)
    led.on_first_token(RequestId("r1"))
    led.on_first_token(RequestId("r1"))  # repeated: counted once
    v = led.fill(WorkerView(A))
    assert (v.pending_prefill_tokens, v.decoding, v.decode_tokens_remaining) == (100, 1, 50)
    assert v.context_tokens == 1000
    led.on_completed(RequestId("r1"))
    led.on_completed(RequestId("r2"))  # failed before its first token
    led.on_completed(RequestId("r2"))  # and reported twice: ignored
    v = led.fill(WorkerView(A))
    assert (v.in_flight, v.pending_prefill_tokens, v.decoding, v.context_tokens) == (0, 0, 0, 0)


def test_duplicate_routing_is_refused() -> None:
    led = InflightLedger()
    led.on_routed(RequestId("r"), A, 1, 1, 1)
    with pytest.raises(ValueError, match="already in flight"):
        led.on_routed(RequestId("r"), B, 1, 1, 1)


def test_drop_worker_returns_its_requests() -> None:
    led = InflightLedger()
    led.on_routed(RequestId("r2"), A, 1, 1, 1)
    led.on_routed(RequestId("r1"), A, 1, 1, 1)
    led.on_routed(RequestId("r3"), B, 1, 1, 1)
    assert led.drop_worker(A) == ["r1", "r2"]
    assert led.worker_of(RequestId("r1")) is None and led.worker_of(RequestId("r3")) == B
