"""Time one ``Router.route`` call: the router's own overhead per request.

``route`` changes no state, so it is timed on the Router itself; the index is
filled through the :class:`~prefixrouter.core.dispatch.Dispatcher` (chains
placed as untrusted KV events: speculative entries, as routings leave).

Setup: 16 workers with mixed load, 100,000 blocks already in the index (50
long documents spread over the workers), then the median of ``--repeat``
``route`` calls, hashing included, for

* token mode: a 32,768-token prompt whose first 30,000 tokens are indexed on
  two workers (the matching walks ~1,900 blocks);
* text mode: a 131,072-character prompt, likewise mostly indexed.

Usage::

    python benchmarks/route_overhead.py [--json] [--repeat N]

``--json`` prints ``{"token_mode_ms": ..., "text_mode_ms": ..., ...}``.
Target (issue 2): at most 1 ms each on a 2-core machine.
"""

from __future__ import annotations

import argparse
import random
import time
from array import array
from dataclasses import replace

import orjson

from prefixrouter.core import (
    CacheNamespace,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.events import BlockStored
from prefixrouter.stats import percentile

WORKERS = 16
INDEXED_BLOCKS = 100_000


def _workers(rng: random.Random) -> list[WorkerView]:
    return [
        replace(
            WorkerView(WorkerId(f"w{i:02d}")),
            in_flight=rng.randrange(0, 20),
            pending_prefill_tokens=rng.randrange(0, 40_000),
            decoding=rng.randrange(0, 16),
            decode_tokens_remaining=rng.randrange(0, 8_000),
            context_tokens=rng.randrange(0, 200_000),
        )
        for i in range(WORKERS)
    ]


def _median_ms(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return percentile(times, 0.5) * 1e3


def _store(dispatch: Dispatcher, worker: str, hashes: object) -> None:
    """Place a chain on ``worker`` as speculative entries (an untrusted KV event)."""
    event = BlockStored(WorkerId(worker), hashes)  # type: ignore[arg-type]
    dispatch.apply_event(event, 0.0, trusted=False)


def _indexed(dispatch: Dispatcher) -> int:
    return sum(dispatch.index_blocks(WorkerId(f"w{w:02d}")) for w in range(WORKERS))


def _fill_index(dispatch: Dispatcher, make: object, count: int) -> None:
    """Place ``count`` distinct prompts from ``make(i)`` round the workers."""
    i = 0
    while _indexed(dispatch) < INDEXED_BLOCKS and i < count:
        req = make(i)  # type: ignore[operator]
        _store(dispatch, f"w{i % WORKERS:02d}", dispatch.hash(req).hashes)
        i += 1


def bench_token_mode(repeat: int) -> float:
    rng = random.Random(1)
    ns = CacheNamespace("llama-3-8b")
    router = Router()
    dispatch = Dispatcher(router, mode="token")
    docs = [array("I", (rng.randrange(128_000) for _ in range(32_768))) for _ in range(4)]

    def make(i: int) -> RoutingRequest:
        toks = docs[i % 4] if i < 4 else array("I", rng.choices(range(128_000), k=32_768))
        return RoutingRequest(RequestId(f"fill{i}"), ns, tokens=toks)

    _fill_index(dispatch, make, 200)
    doc = docs[1][:30_000]
    _store(dispatch, "w07", dispatch.hash(make(1)).hashes[:1875])
    prompt = doc + array("I", rng.choices(range(128_000), k=2_768))
    req = RoutingRequest(RequestId("q"), ns, tokens=prompt, max_tokens=256)
    ws = _workers(rng)
    decision = router.route(req, ws, 1.0)
    assert decision.predicted_cached_tokens >= 29_984, decision.reason
    return _median_ms(lambda: router.route(req, ws, 1.0), repeat)


def bench_text_mode(repeat: int) -> float:
    rng = random.Random(2)
    ns = CacheNamespace("llama-3-8b")
    router = Router()
    dispatch = Dispatcher(router, mode="text")
    letters = "abcdefghijklmnopqrstuvwxyz     \n"

    def text(n: int) -> str:
        return "".join(rng.choices(letters, k=n))

    docs = [text(131_072) for _ in range(4)]

    def make(i: int) -> RoutingRequest:
        body = docs[i % 4] if i < 4 else text(131_072)
        return RoutingRequest(RequestId(f"fill{i}"), ns, text=body)

    _fill_index(dispatch, make, 400)
    prompt = docs[1][:120_000] + text(11_072)
    req = RoutingRequest(RequestId("q"), ns, text=prompt, max_tokens=256)
    ws = _workers(rng)
    decision = router.route(req, ws, 1.0)
    assert decision.predicted_cached_tokens > 0, decision.reason
    return _median_ms(lambda: router.route(req, ws, 1.0), repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeat", type=int, default=500, help="route calls to time per mode")
    args = ap.parse_args()
    result = {
        "token_mode_ms": round(bench_token_mode(args.repeat), 4),
        "text_mode_ms": round(bench_text_mode(args.repeat), 4),
        "workers": WORKERS,
        "indexed_blocks": INDEXED_BLOCKS,
        "token_prompt_tokens": 32_768,
        "text_prompt_chars": 131_072,
    }
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
