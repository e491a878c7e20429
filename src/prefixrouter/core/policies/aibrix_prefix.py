"""``aibrix_prefix``: AIBrix's ``prefix-cache`` routing algorithm.

Per PEERS.md, AIBrix hashes the prompt into chained xxhash blocks (of bytes or
tokens) and keeps, per model, an LRU table ``block -> pods that were sent it``.
With ``running`` = a pod's running requests:

1. **balance**: if ``max_running - min_running > imbalance_threshold`` (8), the
   least-loaded pods only: the one with the fewest running requests;
2. otherwise sort the pods that match the prompt by match percentage
   descending, then running requests ascending, and take the first with
   ``running <= mean + k * stddev`` over all candidates (``k`` = 1):
   **cache_hit**;
3. if no matching pod passes that bound (or none matches): the least-request
   pod, **cache_miss**.

The prompt's blocks are then added to the table under the chosen pod.

Approximations: blocks are the request's chained block hashes
(``ctx.blocks.hashes``, token blocks in token mode; the namespace seeds the
chain, so one table holds every model without collisions and the per-model
tables are keyed by ``request.model`` or the namespace's model revision).
``match % = matched_blocks * block_tokens / prompt_tokens`` (a partial tail
counts in the denominator). ``running`` = requests admitted to the engine's
batch, prefilling or decoding, ~ ``min(in_flight, max_slots)``: requests the
router sent beyond the engine's sequence slots are waiting, not running.
Ties of least-request go to the lowest id.

Bounded memory: each model's table is an LRU of ``max_blocks_per_model``
blocks, and at most ``max_models`` tables are kept (least recently used model
dropped).

``CandidateScore``: ``matched_tokens`` per the table, ``score`` = match percent.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import BlockHash, RoutingRequest, WorkerId, WorkerView

_Table = OrderedDict[BlockHash, dict[WorkerId, float]]


@dataclass(frozen=True, slots=True)
class AibrixPrefixParams:
    """Parameters of ``aibrix_prefix`` (AIBrix defaults).

    Attributes:
        imbalance_threshold: Running-request spread beyond which to balance.
        std_factor: ``k`` in the bound ``running <= mean + k * stddev``.
        max_blocks_per_model: LRU capacity of each model's block table.
        max_models: Model tables kept at most (ours, bounds memory).
    """

    imbalance_threshold: int = 8
    std_factor: float = 1.0
    max_blocks_per_model: int = 200_000
    max_models: int = 64


def model_key(request: RoutingRequest) -> str:
    """The model whose table a request uses."""
    return request.model or request.namespace.model_revision


def running(w: WorkerView) -> int:
    """Requests in the engine's batch (prefilling or decoding)."""
    return min(w.in_flight, w.max_slots)


@register
class AibrixPrefix(Policy):
    """Best match percentage within a load bound, else least request."""

    name = "aibrix_prefix"
    Params = AibrixPrefixParams
    params: AibrixPrefixParams

    def __init__(self, params: AibrixPrefixParams | None = None) -> None:
        super().__init__(params)
        self._tables: OrderedDict[str, _Table] = OrderedDict()

    def blocks_held(self, model: str) -> int:
        """Blocks in ``model``'s table."""
        table = self._tables.get(model)
        return len(table) if table is not None else 0

    def _depths(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> dict[WorkerId, int]:
        result = {w.worker_id: 0 for w in candidates}
        table = self._tables.get(model_key(ctx.request))
        if table is None:
            return result
        alive = list(result)
        for depth, h in enumerate(ctx.blocks.hashes, 1):
            pods = table.get(h)
            if pods is None:
                break
            alive = [w for w in alive if w in pods]
            if not alive:
                break
            for w in alive:
                result[w] = depth
        return result

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        depths = self._depths(ctx, candidates)
        prompt = blocks.prompt_tokens
        pct = {
            w: 100.0 * min(1.0, d * blocks.block_tokens / prompt) if prompt else 0.0
            for w, d in depths.items()
        }
        scores = tuple(
            CandidateScore(
                w.worker_id, blocks.tokens_for(depths[w.worker_id]), score=pct[w.worker_id]
            )
            for w in candidates
        )
        loads = [running(w) for w in candidates]
        least = min(candidates, key=running)

        def pick(w: WorkerView, tier: str, reason: str) -> Selection:
            return Selection(
                w.worker_id, tier, reason, blocks.tokens_for(depths[w.worker_id]), scores
            )

        spread = max(loads) - min(loads)
        if spread > p.imbalance_threshold:
            why = f"running spread {spread} > {p.imbalance_threshold}: least request"
            return pick(least, "balance", why)
        mean = sum(loads) / len(loads)
        std = math.sqrt(sum((x - mean) ** 2 for x in loads) / len(loads))
        bound = mean + p.std_factor * std
        matched = sorted(
            (w for w in candidates if depths[w.worker_id] > 0),
            key=lambda w: (-pct[w.worker_id], running(w)),
        )
        for w in matched:
            if running(w) <= bound:
                why = f"match {pct[w.worker_id]:.0f}% with {running(w)} running <= {bound:.2f}"
                return pick(w, "cache_hit", why)
        if matched:
            why = (
                f"every matching pod above mean + {p.std_factor:g} std = {bound:.2f}: least request"
            )
        else:
            why = "no pod matches the prefix: least request"
        return pick(least, "cache_miss", why)

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        p = self.params
        model = model_key(ctx.request)
        table = self._tables.get(model)
        if table is None:
            table = self._tables[model] = OrderedDict()
            while len(self._tables) > p.max_models:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(model)
        now = ctx.now
        for h in reversed(ctx.blocks.hashes):  # tail first: the head ends most recent
            pods = table.get(h)
            if pods is None:
                table[h] = {worker: now}
            else:
                pods[worker] = now
                table.move_to_end(h)
        while len(table) > p.max_blocks_per_model:
            table.popitem(last=False)

    def on_worker_removed(self, worker: WorkerId) -> None:
        for table in self._tables.values():
            empty = []
            for h, pods in table.items():
                if pods.pop(worker, None) is not None and not pods:
                    empty.append(h)
            for h in empty:
                del table[h]
