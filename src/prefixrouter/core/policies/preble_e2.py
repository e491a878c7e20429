"""``preble_e2``: Preble's E2 scheduler (exploitation or exploration, ICLR 2025).

Per PEERS.md, Preble keeps one global token radix tree; each node records the
GPUs holding it and its recent hit count. For a request of ``T`` prompt tokens
whose longest cached prefix on any candidate GPU is ``cached``:

* **exploit** if ``cached > T - cached``: among the GPUs holding that deepest
  prefix, the cheapest, ``load(g) + prefill_time(uncached on g)``;
* **explore** otherwise: ``argmin_g load(g) + eviction_cost(g) + prefill_time(uncached on g)``;
* **rebalance**: when the GPU exploit picked is the busiest and its load exceeds
  ``rebalance_ratio`` (1.5) times the lightest GPU's, the lightest GPU instead.

where

* ``load(g)`` = the prefill time of the tokens each request routed to ``g`` in
  the last ``load_window_s`` seconds missed (windowed), plus the time its
  running batch needs to finish decoding (``decode_step_time(decoding,
  context) * decode_tokens_remaining / decoding``);
* ``eviction_cost(g)``: if the uncached blocks exceed ``g``'s free KV blocks
  (the view's capacity minus the blocks the tree places on ``g``), the
  prefill time of the least recently used blocks LRU would evict to make
  room, each weighted by its recent hit count (decayed over ``load_window_s``);
* prefill times come from the worker's :class:`~prefixrouter.core.types.SpeedProfile`
  (``prefill_time(new, context)``).

Times are seconds. The window stores per request its missed tokens ``n`` and
``n * (context + n / 2)``; since ``prefill_time`` is affine in those, three
running sums give the windowed prefill time on any GPU's profile exactly.

Approximations: the tree is over the request's chained block hashes
(:class:`~prefixrouter.core.policies.sglang_cache_aware.TenantTree`), so a
node is a block (16 tokens), not a variable-length radix edge. ``on_routed``
does not see worker views, so the tree's per-GPU LRU capacity is the
parameter ``gpu_capacity_tokens`` (0 = bounded only by ``max_nodes``); set it to
the engines' KV size for a faithful mirror. Preble's post-assignment load
adjustment (moving subtrees between GPUs) is reduced to the rebalance rule
above, applied to exploit decisions.

``CandidateScore``: ``matched_tokens`` per the tree, ``score`` = the explore
cost in seconds. ``predicted_cached_tokens`` = the chosen GPU's match.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixrouter.core.policies.common import TenantTree
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import BlockHash, SpeedProfile, WorkerId, WorkerView


@dataclass(frozen=True, slots=True)
class PrebleE2Params:
    """Parameters of ``preble_e2``.

    Attributes:
        load_window_s: Window of the prefill load and time constant of hit counts.
        rebalance_ratio: Busiest / lightest load beyond which exploit is redirected.
        gpu_capacity_tokens: Tokens the tree keeps per GPU (LRU; 0 = unbounded).
        max_nodes: Bound on (node, GPU) entries in the tree.
        max_window_entries: Bound on requests remembered per GPU for the load window.
    """

    load_window_s: float = 180.0
    rebalance_ratio: float = 1.5
    gpu_capacity_tokens: int = 0
    max_nodes: int = 2_000_000
    max_window_entries: int = 100_000


@dataclass(slots=True)
class _Window:
    """Requests routed to one GPU: (time, missed tokens, missed * (context + missed / 2))."""

    entries: deque[tuple[float, int, float]] = field(default_factory=deque)
    count: int = 0
    tokens: float = 0.0
    attended: float = 0.0

    def add(self, t: float, n: int, q: float) -> None:
        self.entries.append((t, n, q))
        self.count += 1
        self.tokens += n
        self.attended += q

    def drop_before(self, cutoff: float, keep: int) -> None:
        entries = self.entries
        while entries and (entries[0][0] <= cutoff or len(entries) > keep):
            _, n, q = entries.popleft()
            self.count -= 1
            self.tokens -= n
            self.attended -= q

    def prefill_time(self, profile: SpeedProfile, cutoff: float) -> float:
        count, tokens, attended = self.count, self.tokens, self.attended
        for t, n, q in self.entries:  # stale entries not yet dropped by on_routed
            if t > cutoff:
                break
            count, tokens, attended = count - 1, tokens - n, attended - q
        if count <= 0:
            return 0.0
        return (
            count * profile.prefill_overhead_s
            + profile.prefill_s_per_token * tokens
            + profile.prefill_s_per_token_context * attended
        )


@register
class PrebleE2(Policy):
    """Exploit a long cached prefix, else explore the cheapest GPU."""

    name = "preble_e2"
    Params = PrebleE2Params
    params: PrebleE2Params

    def __init__(self, params: PrebleE2Params | None = None) -> None:
        super().__init__(params)
        self.tree = TenantTree(self.params.max_nodes)
        self._hits: dict[BlockHash, tuple[float, float]] = {}  # node -> (hits, as of)
        self._windows: dict[WorkerId, _Window] = {}

    def hits(self, block: BlockHash, now: float) -> float:
        """The node's recent hit count as of ``now`` (exponentially decayed)."""
        h = self._hits.get(block)
        return h[0] * math.exp(-(now - h[1]) / self.params.load_window_s) if h else 0.0

    def load(self, w: WorkerView, now: float) -> float:
        """Windowed prefill time of missed tokens plus the running batch's decode time."""
        window = self._windows.get(w.worker_id)
        cutoff = now - self.params.load_window_s
        prefill = window.prefill_time(w.profile, cutoff) if window is not None else 0.0
        decode = 0.0
        if w.decoding > 0:
            step = w.profile.decode_step_time(w.decoding, w.context_tokens)
            decode = step * w.decode_tokens_remaining / w.decoding
        return prefill + decode

    def eviction_cost(self, w: WorkerView, uncached_tokens: int, bt: float, now: float) -> float:
        """Hit-weighted prefill time of what LRU would evict to fit ``uncached_tokens``."""
        capacity = w.kv_capacity_blocks * w.block_size / bt
        free = max(0.0, capacity - self.tree.size(w.worker_id))
        need = math.ceil(uncached_tokens / bt - free)
        if need <= 0:
            return 0.0
        victims = self.tree.oldest(w.worker_id, need)
        if not victims:
            return 0.0
        per_block = w.profile.prefill_time(len(victims) * bt) / len(victims)
        return per_block * sum(self.hits(b, now) for b in victims)

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        blocks = ctx.blocks
        bt, prompt, now = blocks.block_tokens, blocks.prompt_tokens, ctx.now
        depths = self.tree.depths(blocks.hashes, [w.worker_id for w in candidates])
        matched = {g: min(prompt, blocks.tokens_for(d)) for g, d in depths.items()}
        loads = [self.load(w, now) for w in candidates]
        prefills = [
            w.profile.prefill_time(prompt - matched[w.worker_id], matched[w.worker_id])
            for w in candidates
        ]
        explore = [
            load + self.eviction_cost(w, prompt - matched[w.worker_id], bt, now) + pf
            for w, load, pf in zip(candidates, loads, prefills, strict=True)
        ]
        scores = tuple(
            CandidateScore(w.worker_id, matched[w.worker_id], score=c)
            for w, c in zip(candidates, explore, strict=True)
        )

        def pick(i: int, tier: str, reason: str) -> Selection:
            c = scores[i]
            return Selection(c.worker_id, tier, reason, c.matched_tokens, scores)

        cached = max(matched.values())
        lightest = min(range(len(candidates)), key=loads.__getitem__)
        if cached > prompt - cached:
            holders = [i for i, w in enumerate(candidates) if matched[w.worker_id] == cached]
            i = min(holders, key=lambda k: loads[k] + prefills[k])
            if loads[i] >= max(loads) and loads[i] > p.rebalance_ratio * loads[lightest]:
                return pick(
                    lightest,
                    "rebalance",
                    f"exploit target {candidates[i].worker_id} is the busiest "
                    f"({loads[i]:.3f} s > {p.rebalance_ratio:g} x {loads[lightest]:.3f} s): "
                    "lightest",
                )
            return pick(
                i,
                "exploit",
                f"cached {cached} > uncached {prompt - cached} tokens: cheapest holder",
            )
        i = min(range(len(candidates)), key=explore.__getitem__)
        return pick(
            i,
            "explore",
            f"cached {cached} <= uncached {prompt - cached} tokens: "
            f"lowest load + eviction + prefill ({explore[i]:.3f} s)",
        )

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        p = self.params
        blocks = ctx.blocks
        now = ctx.now
        hashes = blocks.hashes
        depth = self.tree.depths(hashes, [worker])[worker]
        hit = min(blocks.prompt_tokens, blocks.tokens_for(depth))
        missed = blocks.prompt_tokens - hit
        window = self._windows.get(worker)
        if window is None:
            window = self._windows[worker] = _Window()
        if missed > 0:
            window.add(now, missed, missed * (hit + missed / 2.0))
        cutoff = now - p.load_window_s
        for w in self._windows.values():
            w.drop_before(cutoff, p.max_window_entries)
        # Every node on the request's path is hit once more.
        decay = p.load_window_s
        for h in hashes:
            old = self._hits.get(h)
            count = old[0] * math.exp(-(now - old[1]) / decay) if old else 0.0
            self._hits[h] = (count + 1.0, now)
        cap = None
        if p.gpu_capacity_tokens > 0:
            cap = max(1, int(p.gpu_capacity_tokens / blocks.block_tokens))
        self.tree.insert(worker, hashes, now, cap=cap)
        self._prune_hits()

    def on_worker_removed(self, worker: WorkerId) -> None:
        self.tree.remove_worker(worker)
        self._windows.pop(worker, None)
        self._prune_hits(force=True)

    def _prune_hits(self, force: bool = False) -> None:
        # Hit counts of nodes no GPU holds any more are dropped once they
        # outnumber the live nodes: amortized O(1) per insert, memory bounded
        # by twice the tree.
        if force or len(self._hits) > 2 * self.tree.node_count() + 1024:
            has = self.tree.has_node
            self._hits = {h: v for h, v in self._hits.items() if has(h)}
