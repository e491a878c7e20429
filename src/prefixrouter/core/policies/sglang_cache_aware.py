"""``sglang_cache_aware``: SGLang router's ``cache_aware`` policy (also vllm-router's).

Per PEERS.md, SGLang's Rust router (model gateway) keeps one approximate radix
tree per model over the request text; every worker is a *tenant* of the nodes
it was sent. For each request, with ``load`` = the router's own in-flight count
per worker (``WorkerView.in_flight``, filled from the driver's ledger):

1. **balance**: if ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > balance_rel_threshold * min_load``, the least-loaded worker
   (ties: lowest id), whatever it holds;
2. otherwise match the prompt in the tree,
   ``match_rate = matched / prompt length``:

   * **cache_hit**: ``match_rate > cache_threshold``: a tenant of the deepest
     matched node (the one that touched it last; ties: lowest id);
   * **cache_miss**: otherwise the least-loaded worker (newer versions,
     ``miss_fallback="least_loaded"``) or the one with the smallest tree
     (older versions, ``"smallest_tree"``).

The prompt is then inserted under the chosen worker (in the balance branch
too). Every ``eviction_interval_s`` an LRU pass trims each tenant's tree to
``max_tree_size`` characters; it runs lazily in ``on_routed`` once ``ctx.now``
passes the next eviction time, so ``select`` never changes anything.

Defaults are the Rust router's: cache_threshold 0.5, balance_abs 32,
balance_rel 1.1, eviction every 30 s, max_tree_size 10,000 characters. (The
Python CLI's are 0.3 / 64 / 1.5 / 120 s / 2^26.)

Approximation: the simulator's requests carry token ids, not text, so the tree
is over the request's chained block hashes (``ctx.blocks.hashes``, 16 tokens
~ 64 characters a block) instead of characters. A chained hash identifies its
whole prefix, so the radix tree is a dict ``block hash -> {tenant: last
access}`` and the deepest matched node is found by walking the hashes until one
is missing (:class:`TenantTree`). Characters convert at ``CHARS_PER_TOKEN`` = 4:
``max_tree_size`` 10,000 characters = 10,000 / (4 * 16) = 156 blocks per
worker; ``match_rate = matched_blocks * block_tokens / prompt_tokens``, so a
partial tail block counts in the denominator as text would.

Bounded memory (not in SGLang, whose tree only shrinks at eviction time): the
tree never holds more than ``max_total_blocks`` entries between two eviction
passes; past it, the worker with the most entries loses its least recently
used one at once.

``CandidateScore``: ``matched_tokens`` per this tree, ``score`` = load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policies.common import CHARS_PER_TOKEN, TenantTree
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import WorkerId, WorkerView
from prefixrouter.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SglangCacheAwareParams:
    """Parameters of ``sglang_cache_aware`` (SGLang Rust router defaults).

    Attributes:
        cache_threshold: Minimum match rate to follow the tree.
        balance_abs_threshold: Load spread (requests) beyond which to balance...
        balance_rel_threshold: ...if also ``max_load > this * min_load``.
        eviction_interval_s: Seconds between LRU eviction passes.
        max_tree_size: Characters each worker may keep after an eviction pass.
        miss_fallback: ``least_loaded`` (newer versions) or ``smallest_tree`` (older).
        max_total_blocks: Hard bound on tree entries between passes (ours).
    """

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    eviction_interval_s: float = 30.0
    max_tree_size: int = 10_000
    miss_fallback: str = "least_loaded"
    max_total_blocks: int = 2_000_000

    def __post_init__(self) -> None:
        if self.miss_fallback not in ("least_loaded", "smallest_tree"):
            raise ConfigError(
                f"miss_fallback must be least_loaded or smallest_tree, got {self.miss_fallback!r}"
            )
        if self.eviction_interval_s <= 0 or self.max_tree_size <= 0 or self.max_total_blocks <= 0:
            raise ConfigError("eviction_interval_s, max_tree_size and max_total_blocks must be > 0")


@register
class SglangCacheAware(Policy):
    """SGLang's approximate-tree cache-aware routing with load balancing thresholds."""

    name = "sglang_cache_aware"
    Params = SglangCacheAwareParams
    params: SglangCacheAwareParams

    def __init__(self, params: SglangCacheAwareParams | None = None) -> None:
        super().__init__(params)
        self.tree = TenantTree(self.params.max_total_blocks)
        self._next_eviction: float | None = None

    def max_tree_blocks(self, block_tokens: float) -> int:
        """``max_tree_size`` characters in blocks of ``block_tokens`` tokens."""
        return max(1, int(self.params.max_tree_size / (CHARS_PER_TOKEN * block_tokens)))

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        ids = [w.worker_id for w in candidates]
        depths = self.tree.depths(blocks.hashes, ids)
        scores = tuple(
            CandidateScore(w.worker_id, blocks.tokens_for(depths[w.worker_id]), score=w.in_flight)
            for w in candidates
        )
        least = min(candidates, key=lambda w: w.in_flight)
        max_load = max(w.in_flight for w in candidates)
        min_load = least.in_flight

        def pick(w: WorkerView, tier: str, reason: str) -> Selection:
            cached = blocks.tokens_for(depths[w.worker_id])
            return Selection(w.worker_id, tier, reason, cached, scores)

        if max_load - min_load > p.balance_abs_threshold and max_load > (
            p.balance_rel_threshold * min_load
        ):
            return pick(
                least,
                "balance",
                f"load spread {min_load}..{max_load} beyond both thresholds: least loaded",
            )
        deepest = max(depths.values())
        rate = deepest * blocks.block_tokens / blocks.prompt_tokens if blocks.prompt_tokens else 0.0
        if deepest and rate > p.cache_threshold:
            node = blocks.hashes[deepest - 1]
            tenants = [w for w in candidates if depths[w.worker_id] == deepest]
            # The tenant that touched the deepest node last; ties: lowest id.
            best = max(tenants, key=lambda w: self.tree.last_access(node, w.worker_id) or 0.0)
            return pick(
                best,
                "cache_hit",
                f"match rate {rate:.2f} > {p.cache_threshold}: tenant of the deepest node",
            )
        if p.miss_fallback == "smallest_tree":
            small = min(candidates, key=lambda w: self.tree.size(w.worker_id))
            return pick(
                small,
                "cache_miss",
                f"match rate {rate:.2f} <= {p.cache_threshold}: smallest tree",
            )
        return pick(
            least,
            "cache_miss",
            f"match rate {rate:.2f} <= {p.cache_threshold}: least loaded ({min_load} in flight)",
        )

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        self.tree.insert(worker, ctx.blocks.hashes, ctx.now)
        if self._next_eviction is None:
            self._next_eviction = ctx.now + self.params.eviction_interval_s
        elif ctx.now >= self._next_eviction:
            limit = self.max_tree_blocks(ctx.blocks.block_tokens)
            for w in self.tree.workers():
                self.tree.evict_to(w, limit)
            interval = self.params.eviction_interval_s
            # The next pass is the next multiple of the interval, as a timer would fire.
            missed = math.floor((ctx.now - self._next_eviction) / interval) + 1
            self._next_eviction += missed * interval

    def on_worker_removed(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
