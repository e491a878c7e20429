"""``prefixrouter``: route where the first token comes soonest, counting cached prefill.

Per candidate ``w`` the cost model (:mod:`prefixrouter.core.cost`) predicts
the TTFT terms (queue wait, prefill of the uncached part, decode impact,
memory risk) and two costs beyond this request's first token. The score is::

    score(w) = ttft(w) + decode_weight * decode(w) + eviction_weight * eviction(w)

* ``decode``: time to generate the expected output on ``w``'s batch.
  ``decode_weight`` depends on the output-length class: small for short
  answers (judged by their first token), 1 for long generations, so long
  generations spread by decode load while short ones follow the cache.
* ``eviction``: the prefill time of the cached blocks that storing the blocks
  ``w`` lacks would evict, once ``w``'s cache (as mirrored by the index) is
  full. It is the price of copying a prefix into another cache, which round
  robin and cache-blind routers pay without seeing it; with room to spare it
  is zero, so replicas warm up in parallel.

A candidate is *warm* when the index says it holds at least
``min_match_tokens`` of the prompt with confidence at least ``min_confidence``
(an affinity whose trust decayed after unexplained misses is scored as cold).

**Tie band**: identical engines' predictions differ by their calibration
scales, so scores within the candidates' calibration disagreement
(``highest / lowest scale - 1``, at most ``tie_band_rel``) of the best count
as equal, and among those the fewest requests in flight wins (then the lowest
score). With one candidate, or scales that agree, the lowest score wins. It
picks among the workers holding the deepest prefix, and among all workers for
a prefix never seen.

Tiers (the one recorded is the chosen worker's):

1. ``exact``: a warm worker holding the deepest prefix any warm worker holds;
2. ``partial``: a warm worker holding less;
3. ``cold``: a worker with no usable prefix;
4. ``cold_pool``: a worker of the configured ``cold_pool`` (below).

Which worker:

* **some worker is warm**: the best of those holding the deepest prefix
  (within the tie band, the fewest in flight), unless a rule below leaves
  it: then the lowest score (margin, maximum wait) or, for a hot prefix, the
  best other worker; either may hold part of the prefix (``partial``) or
  none (``cold``). Under the cold quota every choice is among the workers
  with room.
* **none is warm**: the best worker of the ``cold_pool``, when one is
  configured and that worker's score is within the margin of the best (so
  replicas that hold expensive hot prefixes keep serving them). Else a prefix
  never seen (or ``home_by_hash`` off) goes to the lowest score within the
  tie band, and a prefix seen before that no cache holds any more to its
  rendezvous-hash home among the workers within the margin of the best.

Rules on top of the score, in order:

* **hot prefix**: the demand of the prefix the best warm worker holds (its
  request rate times the engine time per request on a replica that holds it)
  needs more replicas than hold it, at ``hot_prefix_utilization`` each: the
  best other worker is warmed now instead of growing the warm queues. Not while
  the prefix is held only speculatively (its first copy is still being
  prefilled): a second copy would only prefill it again meanwhile. Demand is
  counted per prefix of 1, 2, 4, 8, ... blocks, so a session's history is told
  apart from the system prompt every session shares; a burst is seen from the last
  ``burst_samples`` arrivals, before the decayed rate has grown. The demand
  table is bounded by what the index holds: once it doubles (past
  ``min_tracked_prefixes``), the prefixes no worker holds any more are
  dropped (a prefix evicted everywhere before that counts as never seen), and
  ``max_tracked_prefixes`` caps it (oldest first). A request the engine did no
  prefill for (``on_rejected``) is taken out of the counts again.
* **maximum wait**: warm preference never makes a request wait behind more
  than ``max_warm_wait_s`` of queue (``warm_abandoned``).
* **warm margin**: the best warm worker is kept while its score is within
  ``warm_margin_rel`` of the best candidate's TTFT plus ``warm_margin_abs_s``
  of the best score, scaled by how full the best candidate's cache is.
* **cold quota**: a request that follows a cached prefix may not take a
  worker's last ``cold_reserved_share`` of sequence slots while another
  worker has room, so a continuous hot stream leaves room for unique requests.

Parameters per output class live in :class:`OutputClassParams`; requests with
``max_tokens >= long_output_tokens`` use ``long``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from prefixrouter.core.policy import (
    CandidateScore,
    Policy,
    RoutingContext,
    Selection,
    register,
)
from prefixrouter.core.types import EntrySource, WorkerId, WorkerView

_SPECULATIVE = EntrySource.SPECULATIVE  # a module constant: enum class attributes are slow


@dataclass(frozen=True, slots=True)
class OutputClassParams:
    """Thresholds for one output-length class.

    Attributes:
        warm_margin_rel: Keep a warm worker while its score <= best * (1 + this) + abs.
        warm_margin_abs_s: The absolute part of that margin, seconds.
        max_warm_wait_s: Never keep warm preference past this queue wait.
        decode_weight: Weight of the predicted decode time when ranking workers.
        switch_decode_weight: The same weight when a warm worker is compared
            with a cold one (leaving warm copies the prefix: a lasting cost
            against a transient difference in decode batches).
    """

    warm_margin_rel: float = 0.25
    warm_margin_abs_s: float = 0.05
    max_warm_wait_s: float = 4.0
    decode_weight: float = 0.0
    switch_decode_weight: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefixRouterParams:
    """Parameters of the ``prefixrouter`` policy.

    Attributes:
        short: Thresholds for short answers.
        long: Thresholds for long generations.
        long_output_tokens: ``max_tokens`` from which a request is a long generation.
        min_match_tokens: Matches shorter than this do not make a worker warm.
        min_confidence: Matches trusted less than this are scored as cold.
        cold_reserved_share: Share of each worker's slots warm preference may not fill.
        eviction_weight: Weight of the prefill time of what a copy would evict
            (the chance that the evicted blocks are asked for again).
        min_margin_share: Share of the warm margin kept even when the other
            worker's cache has room (a copy still costs memory and a prefill).
        home_by_hash: Send a prefix that no cache holds to its rendezvous-hash
            home among the workers within the margin of the best.
        hot_prefix_utilization: Per-replica load of one prefix above which it is hot.
        tie_band_rel: Cap on the tie band: scores within the candidates'
            calibration disagreement (at most this share) of the best count as
            equal, and among them the fewest requests in flight wins.
        demand_window_s: Time constant of the per-prefix request-rate estimate.
        burst_samples: Recent arrivals per prefix used to see a burst early.
        reference_batch: Batch size assumed when estimating per-request decode service.
        cold_pool: Pool that takes cold requests ("" = none).
        max_tracked_prefixes: Bound on the demand table (oldest dropped first).
        min_tracked_prefixes: Prefixes the demand table takes beyond twice
            those the index held at its last sweep before it drops those no
            worker holds any more (see ``_sweep_demand``).
    """

    short: OutputClassParams = field(
        default_factory=lambda: OutputClassParams(
            warm_margin_rel=0.25, warm_margin_abs_s=0.05, max_warm_wait_s=4.0, decode_weight=0.2
        )
    )
    long: OutputClassParams = field(
        default_factory=lambda: OutputClassParams(
            warm_margin_rel=0.1,
            warm_margin_abs_s=0.02,
            max_warm_wait_s=2.0,
            decode_weight=1.0,
            switch_decode_weight=1.0,
        )
    )
    long_output_tokens: int = 1024
    min_match_tokens: int = 64
    min_confidence: float = 0.5
    cold_reserved_share: float = 0.2
    eviction_weight: float = 0.5
    min_margin_share: float = 0.5
    home_by_hash: bool = True
    hot_prefix_utilization: float = 1.0
    tie_band_rel: float = 0.1
    demand_window_s: float = 10.0
    burst_samples: int = 8
    reference_batch: int = 32
    cold_pool: str = ""
    max_tracked_prefixes: int = 100_000
    min_tracked_prefixes: int = 4096


@dataclass(slots=True)
class _Demand:
    """Request-rate estimate of one prefix.

    Two estimators, the larger wins: an exponentially decayed count over
    ``demand_window_s`` (steady demand, one float) and the span of the last
    ``burst_samples`` arrivals (a burst is seen after a handful of requests,
    long before the decayed count has grown).
    """

    rate: float
    last: float
    recent: deque[float]


@register
class PrefixRouterPolicy(Policy):
    """Lowest predicted TTFT with bounded warm preference (the default policy)."""

    name = "prefixrouter"
    Params = PrefixRouterParams
    params: PrefixRouterParams

    def __init__(self, params: PrefixRouterParams | None = None) -> None:
        super().__init__(params)
        # Demand per prefix, keyed by the block hash that ends it; see on_routed.
        self._demand: dict[int, _Demand] = {}
        self._sweep_at = self.params.min_tracked_prefixes  # see _sweep_demand

    # ----------------------------------------------------------------- select

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        req = ctx.request
        blocks = ctx.blocks
        prompt = blocks.prompt_tokens
        output = max(1, req.max_tokens)
        cls = p.long if output >= p.long_output_tokens else p.short
        # Engines recompute the last token of a fully cached prompt, so at most
        # the whole blocks before it can be reused.
        bt = blocks.block_tokens
        reusable_cap = int((prompt - 1) // bt * bt) if prompt else 0

        # The loop runs once per candidate on every request: what it reads of
        # the params, the context and the index is bound to locals first.
        scored: list[CandidateScore] = []
        warm_any: list[int] = []  # the warm candidates' indices, in order
        matches = ctx.matches
        index = ctx.index
        predict = ctx.cost.predict
        min_match, min_conf = p.min_match_tokens, p.min_confidence
        decode_weight, eviction_weight = cls.decode_weight, p.eviction_weight
        n_blocks = len(blocks.hashes)
        for i, w in enumerate(candidates):
            wid = w.worker_id
            m = matches.get(wid)
            if m is None:
                held, matched, conf = 0, 0, 0.0
            else:
                held, conf = m.blocks, m.confidence
                matched = int(held * bt)  # blocks.tokens_for(held), capped:
                if reusable_cap < matched:
                    matched = reusable_cap
            warm = matched >= min_match and conf >= min_conf
            # Storing the blocks w lacks evicts as many cached ones once its cache is full.
            lacking = n_blocks - held - index.free_blocks(wid)
            evicted = int(lacking * bt) if lacking > 0 else 0  # blocks.tokens_for(lacking)
            if warm:
                terms = predict(w, prompt, matched, conf, output, evicted)
                warm_any.append(i)
            else:
                terms = predict(w, prompt, 0, 0.0, output, evicted)
            score = (
                terms.ttft_s + decode_weight * terms.decode_s + eviction_weight * terms.eviction_s
            )
            scored.append(CandidateScore(wid, matched, conf, terms, score))

        candidates_out = tuple(scored)
        everyone = range(len(scored))
        # Cold quota: a request that follows a cached prefix may not take a
        # worker's last `cold_reserved_share` of slots while a worker with room
        # for it exists, so a continuous hot stream leaves room for cold requests.
        eligible: Sequence[int] = everyone
        if warm_any and p.cold_reserved_share > 0:
            limit_share = 1.0 - p.cold_reserved_share
            with_room = [
                i for i, w in enumerate(candidates) if w.in_flight < limit_share * w.max_slots
            ]
            # (When every candidate has room, `everyone` stands for them all.)
            if with_room and len(with_room) < len(scored):
                eligible = with_room
        best_i = _argmin(scored, eligible)
        warm_idx = [i for i in warm_any if i in eligible] if eligible is not everyone else warm_any

        if not warm_idx:
            if warm_any:
                c = scored[best_i]
                w = candidates[warm_any[0]]
                reason = (
                    f"cold quota: warm workers hold {w.in_flight} of {w.max_slots} slots; "
                    "lowest predicted TTFT among workers with room"
                )
                return Selection(c.worker_id, "cold", reason, 0, candidates_out)
            return self._select_cold(ctx, candidates, scored, best_i, candidates_out)

        deepest = max([scored[i].matched_tokens for i in warm_idx])
        # The workers holding the deepest prefix: leaving them for anyone else
        # (cold, or holding a shorter prefix) recomputes part of the prompt.
        exact_idx = [i for i in warm_idx if scored[i].matched_tokens >= deepest]
        bw = _spread(scored, candidates, exact_idx, p.tie_band_rel, _argmin(scored, exact_idx))
        best, best_warm = scored[best_i], scored[bw]
        abandoned = False
        assert best_warm.terms is not None
        other_idx = [i for i in eligible if i not in exact_idx]
        ci = _argmin(scored, other_idx) if other_idx else -1
        other_terms = scored[ci].terms if ci >= 0 else None
        rate, needed = 0.0, 0
        held_match = ctx.matches.get(best_warm.worker_id)
        # While the only copies of the prefix are still being prefilled (known
        # from routing alone, not yet confirmed by the engine), a second copy
        # would pay the same prefill again while the first finishes: queueing
        # behind the first copy is the cheaper wait.
        settled = held_match is not None and held_match.source is not _SPECULATIVE
        if settled and other_terms is not None and other_terms.queue_wait_s <= cls.max_warm_wait_s:
            rate, needed = self._replicas_needed(ctx, candidates[bw], best_warm, output)
        if needed > len(exact_idx):
            # Hot prefix: its demand needs more replicas than hold it. Warm the
            # best other one now rather than queue on those that hold it.
            assert ci >= 0
            chosen = ci
            reason = (
                f"hot prefix: {rate:.1f} req/s needs {needed} replicas, "
                f"{len(exact_idx)} hold it; warming {scored[ci].worker_id}"
            )
        elif bw == best_i:
            chosen = bw
            reason = "lowest predicted cost"
        else:
            # Leaving the deepest prefix copies it: a lasting cost, while
            # a difference in decode batches evens out within one request's
            # lifetime. So this comparison weighs decode by the class's
            # `switch_decode_weight` (0 for short answers), not `decode_weight`.
            pressure = max(p.min_margin_share, _cache_pressure(ctx, best.worker_id))
            warm_switch = self._switch_score(best_warm, cls)
            cold_switch = self._switch_score(best, cls)
            assert best.terms is not None
            limit = cold_switch + pressure * (
                best.terms.ttft_s * cls.warm_margin_rel + cls.warm_margin_abs_s
            )
            if (
                best_warm.terms.queue_wait_s > cls.max_warm_wait_s
                and best.terms.queue_wait_s <= cls.max_warm_wait_s
                and best.terms.ttft_s < best_warm.terms.ttft_s
            ):
                # Only when leaving actually avoids the wait and brings the
                # first token sooner: under overload every queue is long, and
                # a copy would only add prefill work.
                chosen, abandoned = best_i, True
                wait_ms = best_warm.terms.queue_wait_s * 1e3
                reason = (
                    f"left warm {best_warm.worker_id}: queue wait {wait_ms:.0f} ms"
                    f" > max {cls.max_warm_wait_s * 1e3:.0f} ms"
                )
            elif warm_switch <= limit:
                chosen = bw
                reason = (
                    f"warm within margin: {warm_switch * 1e3:.0f} ms <= "
                    f"{limit * 1e3:.0f} ms (best cold {best.worker_id} {cold_switch * 1e3:.0f} ms)"
                )
            else:
                chosen = best_i
                reason = (
                    f"warm {best_warm.worker_id} predicted {warm_switch * 1e3:.0f} ms, "
                    f"beyond margin of {best.worker_id} {cold_switch * 1e3:.0f} ms"
                )
        c = scored[chosen]
        if chosen in warm_any:
            tier = "exact" if c.matched_tokens >= deepest else "partial"
            cached = c.matched_tokens
            reason = f"{reason}; {cached} of {prompt} tokens cached"
        else:
            tier, cached = "cold", 0
        return Selection(c.worker_id, tier, reason, cached, candidates_out, abandoned)

    def _select_cold(
        self,
        ctx: RoutingContext,
        candidates: Sequence[WorkerView],
        scored: list[CandidateScore],
        best_i: int,
        out: tuple[CandidateScore, ...],
    ) -> Selection:
        pool = self.params.cold_pool
        if pool:
            pool_idx = [i for i, w in enumerate(candidates) if w.pool == pool]
            if pool_idx:
                pi = _argmin(scored, pool_idx)
                cls = self.params.short
                limit = self._margin_limit(scored[best_i], cls, 1.0)
                if scored[pi].score <= limit:
                    return Selection(
                        scored[pi].worker_id,
                        "cold_pool",
                        f"no reusable prefix anywhere: cold pool {pool!r}",
                        0,
                        out,
                    )
        if (
            not self.params.home_by_hash
            or not ctx.blocks.hashes
            or ctx.blocks.hashes[0] not in self._demand
        ):
            # A prefix never seen: any worker is as good as its prediction, and
            # predictions of near-identical candidates differ by calibration
            # noise: within the tie band the fewest requests in flight decides,
            # so a burst of unique requests spreads (see _spread).
            everyone = range(len(scored))  # none is warm, so best_i is the best of all
            pick = _spread(scored, candidates, everyone, self.params.tie_band_rel, best_i)
            reason = "no reusable prefix anywhere: lowest predicted TTFT"
            if pick != best_i:
                reason = "no reusable prefix anywhere: fewest in flight among near-equal"
            return Selection(scored[pick].worker_id, "cold", reason, 0, out)
        # A prefix seen before that no cache holds any more (evicted
        # everywhere) goes to its home among the workers within the margin of
        # the best, by rendezvous hashing of its first block: the same worker
        # each time, so prefixes partition across caches instead of scattering
        # over all of them (the scattering is what makes caches thrash under
        # pressure). A prefix never seen before is handled above (tie band).
        limit = self._margin_limit(scored[best_i], self.params.short, 1.0)
        near = [i for i in range(len(scored)) if scored[i].score <= limit]
        first = ctx.blocks.hashes[0]
        home = max(near, key=lambda i: _rendezvous(first, scored[i].worker_id))
        return Selection(
            scored[home].worker_id,
            "cold",
            f"no reusable prefix anywhere: its home among {len(near)} within margin",
            0,
            out,
        )

    def _switch_score(self, c: CandidateScore, cls: OutputClassParams) -> float:
        """The score used to compare a warm worker with a cold one (see select)."""
        t = c.terms
        assert t is not None
        return (
            t.ttft_s
            + cls.switch_decode_weight * t.decode_s
            + self.params.eviction_weight * t.eviction_s
        )

    @staticmethod
    def _margin_limit(best: CandidateScore, cls: OutputClassParams, pressure: float) -> float:
        """The highest score a warm worker may have and still be preferred.

        The relative part of the margin applies to the best candidate's
        predicted TTFT, not its whole score, so weighing decode time does not
        widen it; ``pressure`` in [0, 1] scales the whole margin.
        """
        ttft = best.terms.ttft_s if best.terms is not None else best.score
        return best.score + pressure * (ttft * cls.warm_margin_rel + cls.warm_margin_abs_s)

    def _replicas_needed(
        self, ctx: RoutingContext, worker: WorkerView, warm: CandidateScore, output: int
    ) -> tuple[float, int]:
        """The prefix's request rate and how many replicas it needs (0 if unknown).

        Engine time per request on a warm replica: its uncached prefill plus
        its share of batched decoding at ``reference_batch``. Demand is the
        prefix's rate times that; it needs ``ceil(demand / hot_prefix_utilization)``
        replicas.
        """
        blocks = ctx.blocks
        matched = warm.matched_tokens
        depth = int(matched // blocks.block_tokens)
        if depth <= 0 or warm.terms is None:
            return 0.0, 0
        # The demand of the prefix this request would reuse, at the deepest
        # tracked depth it covers (a session's history, not the system prompt
        # every session shares).
        rate = self.prefix_rate(blocks.hashes[(1 << (depth.bit_length() - 1)) - 1], ctx.now)
        if rate <= 0.0:
            return rate, 0
        p = self.params
        profile = worker.profile
        prompt = blocks.prompt_tokens
        ref = max(1, min(p.reference_batch, worker.max_slots))
        context = prompt + output / 2.0
        per_token = profile.decode_step_time(ref, ref * context) / ref
        # The engine time of a request on a replica that holds the prefix: its
        # uncached suffix only. Not the confidence-weighted expectation of the
        # score, which charges a share of the whole prompt's prefill to every
        # request and, for long documents, calls any stream of questions hot.
        scale = warm.terms.scale
        prefill = profile.prefill_time(max(0, prompt - matched), matched) * scale
        service = prefill + output * per_token
        demand = rate * service
        return rate, math.ceil(demand / p.hot_prefix_utilization)

    # ------------------------------------------------------------------ hooks

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        # Count the request toward each of its prefixes of 1, 2, 4, 8, ...
        # blocks: a demand tree of log2(blocks) counters per request, so the
        # demand of whatever prefix a later request matches can be read back.
        p = self.params
        tau = p.demand_window_s
        now = ctx.now
        demand = self._demand
        hashes = ctx.blocks.hashes
        n = len(hashes)
        depth = 1
        while depth <= n:
            key = hashes[depth - 1]
            d = demand.get(key)
            if d is None:
                if len(demand) >= self._sweep_at:
                    demand = self._sweep_demand(ctx)
                if len(demand) >= p.max_tracked_prefixes:
                    demand.pop(next(iter(demand)))  # the oldest tracked prefix
                recent: deque[float] = deque(maxlen=p.burst_samples)
                d = demand[key] = _Demand(0.0, now, recent)
            # max(0, elapsed): a caller's clock that steps back must not overflow exp.
            elapsed = now - d.last
            elapsed = elapsed if elapsed > 0.0 else 0.0
            d.rate = d.rate * math.exp(-elapsed / tau) + 1.0 / tau
            d.last = now
            d.recent.append(now)
            depth <<= 1

    def on_rejected(self, ctx: RoutingContext, worker: WorkerId) -> None:
        # The engine did no prefill for it: take the arrival back out of each
        # prefix's demand, so refused requests neither make a prefix hot nor
        # make a new prefix "seen before" (home_by_hash) for its retry.
        tau = self.params.demand_window_s
        t = ctx.now
        demand = self._demand
        hashes = ctx.blocks.hashes
        n = len(hashes)
        depth = 1
        while depth <= n:
            key = hashes[depth - 1]
            depth <<= 1
            d = demand.get(key)
            if d is None:
                continue  # dropped from the table since
            # The arrival added 1/tau at t; the estimate has decayed since, to d.last.
            rate = d.rate - math.exp(-max(0.0, d.last - t) / tau) / tau
            d.rate = rate if rate > 0.0 else 0.0
            if t in d.recent:
                d.recent.remove(t)
            if not d.recent and d.rate * tau < 1e-9:
                del demand[key]  # no other arrival left: as if never seen

    def _sweep_demand(self, ctx: RoutingContext) -> dict[int, _Demand]:
        """Drop the demand of prefixes no worker holds any more; returns the table.

        Demand is read only for a prefix a warm worker holds (``_replicas_needed``)
        and, for ``home_by_hash``, whether a first block was seen: a table
        of every prefix ever routed grows with the request rate, not with the
        caches. Run when the table reaches twice what survived the last sweep
        plus ``min_tracked_prefixes``, so the work is amortized O(1) per new
        prefix and the table stays within about twice the prefixes the index
        holds.
        """
        holds = ctx.index.holds
        kept = {key: d for key, d in self._demand.items() if holds(key)}  # type: ignore[arg-type]
        self._demand = kept
        self._sweep_at = 2 * len(kept) + self.params.min_tracked_prefixes
        return kept

    def prefix_rate(self, last_block: int, now: float) -> float:
        """Requests per second for the prefix ending at block hash ``last_block``.

        Only prefixes of a power-of-two number of blocks are tracked (see
        :meth:`on_routed`); others read 0. See :class:`_Demand` for the estimate.
        """
        d = self._demand.get(last_block)
        if d is None:
            return 0.0
        steady = d.rate * math.exp(-max(0.0, now - d.last) / self.params.demand_window_s)
        recent = d.recent
        if len(recent) == recent.maxlen and now > recent[0]:
            return max(steady, (len(recent) - 1) / (now - recent[0]))
        return steady


def _cache_pressure(ctx: RoutingContext, worker: WorkerId) -> float:
    """How full ``worker``'s cache would be with this prompt added, in [0, 1] (per the index).

    The warm margin is the price of copying a prefix into another cache: a
    worker with room takes the copy without evicting anything (no margin, so
    cold replicas warm up in parallel, as round robin would); a full one would
    evict other prefixes (the whole margin).
    """
    index = ctx.index
    capacity = index.capacity(worker)
    if capacity <= 0:
        return 1.0
    return min(1.0, (index.blocks_of(worker) + len(ctx.blocks.hashes)) / capacity)


def _rendezvous(block: int, worker: WorkerId) -> int:
    """Highest-random-weight score of (prefix, worker): stable across processes."""
    return int(xxhash.xxh3_64_intdigest(worker.encode("utf-8"), block & 0xFFFF_FFFF_FFFF_FFFF))


def _spread(
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    indices: Sequence[int] | range,
    band: float,
    best: int,
) -> int:
    """The best of ``indices``, where scores within a tie band of the best count as equal.

    ``best`` is the index of the lowest score among ``indices`` (:func:`_argmin`;
    the cold path knows it already).

    Identical engines' predictions differ by their calibration (each learns
    its own scale from noisy observations, about 20% apart live), and a
    router that always takes the lowest prediction keeps feeding the worker
    whose scale happens to be lowest until its queue shows. The tie band is
    how far the candidates' calibration scales disagree, at most ``band``
    (relative); among candidates whose scores are within it of the best, the
    one with the fewest requests in flight wins, then the lowest score.
    """
    # The band is the calibration disagreement among these candidates, capped:
    # when every worker's scale agrees (a fleet whose profile is right, or the
    # simulator) predictions are trusted as they are.
    # (The lowest and highest scale in one pass: this runs on every request.)
    lowest, highest, scales = math.inf, -math.inf, 0
    for i in indices:
        t = scored[i].terms
        if t is not None:
            scales += 1
            s = t.scale
            if s < lowest:
                lowest = s
            if s > highest:
                highest = s
    if scales < 2 or lowest <= 0:
        return best
    band = min(band, highest / lowest - 1.0)
    if band <= 0:
        return best
    limit = scored[best].score * (1.0 + band)
    near = [i for i in indices if scored[i].score <= limit]
    return min(near, key=lambda i: (candidates[i].in_flight, scored[i].score))


def _argmin(scored: Sequence[CandidateScore], indices: Sequence[int] | range) -> int:
    """Index of the lowest score; ties go to the earliest (deterministic)."""
    best = -1
    best_score = math.inf
    for i in indices:
        s = scored[i].score
        if s < best_score:
            best, best_score = i, s
    return best
