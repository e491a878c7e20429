"""``llmd_weighted``: the llm-d inference scheduler's default scoring profile.

Per PEERS.md (Gateway API Inference Extension endpoint picker): weighted
scorers, each in [0, 1], then a max-score picker with random ties::

    score(w) = prefix_weight * prefix(w) + queue_weight * queue(w) + kv_weight * kv(w)

with the Helm default weights 3 / 2 / 2 and

* ``prefix(w)``: approximate prefix scorer, consecutive matched blocks of the
  request on ``w`` / the request's blocks, at most ``max_prefix_blocks`` (256)
  blocks considered; the index is a per-server LRU of ``lru_capacity_per_server``
  (31,250) blocks, fed by the scheduler's own decisions;
* ``queue(w) = (maxQ - q) / (maxQ - minQ)`` over the candidates (1 for all when
  equal), ``q`` = waiting requests ~ ``in_flight - decoding`` (not yet past prefill);
* ``kv(w) = 1 - kv_usage``.

Approximation: llm-d's approximate mode hashes 64-character blocks (16 tokens
x 4), chained and seeded by model and cache salt. The simulator has token ids
only, so blocks are the request's chained block hashes (``ctx.blocks.hashes``,
already seeded by the cache namespace), grouped to ``block_chars`` at
``CHARS_PER_TOKEN`` = 4: 64 characters = one 16-token block. The denominator
is the prompt's length in blocks (a partial tail counts), capped at 256.

Randomness: ties of the best total are broken with
:func:`~prefixrouter.core.policies.power_of_two.request_rng`, so ``select`` is
pure and deterministic per request id.

``CandidateScore``: ``matched_tokens`` per the index, ``score`` = the weighted
total. Tiers: ``prefix`` (the chosen worker matched part of the prompt),
``load`` (it matched nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policies.common import CHARS_PER_TOKEN, TenantTree, request_rng
from prefixrouter.core.policies.vllm_prefixaware import chunk_hashes
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import BlockHash, WorkerId, WorkerView


@dataclass(frozen=True, slots=True)
class LlmdWeightedParams:
    """Parameters of ``llmd_weighted`` (llm-d Helm defaults).

    Attributes:
        prefix_weight: Weight of the approximate prefix scorer.
        queue_weight: Weight of the queue scorer.
        kv_weight: Weight of the KV-utilization scorer.
        block_chars: Characters per prefix block.
        max_prefix_blocks: Blocks of a request considered at most.
        lru_capacity_per_server: Blocks the index keeps per server (LRU).
        seed: XORed into each request's hash for the tie-break.
    """

    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    block_chars: int = 64
    max_prefix_blocks: int = 256
    lru_capacity_per_server: int = 31_250
    seed: int = 0


@register
class LlmdWeighted(Policy):
    """Weighted prefix, queue and KV-utilization scorers; max score wins."""

    name = "llmd_weighted"
    Params = LlmdWeightedParams
    params: LlmdWeightedParams

    def __init__(self, params: LlmdWeightedParams | None = None) -> None:
        super().__init__(params)
        # The per-server capacity bounds memory; the global bound only guards
        # against an unbounded number of servers.
        self.index = TenantTree(max(1, self.params.lru_capacity_per_server) * 1024)

    def _blocks(self, ctx: RoutingContext) -> tuple[int, list[BlockHash]]:
        bt = ctx.blocks.block_tokens
        step = max(1, round(self.params.block_chars / (CHARS_PER_TOKEN * bt)))
        hashes = chunk_hashes(ctx.blocks.hashes, step)[: self.params.max_prefix_blocks]
        return step, list(hashes)

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        step, hashes = self._blocks(ctx)
        depths = self.index.depths(hashes, [w.worker_id for w in candidates])
        total_blocks = min(
            float(p.max_prefix_blocks), blocks.prompt_tokens / (blocks.block_tokens * step)
        )
        queues = [w.waiting for w in candidates]
        qmax, qmin = max(queues), min(queues)
        totals: list[float] = []
        scores: list[CandidateScore] = []
        for w, q in zip(candidates, queues, strict=True):
            prefix = depths[w.worker_id] / total_blocks if total_blocks > 0 else 0.0
            queue = (qmax - q) / (qmax - qmin) if qmax > qmin else 1.0
            kv = 1.0 - min(1.0, max(0.0, w.kv_usage))
            total = p.prefix_weight * prefix + p.queue_weight * queue + p.kv_weight * kv
            totals.append(total)
            matched = blocks.tokens_for(depths[w.worker_id] * step)
            scores.append(CandidateScore(w.worker_id, matched, score=total))
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t == best]
        i = tied[0] if len(tied) == 1 else request_rng(ctx.request.request_id, p.seed).choice(tied)
        chosen = scores[i]
        tier = "prefix" if chosen.matched_tokens else "load"
        reason = (
            f"highest weighted score {best:.3f} "
            f"({p.prefix_weight:g}*prefix + {p.queue_weight:g}*queue + {p.kv_weight:g}*kv)"
        )
        return Selection(chosen.worker_id, tier, reason, chosen.matched_tokens, tuple(scores))

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        _, hashes = self._blocks(ctx)
        self.index.insert(worker, hashes, ctx.now, cap=self.params.lru_capacity_per_server)

    def on_worker_removed(self, worker: WorkerId) -> None:
        self.index.remove_worker(worker)
