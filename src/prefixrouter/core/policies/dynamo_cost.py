"""``dynamo_cost``: NVIDIA Dynamo's KV router cost function.

Per PEERS.md, for each worker ``w``, in blocks of the engine's block size::

    cost(w) = prefill_load_scale * max(active_prefill_blocks(w) + new_blocks - overlap_blocks(w), 0)
              + decode_blocks(w)

* ``new_blocks``: the request's prompt in blocks (rounded up);
* ``overlap_blocks(w)``: leading blocks of the request ``w`` holds;
* ``active_prefill_blocks(w)``: prompt tokens sent to ``w`` and not prefilled
  yet (``WorkerView.pending_prefill_tokens``: the load is charged until the
  first token), in blocks;
* ``decode_blocks(w)``: the KV blocks of the requests active on ``w``
  (``WorkerView.context_tokens``, the router's own ledger), in blocks.

The lowest cost wins (``temperature`` 0, ties random); with ``temperature``
``T > 0`` a worker is sampled with ``p ∝ exp(-(c - c_min) / ((c_max - c_min) * T))``.
Defaults: ``prefill_load_scale`` 1 (Dynamo's overlap score weight), temperature 0.

Index: with KV events off (the default here), Dynamo indexes its own decisions
with a 120 s TTL: on ``on_routed`` the request's blocks are recorded under the
chosen worker, and entries older than ``ttl_s`` count as absent (and are
dropped at the next ``on_routed``). With ``use_kv_events=True`` the overlap is
read from the core router's shared index (``ctx.matches``), which engine KV
events feed, as Dynamo does when events are on; the policy then keeps no state.

Blocks are the request's chained block hashes (``ctx.blocks.hashes``), which in
token mode are exactly the engine's blocks. Randomness (ties, softmax) comes
from :func:`~prefixrouter.core.policies.power_of_two.request_rng`, so ``select``
is pure and deterministic per request id. The own index is bounded by
``max_blocks`` entries (largest worker's least recently used dropped first).

``CandidateScore``: ``matched_tokens`` = overlap in tokens, ``score`` = cost in
blocks. Tiers: ``min_cost``, ``softmax``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policies.common import TenantTree, request_rng
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import WorkerId, WorkerView


@dataclass(frozen=True, slots=True)
class DynamoCostParams:
    """Parameters of ``dynamo_cost`` (Dynamo defaults).

    Attributes:
        prefill_load_scale: Weight of the prefill term against the decode term.
        temperature: 0 = lowest cost; above 0, softmax sampling over normalized costs.
        ttl_s: Lifetime of an indexed block of our own decisions (events off).
        use_kv_events: Read the overlap from the shared, event-fed index instead.
        seed: XORed into each request's hash for ties and sampling.
        max_blocks: Bound on the own index's (block, worker) entries.
    """

    prefill_load_scale: float = 1.0
    temperature: float = 0.0
    ttl_s: float = 120.0
    use_kv_events: bool = False
    seed: int = 0
    max_blocks: int = 2_000_000


@register
class DynamoCost(Policy):
    """Lowest prefill-plus-decode block cost, counting the overlap with the prompt."""

    name = "dynamo_cost"
    Params = DynamoCostParams
    params: DynamoCostParams

    def __init__(self, params: DynamoCostParams | None = None) -> None:
        super().__init__(params)
        self.index = TenantTree(self.params.max_blocks)

    def _overlaps(
        self, ctx: RoutingContext, candidates: Sequence[WorkerView]
    ) -> dict[WorkerId, int]:
        ids = [w.worker_id for w in candidates]
        if self.params.use_kv_events:
            return {w: (m.blocks if (m := ctx.matches.get(w)) is not None else 0) for w in ids}
        return self.index.depths(ctx.blocks.hashes, ids, not_before=ctx.now - self.params.ttl_s)

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        bt = blocks.block_tokens
        new_blocks = math.ceil(blocks.prompt_tokens / bt)
        overlaps = self._overlaps(ctx, candidates)
        costs: list[float] = []
        for w in candidates:
            prefill = w.pending_prefill_tokens / bt + new_blocks - overlaps[w.worker_id]
            costs.append(p.prefill_load_scale * max(prefill, 0.0) + w.context_tokens / bt)
        scores = tuple(
            CandidateScore(w.worker_id, blocks.tokens_for(overlaps[w.worker_id]), score=c)
            for w, c in zip(candidates, costs, strict=True)
        )
        c_min, c_max = min(costs), max(costs)
        rng = request_rng(ctx.request.request_id, p.seed)
        if p.temperature > 0 and c_max > c_min:
            span = (c_max - c_min) * p.temperature
            weights = [math.exp(-(c - c_min) / span) for c in costs]
            i = rng.choices(range(len(costs)), weights=weights)[0]
            tier = "softmax"
            reason = f"sampled at temperature {p.temperature:g}: cost {costs[i]:.1f} blocks"
        else:
            tied = [i for i, c in enumerate(costs) if c == c_min]
            i = tied[0] if len(tied) == 1 else rng.choice(tied)
            tier = "min_cost"
            reason = (
                f"lowest cost {c_min:.1f} blocks, overlap {overlaps[scores[i].worker_id]} blocks"
            )
        chosen = scores[i]
        return Selection(chosen.worker_id, tier, reason, chosen.matched_tokens, scores)

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        if self.params.use_kv_events:
            return
        self.index.expire(ctx.now - self.params.ttl_s)
        self.index.insert(worker, ctx.blocks.hashes, ctx.now)

    def on_worker_removed(self, worker: WorkerId) -> None:
        self.index.remove_worker(worker)
