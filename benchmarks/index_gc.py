"""The index under Python's cyclic garbage collector: full-collection pauses and routing cost.

A full collection walks every object the collector tracks. Builds a
:class:`~prefixrouter.core.index.PrefixIndex` of ``--entries`` entries on
``--workers`` workers (chains of ``--chain`` blocks; every other chain
confirmed, the rest speculative, as a busy router holds them), then measures,
with the collector on as in the gateway:

* **objects tracked** by the collector, and the **full-collection pause**
  (``gc.collect()``, best of 3);
* **routing a new long prompt**: ``on_routed`` of a ``--chain``-block chain
  no worker holds, on the full index (capacity evicts as much), and for
  every other one the engine's answer (``on_completed``, which confirms it),
  p50/p99/max of ``--routes`` such requests (expiry-heap rebuilds and the
  collections their allocations trigger included; the full collections
  are also counted and timed);
* the process's peak RSS.

``--against OTHER/src`` runs the same measurement, side by side in this run,
with another checkout's code (a subprocess with that ``PYTHONPATH``) and
prints both and the ratio. Issue 12 item 4 (``/health`` p99 while large
bodies arrive) was measured with it::

    python benchmarks/index_gc.py --against OLD/src

Asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from prefixrouter.core import BlockHash, IndexParams, PrefixIndex, WorkerId
from prefixrouter.stats import percentile


def measure(entries: int, workers: int, chain: int, routes: int) -> dict[str, Any]:
    """Build the index, then time full collections and new-chain routings."""
    ids = [WorkerId(f"w{i}") for i in range(workers)]
    per_worker = entries // workers
    idx = PrefixIndex(IndexParams(default_capacity_blocks=per_worker, max_entries=entries))
    next_hash = 1
    t = 0.0
    for n in range(entries // chain):
        hashes = [BlockHash(h) for h in range(next_hash, next_hash + chain)]
        next_hash += chain
        w = ids[n % workers]
        idx.on_routed(w, hashes, t)
        if n % 2 == 0:
            idx.on_completed(w, hashes, 16.0, 0, 0, t)
        t += 0.001
    pauses = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - start)
    tracked = len(gc.get_objects())
    full_runs: list[float] = []
    started: list[float] = []

    def timer(phase: str, info: dict[str, int]) -> None:  # times the full collections
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            else:
                full_runs.append(time.perf_counter() - started.pop())

    gc.callbacks.append(timer)
    route_s = []
    for n in range(routes):
        hashes = [BlockHash(h) for h in range(next_hash, next_hash + chain)]
        next_hash += chain
        w = ids[n % workers]
        start = time.perf_counter()
        idx.on_routed(w, hashes, t)
        if n % 2 == 0:  # confirmed, as in the build: dead expiry items pile up
            idx.on_completed(w, hashes, 16.0, 0, 0, t)
        route_s.append(time.perf_counter() - start)
        t += 0.001
    gc.callbacks.remove(timer)
    return {
        "entries": len(idx),
        "tracked_objects": tracked,
        "full_gc_ms": min(pauses) * 1e3,
        "route_p50_ms": percentile(route_s, 0.50) * 1e3,
        "route_p99_ms": percentile(route_s, 0.99) * 1e3,
        "route_max_ms": max(route_s) * 1e3,
        "full_gcs_while_routing": len(full_runs),
        "their_ms_total": sum(full_runs) * 1e3,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _run_with(src: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": src}
    argv = [sys.executable, __file__, "--json", *_own_args(args)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _own_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--entries={args.entries}",
        f"--workers={args.workers}",
        f"--chain={args.chain}",
        f"--routes={args.routes}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--entries", type=int, default=1_600_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--chain", type=int, default=8192, help="blocks per prompt")
    ap.add_argument("--routes", type=int, default=60, help="new long prompts routed")
    ap.add_argument("--against", metavar="SRC", help="another checkout's src, run side by side")
    ap.add_argument("--json", action="store_true", help="print this tree's figures as JSON only")
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.entries, args.workers, args.chain, args.routes)))
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    rows = {"this tree": _run_with(os.path.normpath(here), args)}
    if args.against:
        rows["--against"] = _run_with(args.against, args)
    keys = list(next(iter(rows.values())))
    ratio = "   ratio" if args.against else ""
    print(f"{'':22}" + "".join(f"{name:>14}" for name in rows) + ratio)
    for key in keys:
        values = [rows[name][key] for name in rows]
        line = f"{key:22}" + "".join(f"{v:>14,.1f}" for v in values)
        if args.against and values[0]:
            line += f"   {values[1] / values[0]:6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
