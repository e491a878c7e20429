"""``vllm_prefixaware``: vLLM production-stack's ``prefixaware`` routing logic.

Per PEERS.md: the chat text is cut into 128-character chunks, each chunk's
xxhash64 goes into a trie, and every endpoint a request was sent to is
recorded on the trie nodes of its chunks. A request goes to the endpoints
holding the longest match (restricted to the available endpoints), with a
**random** choice among endpoints tied at that length; no match at all is a tie
of every endpoint. There is no load term and no eviction. Fallback when the
match is shorter than ``min_match_chars`` (default 0: off): the endpoint with
the lowest recent request rate.

Approximation: requests in the simulator carry token ids, not text, so the
trie is over the request's chained block hashes (``ctx.blocks.hashes``). At
``CHARS_PER_TOKEN`` = 4 a 128-character chunk is ``128 / (4 * block_tokens)``
blocks (2 blocks of 16 tokens); since the hashes are chained, the hash of a
chunk's last block names the whole prefix up to that chunk, so the chunk trie
is :class:`~prefixrouter.core.policies.sglang_cache_aware.TenantTree` over
every ``chunk_blocks``-th hash. A trailing partial chunk is not hashed.

Randomness: ties are broken with :func:`~prefixrouter.core.policies.power_of_two.request_rng`
(``xxh3_64(request_id) XOR seed``), so ``select`` is pure and deterministic for
a request id. The recent request rate of the fallback is an exponentially
decayed count with time constant ``qps_window_s`` (updated in ``on_routed``).

Bounded memory (deviation): production-stack's trie never evicts (PEERS.md
complaint 7). Here it holds at most ``max_nodes`` (node, endpoint) entries;
past that, the endpoint with the most entries loses its least recently used
one. The default is large enough not to bind in ordinary simulations.

``CandidateScore``: ``matched_tokens`` per the trie, ``score`` = matched chunks.
Tiers: ``longest_match``, ``no_match`` (random among all), ``low_qps`` (fallback).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.policies.common import CHARS_PER_TOKEN, TenantTree, request_rng
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import BlockHash, WorkerId, WorkerView


@dataclass(frozen=True, slots=True)
class VllmPrefixAwareParams:
    """Parameters of ``vllm_prefixaware`` (production-stack defaults).

    Attributes:
        chunk_chars: Characters per trie chunk.
        min_match_chars: Below this match, route to the lowest recent QPS (0 = off).
        qps_window_s: Time constant of the recent request-rate estimate.
        seed: XORed into each request's hash for the tie-break.
        max_nodes: Bound on (node, endpoint) entries (ours; the peer has none).
    """

    chunk_chars: int = 128
    min_match_chars: int = 0
    qps_window_s: float = 60.0
    seed: int = 0
    max_nodes: int = 1_000_000


def chunk_hashes(hashes: Sequence[BlockHash], chunk_blocks: int) -> Sequence[BlockHash]:
    """The chained hash of each whole chunk of ``chunk_blocks`` blocks."""
    if chunk_blocks <= 1:
        return hashes
    return hashes[chunk_blocks - 1 :: chunk_blocks]


@register
class VllmPrefixAware(Policy):
    """Longest trie match, random among ties, no load term."""

    name = "vllm_prefixaware"
    Params = VllmPrefixAwareParams
    params: VllmPrefixAwareParams

    def __init__(self, params: VllmPrefixAwareParams | None = None) -> None:
        super().__init__(params)
        self.trie = TenantTree(self.params.max_nodes)
        self._qps: dict[WorkerId, tuple[float, float]] = {}  # worker -> (rate, as of)

    def chunk_blocks(self, block_tokens: float) -> int:
        """Blocks per ``chunk_chars``-character chunk."""
        return max(1, round(self.params.chunk_chars / (CHARS_PER_TOKEN * block_tokens)))

    def recent_qps(self, worker: WorkerId, now: float) -> float:
        """The worker's recent request rate as of ``now``."""
        rate, at = self._qps.get(worker, (0.0, now))
        return rate * math.exp(-(now - at) / self.params.qps_window_s)

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        step = self.chunk_blocks(blocks.block_tokens)
        depths = self.trie.depths(
            chunk_hashes(blocks.hashes, step), [w.worker_id for w in candidates]
        )
        scores = tuple(
            CandidateScore(
                w.worker_id,
                blocks.tokens_for(depths[w.worker_id] * step),
                score=depths[w.worker_id],
            )
            for w in candidates
        )
        deepest = max(depths.values())
        matched_tokens = blocks.tokens_for(deepest * step)
        if p.min_match_chars > 0 and matched_tokens * CHARS_PER_TOKEN < p.min_match_chars:
            low = min(candidates, key=lambda w: self.recent_qps(w.worker_id, ctx.now))
            qps = self.recent_qps(low.worker_id, ctx.now)
            cached = blocks.tokens_for(depths[low.worker_id] * step)
            reason = (
                f"match of {matched_tokens} tokens below {p.min_match_chars} characters: "
                f"lowest recent rate ({qps:.2f}/s)"
            )
            return Selection(low.worker_id, "low_qps", reason, cached, scores)
        tied = [w.worker_id for w in candidates if depths[w.worker_id] == deepest]
        chosen = (
            tied[0] if len(tied) == 1 else request_rng(ctx.request.request_id, p.seed).choice(tied)
        )
        if deepest:
            tier = "longest_match"
            reason = f"longest match: {deepest} chunks, random among {len(tied)} tied"
        else:
            tier = "no_match"
            reason = f"no chunk matched: random among all {len(tied)}"
        return Selection(chosen, tier, reason, matched_tokens, scores)

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        step = self.chunk_blocks(ctx.blocks.block_tokens)
        self.trie.insert(worker, chunk_hashes(ctx.blocks.hashes, step), ctx.now)
        self._qps[worker] = (
            self.recent_qps(worker, ctx.now) + 1.0 / self.params.qps_window_s,
            ctx.now,
        )

    def on_worker_removed(self, worker: WorkerId) -> None:
        self.trie.remove_worker(worker)
        self._qps.pop(worker, None)
