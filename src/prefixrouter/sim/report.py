"""Summaries of simulation runs: the per-policy figures of the JSON report.

For each run (one policy on one workload and fleet):

* ``ttft_ms``, ``e2e_ms``, ``queue_wait_ms``: mean, p50, p90, p99 over completed
  requests (:func:`prefixrouter.stats.percentiles`: nearest rank, so figures
  are values that occurred);
* ``throughput_rps`` and ``output_tokens_per_s``: completed requests and
  generated tokens over the span from the first arrival to the last completion;
* ``prompt_tokens``, ``cached_tokens``, ``prefill_tokens`` (= prompt - cached);
* ``warm_ups`` and ``warm_up_prefill_tokens`` (runs whose router made
  prefill-only copies of its own, ``proactive_copy``, only): the copies sent
  and the prefill the engines spent on them, which is not in any request's
  figures; :func:`total_prefill_tokens` adds it back;
* ``evictions``: prefix-cache blocks the engines evicted, and
  ``eviction_mean_age_s`` how long they had been unused;
* ``kv_wait_ms_total``: time requests waited for KV memory before admission;
* ``load_imbalance``: max over mean of per-worker busy time (1 = perfectly even);
* ``warm_abandoned``: requests that left a warm worker because its wait made it too slow;
* ``replicas`` (runs with several router replicas only): per replica, the
  requests it admitted, their cached share (cached over prompt tokens) and
  their TTFT mean and p99; the figures above are the pooled ones.

:func:`lower_bound_prefill_tokens` is the bound no router can beat: every
request must prefill at least the tokens after the longest prefix that *some*
earlier request already had (whole blocks, and the engine always recomputes
the last prompt token), i.e. what one infinite cache shared by all would do.
:func:`ttft_floor` is its counterpart for time to first token (the report's
``ttft_floor_ms``): each request's prefill on an idle engine, reusing any
prefix an earlier request brought, once that prefix can have been computed.
How far a policy's TTFT is above it is what routing and queueing cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.types import BlockHash, SpeedProfile
from prefixrouter.sim.cluster import RequestRecord, SimRun
from prefixrouter.sim.workload import Workload
from prefixrouter.stats import percentiles


def reusable_tokens(prompt_tokens: int, blocks: int, block_size: int) -> int:
    """Tokens an engine can serve from cache when ``blocks`` leading blocks are held."""
    cap = ((prompt_tokens - 1) // block_size) * block_size if prompt_tokens > 0 else 0
    return min(blocks * block_size, cap)


Origin = tuple[float, int]
"""Where a block was first seen: that request's arrival and the blocks it reused."""


@dataclass(frozen=True, slots=True)
class FirstSeen:
    """What one unlimited cache shared by every request holds when each arrives.

    The one pass that hashes every prompt; the prefill bound, the TTFT floor
    and the fleet's capacity (:func:`~prefixrouter.sim.runner.capacity_rps`)
    all read it, so a run hashes its prompts once. It depends on the requests'
    order and prompts only, not on their times: one scan serves a workload and
    its rescaled copies (:meth:`~prefixrouter.sim.workload.Workload.scaled`),
    whose times are read when the floor is computed.

    Attributes:
        request_ids: The requests scanned, in order (a scan is refused for
            another workload).
        reused: Per request, the leading blocks that some earlier request
            brought and an engine reuses (:func:`reusable_tokens`: it always
            recomputes the last prompt token, so the last block may be held and
            still not reused). Its prefill is the rest of the prompt.
        runs: Per request, its reused blocks as runs of one origin: ``(end,
            q)``, blocks up to depth ``end`` first seen with request ``q`` (an
            index), which is the origin ``(arrival of q, reused[q])``.
    """

    request_ids: tuple[str, ...]
    reused: tuple[int, ...]
    runs: tuple[tuple[tuple[int, int], ...], ...]

    def check(self, workload: Workload) -> None:
        """Refuse a scan of other requests than ``workload``'s.

        Raises:
            ValueError: Another request list.
        """
        if len(self.request_ids) != len(workload.requests) or any(
            a != b.request_id for a, b in zip(self.request_ids, workload.requests, strict=True)
        ):
            raise ValueError(f"workload {workload.name}: the first-seen scan is of other requests")


