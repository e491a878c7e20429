"""The cold path: where a request goes that no worker holds a prefix of.

In order: the configured cold pool (:func:`cold_pool_rule`); for a prefix
never seen, the emptiest cache within the margin when later requests will
follow it (:func:`new_home_rule`), else the picker among all workers; for a
prefix seen before that no cache holds any more, its rendezvous home
(:func:`rendezvous_home`), so evicted prefixes partition across caches.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixrouter.core.index import PrefixIndex
from prefixrouter.core.policies.prefix_aware.choice import argmin, cache_pressure, margin_limit
from prefixrouter.core.policies.prefix_aware.params import OutputClassParams
from prefixrouter.core.policies.prefix_aware.picker import rendezvous
from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.types import WorkerView


def cold_pool_rule(
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    best: int,
    pool: str,
    cls: OutputClassParams,
) -> int | None:
    """Cold path, cold pool: the best worker of ``pool``, if within the margin of the ``best``.

    With no warm worker, a configured pool takes the cold requests, so the
    replicas that hold expensive hot prefixes keep serving them; only while
    the pool's best score is within the (full) margin of the best of all, so
    a busy pool does not make cold requests wait. None: no such worker.
    """
    pool_idx = [i for i, w in enumerate(candidates) if w.pool == pool]
    if not pool_idx:
        return None
    pi = argmin(scored, pool_idx)
    return pi if scored[pi].score <= margin_limit(scored[best], cls, 1.0) else None


def new_home_rule(
    index: PrefixIndex,
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    best: int,
    cls: OutputClassParams,
    prompt_blocks: int,
) -> int | None:
    """Cold path, a new prefix that later requests will follow: the emptiest cache.

    A prompt that matches nothing anywhere, of a kind whose new content
    later requests were seen to reuse (a new system prompt, document or
    session: ``Reuse.followed``; before any such evidence, the picker
    decides), makes a home that its later requests come back to. Where it
    goes decides the load those requests bring, not just this request's
    first token: placed by that first token (the least loaded worker at
    this instant), 64 such groups landed 6 to 11 on each of 8 workers
    (``gsp``), and the workers with more groups queued their warm requests
    longer. Among the candidates within the (full) margin of the ``best``
    (the first-token price a placement that lasts may cost, as for a copy),
    the one whose cache holds the fewest blocks per the index wins, then
    the fewest in flight, then the score. The blocks a worker holds grow
    with the homes it was given and the requests they brought (Ray Serve's
    prefix affinity sends a miss to the smallest tree, the same measure),
    so homes spread evenly by what they carry.

    Only while every candidate's cache has room for the prompt
    (:func:`cache_pressure` below 1): once caches are full the index holds
    what recency left, not what homes bring, and the choice is the
    picker's (placing by held blocks then moved ``llmd-customers`` by up to
    10 % either way over seeds). One router only: replicas see their
    peers' homes a lag late and would all pick the same emptiest cache.

    Returns:
        The home's index, or None (the rule does not apply; fewer than two
        candidates within the margin).
    """
    if any(cache_pressure(index, w.worker_id, prompt_blocks) >= 1.0 for w in candidates):
        return None
    limit = margin_limit(scored[best], cls, 1.0)
    near = [i for i in range(len(scored)) if scored[i].score <= limit]
    if len(near) < 2:
        return None

    def key(i: int) -> tuple[int, int, float]:
        return index.blocks_of(scored[i].worker_id), candidates[i].in_flight, scored[i].score

    return min(near, key=key)


def rendezvous_home(
    scored: Sequence[CandidateScore], best: int, first_block: int, cls: OutputClassParams
) -> tuple[int, int]:
    """Cold path, a prefix seen before that no cache holds any more: its home.

    Among the candidates within the (full) margin of the ``best``, the one
    with the highest rendezvous hash of the prefix's first block: the same
    worker each time, so prefixes partition across caches instead of
    scattering over all of them (the scattering is what makes caches thrash
    under pressure). A prefix never seen goes to the picker instead.

    Returns:
        The home's index and how many candidates were within the margin.
    """
    limit = margin_limit(scored[best], cls, 1.0)
    near = [i for i in range(len(scored)) if scored[i].score <= limit]
    home = max(near, key=lambda i: rendezvous(first_block, scored[i].worker_id))
    return home, len(near)
