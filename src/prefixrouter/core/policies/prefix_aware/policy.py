""":class:`PrefixAwarePolicy`: the steps composed, and the hooks that keep its state."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import xxhash

from prefixrouter.core.bucket import TokenBucket
from prefixrouter.core.policies.prefix_aware.choice import Choice, argmin, cache_pressure
from prefixrouter.core.policies.prefix_aware.cold_path import (
    cold_pool_rule,
    new_home_rule,
    rendezvous_home,
)
from prefixrouter.core.policies.prefix_aware.copies import (
    copy_room_filter,
    copy_rule,
    hot_prefix_rule,
    idle_copy_rule,
    least_holder_share,
    pinned_share,
)
from prefixrouter.core.policies.prefix_aware.demand import (
    Demand,
    Reuse,
    reuse_mark,
    tracked_blocks,
    tracked_key,
)
from prefixrouter.core.policies.prefix_aware.params import PrefixAwareParams
from prefixrouter.core.policies.prefix_aware.picker import (
    calibration_band,
    deepest_holders,
    holder_kv_wait_rank,
    tie_band_picker,
)
from prefixrouter.core.policies.prefix_aware.rules import (
    first_prefill_rule,
    holder_band_rule,
    max_wait_rule,
    no_room_rule,
    prefill_in_progress_rule,
    switch_externality,
    warm_margin_rule,
)
from prefixrouter.core.policies.prefix_aware.scorer import cold_quota_filter, score_candidates
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import EntrySource, WorkerId, WorkerView

_SPECULATIVE = EntrySource.SPECULATIVE  # a module constant: enum class attributes are slow


@register
class PrefixAwarePolicy(Policy):
    """Lowest predicted TTFT with bounded warm preference (the default policy)."""

    name = "prefix_aware"
    Params = PrefixAwareParams
    params: PrefixAwareParams

    def __init__(self, params: PrefixAwareParams | None = None) -> None:
        super().__init__(params)
        # Demand per prefix, keyed by the block hash that ends it; see on_routed.
        self._demand: dict[int, Demand] = {}
        self._sweep_at = self.params.min_tracked_prefixes  # see _sweep_demand
        # Proactive copies' budget per worker (admit_warm_up).
        self._copy_budget: dict[WorkerId, TokenBucket] = {}
        # Every routing of the fleet (peers' too), for the arrivals a copy delays.
        self._arrivals = Demand(0.0, 0.0, deque(maxlen=0))
        # New content not yet reused: its marking block hash -> the head's
        # record (see _count_reuse); oldest first, for the bound.
        self._unreused: dict[int, Reuse] = {}
        self._root_reuse = Reuse()  # requests that matched nothing

    # ----------------------------------------------------------------- select

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        """Scorer, candidate filter, picker, then the rules (see the module docstring)."""
        p = self.params
        output = ctx.output_tokens
        cls = p.long if output >= p.long_output_tokens else p.short
        # 1. Scorer, then 2. the candidate filter (the cold quota).
        scored, warm = score_candidates(ctx, candidates, p, cls, output)
        out = tuple(scored)
        eligible = cold_quota_filter(candidates, warm, p.cold_reserved_share)
        best = argmin(scored, eligible)
        warm_ok = warm if len(eligible) == len(scored) else [i for i in warm if i in eligible]
        if not warm:
            return self._select_cold(ctx, candidates, scored, best, out)
        if not warm_ok:
            w = candidates[warm[0]]
            reason = (
                f"cold quota: warm workers hold {w.in_flight} of {w.max_slots} slots; "
                "lowest predicted TTFT among workers with room"
            )
            return _selection(scored, warm, 0, Choice(best, reason), 0, out)
        # 3. Picker: among the eligible warm workers holding the deepest prefix.
        deepest, holders = deepest_holders(scored, warm_ok)
        if p.holder_kv_wait and holder_kv_wait_rank(scored, holders):
            best = argmin(scored, eligible)
            out = tuple(scored)
        salt = _request_salt(ctx)
        band = calibration_band(scored, holders, p.tie_band_rel)
        picked = tie_band_picker(
            scored, candidates, holders, band, argmin(scored, holders), salt,
            self._ranks_one_off(ctx, band, salt),
        )  # fmt: skip
        # 4. The rules, in order; each may leave the picker's choice.
        picked_id = scored[picked].worker_id
        settled = self._settled(ctx, picked_id)

        def room(beside_holders: bool = False) -> list[int]:
            return copy_room_filter(
                candidates, scored, eligible, holders, ctx.blocks.prompt_tokens,
                p.copy_max_kv_share, beside_holders,
            )  # fmt: skip

        # The room filter only where a rule reads it: the hot-prefix rule (a
        # settled copy; an unsettled one never warms another), and the no-room
        # rule once its cheaper conditions hold.
        roomy = room() if settled else None

        def demand() -> tuple[float, int]:
            return self._replicas_needed(ctx, candidates[picked], scored[picked], output)

        # The hot-prefix rule reads room beside the holders (a demanded copy
        # less full than every holder beats waiting for memory on one). Only
        # holders pinned past the share can let in a worker the share kept
        # out, so the filter runs again only then (every request routes here).
        hot_room: Sequence[int] = eligible if roomy is None else roomy
        least = 0.0
        if roomy is not None and p.copy_room_beside_holders:
            least = least_holder_share(candidates, scored, holders)
            if least > p.copy_max_kv_share:
                hot_room = room(True)
        choice = hot_prefix_rule(scored, hot_room, holders, settled, cls, demand)
        if choice is not None and roomy is not None and choice.index not in roomy:
            choice = Choice(
                choice.index,
                f"{choice.reason} (room beside its holders: "
                f"{pinned_share(candidates, scored, choice.index, ctx.blocks.prompt_tokens):.0%}"
                f" pinned with the copy, the holders at least {least:.0%})",
            )
        # A copy the router can make itself: no user request pays its prefill.
        copyable = (
            p.proactive_copy
            and scored[picked].matched_tokens >= p.copy_min_prefix_share * ctx.blocks.prompt_tokens
        )
        if choice is None and copyable and roomy is not None and p.idle_copy:
            tracked = tracked_blocks(ctx.blocks, scored[picked].matched_tokens)
            tracked_tokens = tracked * ctx.blocks.block_tokens
            choice = idle_copy_rule(
                scored, candidates, roomy,
                [i for i in warm if scored[i].matched_tokens >= tracked_tokens], picked, cls,
                ctx.blocks.prompt_tokens, 1.0 - p.copy_max_kv_share,
                lambda: self._traffic_share(ctx, tracked),
            )  # fmt: skip
        copy: Choice | None = None
        if choice is not None and copyable:
            # The router warms the copy itself; this request is routed by the
            # rules below as if no copy were due, then by the copy rule.
            copy, choice = choice, None
        if (
            choice is None
            and p.earliest_prefill
            and len(holders) > 1
            and not settled
            and deepest >= p.earliest_prefill_min_share * ctx.blocks.prompt_tokens
            and candidates[best].in_flight  # an idle best: prefill_in_progress_rule's case
            and not any(self._settled(ctx, scored[i].worker_id) for i in holders)
        ):
            choice = first_prefill_rule(scored, candidates, holders, best)
        if choice is None and picked == best:  # the best score overall: nothing to weigh
            choice = Choice(picked, "lowest predicted cost")
        if choice is None:
            # The prefill a switch adds delays the requests that queue after
            # it: both rules that weigh a switch (the maximum wait here, the
            # warm margin below, reached only through this branch) charge it.
            arrival = self._arrival_rate(ctx, scored[picked])  # reused below
            own_rate = arrival[0]
            # Deliberately the fleet's rate per worker less the prefix's
            # whole rate, not (fleet - own) / workers: a hot document's copy
            # is then charged no drain while it brings most of the traffic.
            # The per-worker share of the others' rate charged doc-qa's
            # copies and kept documents on their holders' queues (load 0.9,
            # seeds 0-3: 200 -> 300 ms; benchmarks/tried/).
            per_worker = self._steady_rate(self._arrivals, ctx.now) / len(candidates)
            external = switch_externality(
                scored[picked].terms,
                scored[best].terms,
                candidates[picked].waiting,
                candidates[best].waiting,
                p.switch_backlog_weight,
                other_rate=per_worker - own_rate if per_worker > own_rate else 0.0,
                own_rate=own_rate,
            )
            choice = max_wait_rule(scored, picked, best, cls, external) or no_room_rule(
                scored,
                picked,
                best,
                holders,
                room if roomy is None else lambda: roomy,
                lambda: demand()[1],
            )
        # Not when a copy is due: the copy rule below decides who makes it.
        # (choice is None here only if it was above: ``arrival`` is set.)
        if (
            choice is None
            and copy is None
            and p.wait_on_prefill
            and candidates[best].in_flight == 0
        ):
            choice = prefill_in_progress_rule(
                scored, candidates[picked], picked, best, cls, p.eviction_weight,
                *arrival,
            )  # fmt: skip
        if choice is None and best in holders:
            # No copy at stake: the best holds the deepest prefix too.
            choice = holder_band_rule(scored, picked, best, cls, band, p.eviction_weight)
        if choice is None:
            pressure = cache_pressure(ctx.index, scored[best].worker_id, len(ctx.blocks.hashes))
            choice = warm_margin_rule(
                scored, picked, best, cls, max(p.min_margin_share, pressure), p.eviction_weight,
                external,
            )  # fmt: skip
        if copy is not None:
            choice = copy_rule(scored, choice, copy)
        sel = _selection(scored, warm, deepest, choice, ctx.blocks.prompt_tokens, out)
        if (
            copy is not None
            and copy.index != choice.index  # else this request warms it
            and candidates[copy.index].pending_prefill_tokens == 0
        ):
            # Not into a worker with a prefill pending: a
            # chunked-prefill engine prefills every admitted request's chunk
            # in one step and each first token comes at its end, so the copy
            # would delay those users' first tokens by its own prefill. The
            # next request that calls for the copy asks again.
            sel.warm_up = scored[copy.index].worker_id
            sel.reason = f"{sel.reason}; {copy.reason} with a prefill-only copy"
        return sel

    def _arrival_rate(self, ctx: RoutingContext, warm: CandidateScore) -> tuple[float, int]:
        """This request's prefix's arrival rate, from its last arrivals, this one included,
        and how many of those recent arrivals there were (0 if none is tracked).

        The prefix is the one the warm candidate holds, at the deepest tracked
        depth it covers (as :meth:`_replicas_needed` reads it). ``k`` recorded
        arrivals and this one make ``k`` gaps since the oldest: ``k / span``,
        from the first repeat on, so a prefix whose first prefill is still
        running already has a rate (the decayed count, if higher, wins).
        """
        blocks = ctx.blocks
        depth = int(warm.matched_tokens // blocks.block_tokens)
        if depth <= 0:
            return 0.0, 0
        d = self._demand.get(tracked_key(blocks.hashes, depth))
        if d is None:
            return 0.0, 0
        now = ctx.now
        rate = self._steady_rate(d, now)
        recent = d.recent
        if recent and now > recent[0]:
            gaps = len(recent) / (now - recent[0])
            rate = gaps if gaps > rate else rate
        return rate, len(recent)

    def _select_cold(
        self,
        ctx: RoutingContext,
        candidates: Sequence[WorkerView],
        scored: list[CandidateScore],
        best: int,
        out: tuple[CandidateScore, ...],
    ) -> Selection:
        """No worker is warm: the cold pool, else a new home, the picker or the prefix's home.

        A prefix never seen (or ``home_by_hash`` off): a request that later
        ones follow makes a new home (:func:`new_home_rule`); otherwise, or
        when a cache lacks room, any worker is as good as its prediction, so
        the picker decides among all of them (a burst of unique requests
        spreads as :func:`tie_band_picker` says). A prefix seen before that
        no cache holds any more goes to its :func:`rendezvous_home`.
        """
        p = self.params
        if p.cold_pool:
            pooled = cold_pool_rule(scored, candidates, best, p.cold_pool, p.short)
            if pooled is not None:
                reason = f"no reusable prefix anywhere: cold pool {p.cold_pool!r}"
                return Selection(scored[pooled].worker_id, "cold_pool", reason, 0, out)
        hashes = ctx.blocks.hashes
        if not p.home_by_hash or not hashes or hashes[0] not in self._demand:
            # None is warm, so `best` is the best of all.
            salt = _request_salt(ctx)
            # One read of the reuse record serves both keys (a replica reads none).
            reuse = None if salt else self._reuse_record(ctx)
            share = p.one_off_reuse_share
            if p.new_home_emptiest and reuse is not None and reuse.followed(share):
                home = new_home_rule(ctx.index, scored, candidates, best, p.short, len(hashes))
                if home is not None:
                    held = ctx.index.blocks_of(scored[home].worker_id)
                    reason = (
                        "no reusable prefix anywhere, a new home: the emptiest cache "
                        f"within margin ({held} blocks)"
                    )
                    return Selection(scored[home].worker_id, "cold", reason, 0, out)
            everyone = range(len(scored))
            band = calibration_band(scored, everyone, p.tie_band_rel)
            one_off = band > 0.0 and reuse is not None and reuse.one_off(share)
            pick = tie_band_picker(scored, candidates, everyone, band, best, salt, one_off)
            reason = "no reusable prefix anywhere: lowest predicted TTFT"
            if pick != best:
                among = (
                    "earliest first token, then least recently sent," if one_off
                    else "fewest in flight"
                )  # fmt: skip
                reason = f"no reusable prefix anywhere: {among} among near-equal"
            return Selection(scored[pick].worker_id, "cold", reason, 0, out)
        home, near = rendezvous_home(scored, best, hashes[0], p.short)
        reason = f"no reusable prefix anywhere: its home among {near} within margin"
        return Selection(scored[home].worker_id, "cold", reason, 0, out)

    # ----------------------------------------------------------------- demand

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
        rate = self.prefix_rate(tracked_key(blocks.hashes, depth), ctx.now)
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

    def _traffic_share(self, ctx: RoutingContext, tracked: int) -> float:
        """The share of the routed requests that bring the tracked prefix of
        ``tracked`` blocks (:func:`tracked_blocks`), from the decayed counts
        over ``demand_window_s``."""
        fleet = self._steady_rate(self._arrivals, ctx.now)
        if tracked <= 0 or fleet <= 0.0:
            return 0.0
        key = tracked_key(ctx.blocks.hashes, tracked)
        return min(1.0, self.prefix_rate(key, ctx.now) / fleet)

    # ------------------------------------------------------------------ hooks

    def admit_warm_up(self, worker: WorkerId, prefill_s: float, now: float) -> bool:
        """Spend ``prefill_s`` of ``worker``'s copy budget (``copy_budget_share``)."""
        bucket = self._copy_budget.get(worker)
        if bucket is None:
            p = self.params
            rate = p.copy_budget_share
            bucket = TokenBucket(rate, rate * p.copy_budget_window_s)
            self._copy_budget[worker] = bucket
        return bucket.spend(now, prefill_s)

    def on_worker_removed(self, worker: WorkerId) -> None:
        self._copy_budget.pop(worker, None)

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        # Count the request toward each of its prefixes of 1, 2, 4, 8, ...
        # blocks: a demand tree of log2(blocks) counters per request, so the
        # demand of whatever prefix a later request matches can be read back.
        p = self.params
        tau = p.demand_window_s
        now = ctx.now
        self._arrivals.count(now, tau)
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
                d = demand[key] = Demand(0.0, now, recent)
            d.count(now, tau)
            depth <<= 1
        self._count_reuse(ctx)

    def _count_reuse(self, ctx: RoutingContext) -> None:
        """Count the earlier new content this request reuses, then its own.

        Each request's new content (past its longest match) is marked by one
        block hash: its first tracked depth past the match, or its last block
        when its prompt ends first (a session's short turn). A later request
        reuses it when its own match covers that block, which is checked at
        the tracked depths within its match and at the match's last block
        (the whole earlier prompt: a session's next turn): O(log n), no walk
        over the blocks. A mark counts once and is forgotten; at most
        ``max_tracked_prefixes`` are kept, the oldest dropped first (a mark
        that old counts as not reused).
        """
        hashes = ctx.blocks.hashes
        matched = _deepest_match(ctx)
        unreused = self._unreused
        if unreused and matched:
            depth = 1
            while depth <= matched:
                reuse = unreused.pop(hashes[depth - 1], None)
                if reuse is not None:
                    reuse.reused += 1.0
                depth <<= 1
            reuse = unreused.pop(hashes[matched - 1], None)
            if reuse is not None:
                reuse.reused += 1.0
        mark = reuse_mark(hashes, matched)
        if mark is None or mark in unreused:
            return
        head = self._head_reuse(ctx, matched, create=True)
        if head is not None:
            if len(unreused) >= self.params.max_tracked_prefixes:
                unreused.pop(next(iter(unreused)))
            unreused[mark] = head
            head.started()

    def _head_reuse(self, ctx: RoutingContext, matched: int, create: bool) -> Reuse | None:
        """The reuse record of the head within ``matched`` blocks, made if ``create``
        (None: none yet, or the head's demand was dropped)."""
        if matched <= 0:
            return self._root_reuse
        d = self._demand.get(tracked_key(ctx.blocks.hashes, matched))
        if d is None:
            return None
        if d.reuse is None and create:
            d.reuse = Reuse()
        return d.reuse

    def _ranks_one_off(self, ctx: RoutingContext, band: float, salt: int) -> bool:
        """Whether :func:`tie_band_picker` ranks this request's near-equal as a one-off's:
        one router (no ``salt``: a replica keeps the count), a band to rank within,
        and :meth:`_one_off`. The record is read only then (every request routes here)."""
        return band > 0.0 and not salt and self._one_off(ctx)

    def _one_off(self, ctx: RoutingContext) -> bool:
        """Whether later requests rarely reuse what requests like this bring (:class:`Reuse`)."""
        reuse = self._reuse_record(ctx)
        return reuse is not None and reuse.one_off(self.params.one_off_reuse_share)

    def _reuse_record(self, ctx: RoutingContext) -> Reuse | None:
        """The reuse record of this request's head, read only (a routing decision
        leaves the records as it found them); None without one, or with
        ``one_off_reuse_share`` 0 (no request is then one-off or followed)."""
        if self.params.one_off_reuse_share <= 0.0:
            return None
        return self._head_reuse(ctx, _deepest_match(ctx), create=False)

    def on_first_token(self, ctx: RoutingContext, worker: WorkerId) -> None:
        # The prefill is done on `worker`: each tracked prefix of the request
        # is settled there (read by hot_prefix_rule through _prefilled). The
        # index keeps calling it speculative until the answer's report of
        # reuse confirms it, which for a long generation on a busy worker can
        # be tens of seconds later; meanwhile a hot prefix must be able to
        # get its second replica.
        demand = self._demand
        hashes = ctx.blocks.hashes
        n = len(hashes)
        depth = 1
        while depth <= n:
            d = demand.get(hashes[depth - 1])
            depth <<= 1
            if d is not None and worker not in d.prefilled:
                d.prefilled = (*d.prefilled, worker)

    def _settled(self, ctx: RoutingContext, worker: WorkerId) -> bool:
        """Whether the engine has ``worker``'s match: confirmed, or a first token came from it."""
        held = ctx.matches.get(worker)
        return held is not None and (
            held.source is not _SPECULATIVE or self._prefilled(ctx, worker, held.blocks)
        )

    def _prefilled(self, ctx: RoutingContext, worker: WorkerId, blocks: int) -> bool:
        """Whether ``worker`` sent a first token for the prefix of ``blocks`` blocks."""
        if blocks <= 0:
            return False
        key = tracked_key(ctx.blocks.hashes, blocks)
        d = self._demand.get(key)
        return d is not None and worker in d.prefilled

    def on_rejected(self, ctx: RoutingContext, worker: WorkerId) -> None:
        # The engine did no prefill for it: take the arrival back out of each
        # prefix's demand, so refused requests neither make a prefix hot nor
        # make a new prefix "seen before" (home_by_hash) for its retry.
        tau = self.params.demand_window_s
        t = ctx.now
        self._arrivals.uncount(t, tau)
        # Its new content was never prefilled: nothing to reuse (the reuse of
        # earlier content it counted stands: its user did come back to it).
        mark = reuse_mark(ctx.blocks.hashes, _deepest_match(ctx))
        reuse = None if mark is None else self._unreused.pop(mark, None)
        if reuse is not None:
            reuse.new = reuse.new - 1.0 if reuse.new > 1.0 else 0.0
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
            d.uncount(t, tau)
            if not d.recent and d.rate * tau < 1e-9:
                del demand[key]  # no other arrival left: as if never seen

    def _sweep_demand(self, ctx: RoutingContext) -> dict[int, Demand]:
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

    def _steady_rate(self, d: Demand, now: float) -> float:
        """The decayed count of ``d``'s arrivals, read at ``now`` (requests per second)."""
        return d.rate * math.exp(-max(0.0, now - d.last) / self.params.demand_window_s)

    def prefix_rate(self, last_block: int, now: float) -> float:
        """Requests per second for the prefix ending at block hash ``last_block``.

        Only prefixes of a power-of-two number of blocks are tracked (see
        :meth:`on_routed`); others read 0. See :class:`Demand` for the estimate.
        """
        d = self._demand.get(last_block)
        if d is None:
            return 0.0
        steady = self._steady_rate(d, now)
        recent = d.recent
        if len(recent) == recent.maxlen and now > recent[0]:
            return max(steady, (len(recent) - 1) / (now - recent[0]))
        return steady


