"""What pinning running requests' blocks in the index costs per request, side by side.

The index passes over the blocks of requests in flight when it evicts
(:meth:`~prefixrouter.core.index.PrefixIndex.pin`). A pin waits per chain and
is counted per block only when an eviction on its worker needs it, so a
request that ends before any eviction there costs two dict operations. This
times one request's whole bookkeeping through the
:class:`~prefixrouter.core.dispatch.Dispatcher` (``admit`` with hashing and
routing on 16 workers, ``first_token``, ``complete``), a document of
``--blocks`` blocks with a new question each time, in three variants
interleaved in one run:

* **shipped**: pins as the router takes them;
* **counted at once**: every pin counted per block when it is taken (as if
  every request met an eviction: the cost under cache pressure);
* **no pins**: ``pin``/``unpin`` do nothing (the index before pins).

Prints the median per request of each variant over ``--rounds`` rounds of
``--requests`` requests and the ratios to "no pins". Asserts nothing::

    python benchmarks/index_pins.py [--blocks 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from prefixrouter.core import (
    BlockHash,
    CacheNamespace,
    Outcome,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.dispatch import Dispatcher

NS = CacheNamespace("bench-model", "bench-tokenizer", "", "v1", "")
WORKERS = 16


def _variant(name: str) -> Dispatcher:
    d = Dispatcher(Router("prefix_aware"))
    index = d.router.index
    if name == "no pins":

        def nothing(worker: WorkerId, hashes: Sequence[BlockHash]) -> None:
            return None

        index.pin = nothing  # type: ignore[method-assign]
        index.unpin = nothing  # type: ignore[method-assign]
    elif name == "counted at once":
        pin = index.pin

        def counted(worker: WorkerId, hashes: Sequence[BlockHash]) -> None:
            pin(worker, hashes)
            index._count_pins(worker)

        index.pin = counted  # type: ignore[method-assign]
    return d


def _round(d: Dispatcher, doc: array[int], n: int, start: int) -> float:
    """Seconds per request of ``n`` requests about ``doc``, each with its own question."""
    ws = [WorkerView(WorkerId(f"w{i:02d}")) for i in range(WORKERS)]
    cached = len(doc)
    t0 = time.perf_counter()
    for i in range(start, start + n):
        prompt = array("I", doc)
        prompt.extend((i * 131 + j) % 50_000 for j in range(64))
        now = i * 0.01
        req = RoutingRequest(RequestId(f"r{i}"), NS, tokens=prompt, max_tokens=64)
        adm = d.admit(req, ws, now)
        d.first_token(adm, now + 0.001)
        d.complete(adm, Outcome(cached, 0.1), now + 0.002)
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2048, help="the document's 16-token blocks")
    ap.add_argument("--requests", type=int, default=200, help="requests per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    doc = array("I", ((7919 + i * 31) % 50_000 for i in range(16 * args.blocks)))
    names = ["shipped", "counted at once", "no pins"]
    dispatchers = {name: _variant(name) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}

    def step(name: str, r: int) -> float:
        return _round(dispatchers[name], doc, args.requests, r * args.requests)

    for name in names:  # warm-up: the document placed, caches of the process warm
        step(name, 0)
    for r in range(1, args.rounds + 1):
        for name in names:  # interleaved, so drift in the machine's speed hits all alike
            times[name].append(step(name, r))
    base = statistics.median(times["no pins"])
    table = Table(title=f"per-request bookkeeping, {args.blocks}-block document, {WORKERS} workers")
    for col in ("variant", "median ms", "x no pins"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name in names:
        med = statistics.median(times[name])
        table.add_row(name, f"{med * 1e3:.3f}", f"{med / base:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