def first_seen(workload: Workload, on_progress: Callable[[int], None] | None = None) -> FirstSeen:
    """Scan ``workload`` with one unlimited cache shared by all (see :class:`FirstSeen`).

    Block hashes are chained, so once one is new, every later one is too: a
    request's known blocks are a leading run. ``on_progress(done)`` is called
    after each request (it hashes the whole prompt: the slow part of the scan).
    """
    hasher = BlockHasher(block_size=workload.block_size)
    bs = workload.block_size
    first: dict[BlockHash, int] = {}  # block -> the request that brought it
    reused_of: list[int] = []
    runs_of: list[tuple[tuple[int, int], ...]] = []
    for i, req in enumerate(workload.requests):
        hashes = hasher.token_blocks(req.namespace.seed, req.tokens()).hashes
        held = 0
        origins: list[int] = []
        for h in hashes:
            q = first.get(h)
            if q is None:
                break
            origins.append(q)
            held += 1
        reused = reusable_tokens(req.prompt_tokens, held, bs) // bs
        runs: list[tuple[int, int]] = []
        for depth, q in enumerate(origins[:reused], start=1):
            if runs and runs[-1][1] == q:
                runs[-1] = (depth, q)
            else:
                runs.append((depth, q))
        reused_of.append(reused)
        runs_of.append(tuple(runs))
        for h in hashes[held:]:
            first[h] = i
        if on_progress is not None:
            on_progress(i + 1)
    return FirstSeen(
        tuple(r.request_id for r in workload.requests),
        tuple(reused_of),
        tuple(runs_of),
    )


def first_seen_prefill(workload: Workload, seen: FirstSeen | None = None) -> list[int]:
    """Per request, the tokens it must prefill with one unlimited shared cache.

    ``seen``: the workload's scan, if the caller has it (None: scanned here).
    """
    seen = _scan(workload, seen)
    bs = workload.block_size
    # reusable_tokens is whole blocks, so the reused tokens are reused * bs.
    return [
        req.prompt_tokens - reused * bs
        for req, reused in zip(workload.requests, seen.reused, strict=True)
    ]


def lower_bound_prefill_tokens(workload: Workload, seen: FirstSeen | None = None) -> int:
    """Prefill tokens with one unlimited cache shared by every request (see module doc)."""
    return sum(first_seen_prefill(workload, seen))


def ttft_floor(
    workload: Workload, speed: SpeedProfile, seen: FirstSeen | None = None
) -> list[float]:
    """Per request, a time to first token (seconds) that no router can beat on ``speed``.

    An infinite fleet that never queues and one infinite cache shared by all:
    a request's first token comes at the end of its prefill, and it may reuse
    any prefix some earlier request brought, but not before that prefix is
    computed. A block first seen with request ``q``, which itself reused ``a``
    blocks, is computed no sooner than ``t_q`` plus the prefill of the blocks
    from ``a`` to it (a prefix's KV is computed in order, and nobody has those
    blocks before ``q`` arrives). Reusing ``d`` blocks of that run therefore
    gives at best::

        max(0, t_q + prefill((d - a) * B, a * B) - overhead - t_r)
            + prefill(prompt_r - d * B, d * B)

    The profile's prefill is additive in the tokens (splitting a prefill in
    two costs one more fixed overhead, nothing else), so within a run the sum
    falls with ``d`` while the wait is zero and stays level once it is not:
    each run's deepest reusable block is its best choice, and the floor is
    the least of those and of prefilling the whole prompt. (The overhead is
    taken off the wait because an engine step pays one overhead for all the
    chunks it prefills.) Queues, decode steps and the engines' number are
    ignored: this is a floor, reached only by a fleet as large as the load.

    ``seen``: the workload's scan, if the caller has it (None: scanned here).
    """
    seen = _scan(workload, seen)
    bs = workload.block_size
    prefill = speed.prefill_time
    overhead = speed.prefill_overhead_s
    reqs = workload.requests
    out: list[float] = []
    for req, runs in zip(reqs, seen.runs, strict=True):
        prompt, t_r = req.prompt_tokens, req.arrival
        best = prefill(prompt, 0)
        # Each run of blocks one earlier request brought, at its deepest block.
        for depth, q in runs:
            run = (reqs[q].arrival, seen.reused[q])
            best = min(best, _reuse_floor(prefill, overhead, prompt, t_r, run, depth, bs))
        out.append(best)
    return out


def ttft_floor_ms(
    workload: Workload, speed: SpeedProfile, seen: FirstSeen | None = None
) -> dict[str, float]:
    """The report's ``ttft_floor_ms``: mean and percentiles of :func:`ttft_floor`."""
    return percentiles(t * 1e3 for t in ttft_floor(workload, speed, seen))


def _scan(workload: Workload, seen: FirstSeen | None) -> FirstSeen:
    """``seen``, checked against ``workload``, or a new scan of it."""
    if seen is None:
        return first_seen(workload)
    seen.check(workload)
    return seen


