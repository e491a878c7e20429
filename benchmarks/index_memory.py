"""Router memory under a stream of unique prompts: flat, or growing with rate x TTL?

Drives the real :class:`~prefixrouter.core.router.Router` through the
:class:`~prefixrouter.core.dispatch.Dispatcher`, as the gateway does, without
HTTP: text mode (the gateway's default), worker views filled from the
dispatcher's in-flight ledger, ``admit``, and after ``--service-s`` of virtual
time the engine's report (``complete`` with 0 cached tokens, which confirms
the prompt's blocks, and the token estimator taught as ``Proxy._finish``
does). Every prompt is unique (16 KiB by default:
64 index blocks) and arrives at ``--rate`` per second on a virtual clock, with
the default speculative TTL of 120 s. With ``--reject-every K`` every K-th
request is answered 400 instead (``Dispatcher.reject``).

Every ``--every`` prompts it records the process RSS (after ``gc.collect()``)
and the sizes of the structures that could grow: index entries, live
speculative entries, expiry-heap items (``heap``), demand-table prefixes
(``demand``). The index
mirrors ``--workers x --capacity-blocks`` blocks; what it holds is bounded by
that, so memory should be flat once the caches are full. It prints a table and
the ratio of the highest to the lowest RSS from the first checkpoint on
(target, issue 12 item 7: within 1.10 from 50k to 500k prompts). It asserts
nothing.

Usage::

    python benchmarks/index_memory.py [--prompts N] [--every N] [--rate R]
        [--workers N] [--capacity-blocks N] [--prompt-chars N] [--service-s S]
        [--reject-every K] [--json] [--plot PNG]

The default (100,000 prompts, a checkpoint every 10,000) takes a minute or
two. The issue's measurement, 50k to 500k prompts (357 s of virtual time)::

    python benchmarks/index_memory.py --prompts 500000 --every 50000

Before/after: run the same script with ``PYTHONPATH`` pointing at the other
checkout's ``src``. Measured so (issue 12; ``results/index_memory_*.json``,
4 workers x 8,000 blocks): before, RSS 857 MB at 50k prompts and 2,547 MB
from 200k on (max/min 2.97), with 10.75 million expiry-heap items and the
demand table at its 100,000 cap; after, 75.7 to 78.7 MB (1.04), at most
31,000 heap items and 10,400 demand prefixes, while the index holds 32,000
entries. RSS is read from
``/proc/self/statm`` (Linux); elsewhere the peak RSS is reported instead.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import sys
import time
from collections import deque
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prefixrouter.core import (
    CacheNamespace,
    Outcome,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
)
from prefixrouter.core.dispatch import Admission, Dispatcher


def rss_bytes() -> int:
    """Resident set size now (Linux), else the peak so far."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def sizes(router: Router) -> dict[str, int]:
    """The sizes of the router's growing structures.

    A diagnostic of the core's private structures (the expiry heap, the
    policy's demand table): it reads them where no view exposes them.
    """
    index = router.index
    demand = getattr(router.policy, "_demand", {})
    return {
        "entries": len(index),
        "speculative": index.speculative_entries,
        "heap": len(index._expiry),
        "demand": len(demand),
    }


