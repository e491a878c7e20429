"""``ray_prefix_affinity``: Ray Serve's ``PrefixCacheAffinityRouter``.

Per PEERS.md, Ray keeps one character prefix tree shared by every router
instance (an actor); each replica is a tenant of the text it was sent. With
``queue`` = a replica's ongoing requests (Ray's queue length; here
``WorkerView.in_flight``):

1. **balance**: if ``max_queue - min_queue > imbalanced_threshold`` (infinite
   by default, so never), power of two choices: the shorter queue of two
   random candidates;
2. otherwise match the prompt, ``match_rate = matched / prompt length``:

   * **cache_miss**: ``match_rate < match_rate_threshold`` (0.1): the replicas
     with the smallest trees;
   * **cache_hit**: otherwise the replicas at the deepest matched node;

   then the shortest queue among those (ties random).

The prompt is inserted under the chosen replica.

Approximation: the simulator's requests carry token ids, so the character
tree becomes a tree over the chained block hashes (``ctx.blocks.hashes``, one
block of 16 tokens ~ 64 characters at ``CHARS_PER_TOKEN`` = 4), the
:class:`~prefixrouter.core.policies.sglang_cache_aware.TenantTree`; tree sizes
are counted in blocks, and ``match_rate = matched_blocks * block_tokens /
prompt_tokens`` (a partial tail counts in the denominator).

Bounded memory (ours): each replica keeps at most ``max_tree_chars`` characters
(converted to blocks) in its tree, least recently used dropped first, at insert.

Randomness (power of two, ties) comes from
:func:`~prefixrouter.core.policies.power_of_two.request_rng`, so ``select`` is
pure and deterministic per request id.

``CandidateScore``: ``matched_tokens`` per the tree, ``score`` = queue length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policies.common import CHARS_PER_TOKEN, TenantTree, request_rng
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import WorkerId, WorkerView


@dataclass(frozen=True, slots=True)
class RayPrefixAffinityParams:
    """Parameters of ``ray_prefix_affinity`` (Ray Serve defaults).

    Attributes:
        imbalanced_threshold: Queue spread beyond which to use power of two (inf = never).
        match_rate_threshold: Below this match rate, prefer the smallest trees.
        max_tree_chars: Characters each replica's tree keeps at most (ours, LRU).
        seed: XORed into each request's hash for sampling and ties.
    """

    imbalanced_threshold: float = math.inf
    match_rate_threshold: float = 0.1
    max_tree_chars: int = 400_000
    seed: int = 0


@register
class RayPrefixAffinity(Policy):
    """Deepest tree match (or smallest tree), then the shortest queue."""

    name = "ray_prefix_affinity"
    Params = RayPrefixAffinityParams
    params: RayPrefixAffinityParams

    def __init__(self, params: RayPrefixAffinityParams | None = None) -> None:
        super().__init__(params)
        # Per-replica caps bound memory; this only guards against unbounded replica counts.
        self.tree = TenantTree(max(1, self.params.max_tree_chars) * 64)

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        depths = self.tree.depths(blocks.hashes, [w.worker_id for w in candidates])
        scores = tuple(
            CandidateScore(w.worker_id, blocks.tokens_for(depths[w.worker_id]), score=w.in_flight)
            for w in candidates
        )
        rng = request_rng(ctx.request.request_id, p.seed)

        def pick(pool: Sequence[WorkerView], tier: str, why: str) -> Selection:
            shortest = min(w.in_flight for w in pool)
            tied = [w for w in pool if w.in_flight == shortest]
            w = tied[0] if len(tied) == 1 else rng.choice(tied)
            cached = blocks.tokens_for(depths[w.worker_id])
            reason = f"{why}; shortest queue among {len(pool)} ({shortest})"
            return Selection(w.worker_id, tier, reason, cached, scores)

        queues = [w.in_flight for w in candidates]
        if max(queues) - min(queues) > p.imbalanced_threshold and len(candidates) > 1:
            pair = rng.sample(list(candidates), 2)
            return pick(pair, "balance", f"queue spread {max(queues) - min(queues)}: power of two")
        deepest = max(depths.values())
        rate = deepest * blocks.block_tokens / blocks.prompt_tokens if blocks.prompt_tokens else 0.0
        if rate < p.match_rate_threshold:
            smallest = min(self.tree.size(w.worker_id) for w in candidates)
            pool = [w for w in candidates if self.tree.size(w.worker_id) == smallest]
            why = f"match rate {rate:.2f} < {p.match_rate_threshold}: smallest trees"
            return pick(pool, "cache_miss", why)
        pool = [w for w in candidates if depths[w.worker_id] == deepest]
        why = f"match rate {rate:.2f} >= {p.match_rate_threshold}: deepest matched node"
        return pick(pool, "cache_hit", why)

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        cap = max(1, int(self.params.max_tree_chars / (CHARS_PER_TOKEN * ctx.blocks.block_tokens)))
        self.tree.insert(worker, ctx.blocks.hashes, ctx.now, cap=cap)

    def on_worker_removed(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