def _selection(
    scored: Sequence[CandidateScore],
    warm: Sequence[int],
    deepest: int,
    choice: Choice,
    prompt: int,
    out: tuple[CandidateScore, ...],
) -> Selection:
    """The Selection for ``choice``: its tier, and the tokens a warm choice reuses."""
    c = scored[choice.index]
    if choice.index in warm:
        cached = c.matched_tokens
        tier = "exact" if cached >= deepest else "partial"
        reason = f"{choice.reason}; {cached} of {prompt} tokens cached"
        return Selection(c.worker_id, tier, reason, cached, out, choice.abandoned)
    return Selection(c.worker_id, "cold", choice.reason, 0, out, choice.abandoned)


def _deepest_match(ctx: RoutingContext) -> int:
    """Blocks of the longest prefix any worker holds, at most the prompt's."""
    n = len(ctx.blocks.hashes)
    deepest = max((m.blocks for m in ctx.matches.values()), default=0)
    return deepest if deepest < n else n


def _request_salt(ctx: RoutingContext) -> int:
    """This request's tie-break salt on this router replica (0: one router's order).

    The replica's salt (``RoutingContext.replica_salt``) mixed with the
    request id: replicas draw differently, and so does one replica from one
    request to the next (a fixed draw per replica would keep sending its
    share to the same two workers). Never 0 for a replica.
    """
    salt = ctx.replica_salt
    if not salt:
        return 0
    rid = ctx.request.request_id.encode("utf-8")
    return int(xxhash.xxh3_64_intdigest(rid, salt & 0xFFFF_FFFF_FFFF_FFFF)) | 1