def _reuse_floor(
    prefill: Callable[[float, float], float],
    overhead: float,
    prompt: int,
    arrival: float,
    run: Origin,
    depth: int,
    block_size: int,
) -> float:
    """:func:`ttft_floor`'s bound for reusing ``depth`` blocks, the last from ``run``."""
    t_q, a = run
    ready = t_q + prefill((depth - a) * block_size, a * block_size) - overhead
    reused = depth * block_size
    return max(0.0, ready - arrival) + prefill(prompt - reused, reused)


def summarize(run: SimRun) -> dict[str, Any]:
    """The JSON figures of one run (see the module docstring)."""
    done = [r for r in run.records if r.completed >= 0]
    ttft = [r.ttft_s * 1e3 for r in done]
    e2e = [r.e2e_s * 1e3 for r in done]
    wait = [r.queue_wait_s * 1e3 for r in done]
    start = min((r.arrival for r in run.records), default=0.0)
    end = max((r.completed for r in done), default=start)
    span = max(end - start, 1e-9)
    prompt = sum(r.prompt_tokens for r in run.records)
    cached = sum(r.cached_tokens for r in done)
    busy = [w.busy_time_s for w in run.workers]
    mean_busy = math.fsum(busy) / len(busy) if busy else 0.0
    out: dict[str, Any] = {
        "policy": run.policy,
        "requests": len(run.records),
        "completed": len(done),
        "ttft_ms": percentiles(ttft),
        "e2e_ms": percentiles(e2e),
        "queue_wait_ms": percentiles(wait),
        "throughput_rps": round(len(done) / span, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in done) / span, 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "evictions": sum(w.evictions for w in run.workers),
        "eviction_mean_age_s": round(
            math.fsum(w.eviction_mean_age_s * w.evictions for w in run.workers)
            / max(1, sum(w.evictions for w in run.workers)),
            3,
        ),
        "load_imbalance": round(max(busy) / mean_busy, 3) if mean_busy > 0 else 1.0,
        "warm_abandoned": sum(1 for r in run.records if r.warm_abandoned),
        "kv_wait_ms_total": round(sum(r.kv_wait_s for r in done) * 1e3, 1),
        "per_worker_requests": {w.worker: w.requests for w in run.workers},
    }
    if run.warm_ups:  # runs without copies keep their keys
        engines = sum(w.prefill_tokens for w in run.workers)
        out["warm_ups"] = run.warm_ups
        out["warm_up_prefill_tokens"] = max(0, engines - (prompt - cached))
    if run.chars_per_token is not None:  # text mode only: token-mode reports keep their keys
        out["chars_per_token"] = round(run.chars_per_token, 4)
    if run.routers > 1:  # one router's reports keep their keys
        out["replicas"] = replica_figures(run)
    return out


def total_prefill_tokens(summary: dict[str, Any]) -> int:
    """The prefill a run cost the engines: the requests' and the router's own copies'."""
    return int(summary["prefill_tokens"]) + int(summary.get("warm_up_prefill_tokens", 0))


def arrival_text(report: dict[str, Any]) -> str:
    """How a simulate report's requests arrived, for titles: the load that applied
    (with its rate), else the rate given (``--rate`` overrides a load), else the
    trace's own times (with ``--rate-scale``'s factor)."""
    load, rate = report.get("load"), report.get("rate_rps")
    if load is not None:
        return f"load {_number(load)} ({_number(rate)} req/s)"
    if rate:
        return f"{_number(rate)} req/s"
    scale = report.get("rate_scale")  # --rate-scale: the trace's times sped up
    return f"trace arrival times x{scale:g}" if scale else "trace arrival times"


def _number(value: Any) -> str:
    """Two decimals, as a title shows a load or a rate; 3 significant digits from a
    million up, where two decimals would print every digit of ``1e308``."""
    return f"{value:.2f}" if abs(value) < 1e6 else f"{value:.3g}"


def cached_share(cached_tokens: int, prompt_tokens: int) -> float:
    """Cached over prompt tokens (0 when there were none), rounded to 4 decimals."""
    return round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0


def replica_figures(run: SimRun) -> list[dict[str, Any]]:
    """Per router replica: requests admitted, cached share, TTFT mean and p99 (ms)."""
    done: list[list[RequestRecord]] = [[] for _ in range(run.routers)]
    prompt = [0] * run.routers
    for r in run.records:
        prompt[r.router] += r.prompt_tokens
        if r.completed >= 0:
            done[r.router].append(r)
    out: list[dict[str, Any]] = []
    for k, recs in enumerate(done):
        t = percentiles(r.ttft_s * 1e3 for r in recs)
        out.append(
            {
                "replica": f"r{k:02d}",
                "requests": sum(1 for r in run.records if r.router == k),
                "cached_share": cached_share(sum(r.cached_tokens for r in recs), prompt[k]),
                "ttft_ms": {"mean": t["mean"], "p99": t["p99"]},
            }
        )
    return out