def run(args: argparse.Namespace, on_step: Any = None) -> list[dict[str, Any]]:
    """Route ``args.prompts`` unique prompts; one record per checkpoint."""
    router = Router()
    dispatch = Dispatcher(router, mode="text")
    ns = CacheNamespace("llama-3-8b")
    workers = [WorkerId(f"w{i:02d}") for i in range(args.workers)]
    # The index mirrors --capacity-blocks index blocks per worker: the engine's
    # KV size that the dispatcher's one formula turns into that many.
    engine_blocks = math.ceil(args.capacity_blocks * dispatch.index_block_tokens() / 16)
    views = [
        WorkerView(w, max_slots=256, kv_capacity_blocks=engine_blocks, block_size=16)
        for w in workers
    ]
    dispatch.mirror_capacity(views)
    filler = ("The quick brown fox jumps over the lazy dog, again and again. " * 300)[
        : args.prompt_chars
    ]
    pending: deque[tuple[float, Admission]] = deque()  # completions, in time order
    records: list[dict[str, Any]] = []
    t_wall = time.perf_counter()

    def complete_until(now: float) -> None:
        while pending and pending[0][0] <= now:
            t, admission = pending.popleft()
            dispatch.first_token(admission, t)
            dispatch.complete(admission, Outcome(0, 0.2, True), t)
            dispatch.observe_prompt_tokens(args.prompt_chars, admission.decision.prompt_tokens)

    for i in range(args.prompts):
        now = i / args.rate
        complete_until(now)
        text = f"{i:012d}" + filler[12:]  # unique from its first block on
        req = RoutingRequest(RequestId(f"r{i}"), ns, text=text, max_tokens=128)
        for v in views:
            dispatch.fill(v, now)
        admission = dispatch.admit(req, views, now)
        if args.reject_every and i % args.reject_every == args.reject_every - 1:
            dispatch.reject(admission, now)  # answered 400 at once
        else:
            pending.append((now + args.service_s, admission))
        done = i + 1
        if done % args.every == 0 or done == args.prompts:
            gc.collect()
            rec = {
                "prompts": done,
                "virtual_s": round(now, 1),
                "rss_mb": round(rss_bytes() / 2**20, 1),
                **sizes(router),
                "wall_s": round(time.perf_counter() - t_wall, 1),
            }
            records.append(rec)
        if on_step is not None and done % 1000 == 0:
            on_step(1000)
    return records


def plot(records: list[dict[str, Any]], path: str) -> None:
    """RSS and structure sizes against prompts routed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompts"] for r in records]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["rss_mb"] for r in records], marker="o")
    a.set(xlabel="unique prompts routed", ylabel="RSS (MiB)", title="process RSS")
    a.set_ylim(bottom=0)
    for key in ("entries", "speculative", "heap", "demand"):
        b.plot(x, [r[key] for r in records], marker=".", label=key)
    b.set(xlabel="unique prompts routed", ylabel="items", title="router structures")
    b.set_yscale("log")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=10_000, help="checkpoint interval (prompts)")
    ap.add_argument("--rate", type=float, default=1400.0, help="arrivals per virtual second")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--capacity-blocks", type=int, default=8000, help="index blocks per worker")
    ap.add_argument("--prompt-chars", type=int, default=16_384)
    ap.add_argument("--service-s", type=float, default=0.5, help="routing to completion")
    ap.add_argument("--reject-every", type=int, default=0, help="every K-th request gets a 400")
    ap.add_argument("--json", action="store_true", help="print the records as JSON only")
    ap.add_argument("--plot", metavar="PNG", help="write a plot of RSS and sizes")
    args = ap.parse_args()

    console = Console(stderr=True)
    with Progress(
        TextColumn("routing unique prompts"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("route", total=args.prompts)
        records = run(args, lambda n: progress.advance(task, n))
    rss = [r["rss_mb"] for r in records]
    ratio = max(rss) / min(rss)
    if args.plot:
        plot(records, args.plot)
    if args.json:
        print(orjson.dumps({"records": records, "rss_max_over_min": round(ratio, 3)}).decode())
        return
    table = Table(title=f"{args.prompt_chars}-char unique prompts at {args.rate:g}/s, TTL 120 s")
    for key in records[0]:
        table.add_column(key, justify="right")
    for r in records:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in r.values()))
    out = Console(width=120)
    out.print(table)
    out.print(
        f"RSS max/min from {records[0]['prompts']:,} to {records[-1]['prompts']:,} prompts: "
        f"{ratio:.3f} (target <= 1.10)"
    )


if __name__ == "__main__":
    main()
