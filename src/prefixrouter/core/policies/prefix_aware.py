"""``prefix_aware``: route where the first token comes soonest, counting cached prefill.

One policy, one name: module ``prefix_aware``, registry name ``prefix_aware``
(``prefixrouter`` is its deprecated alias), class :class:`PrefixAwarePolicy`.

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

:meth:`PrefixAwarePolicy.select` is a composition of named steps, carved as
llm-d's scheduler carves filters, scorers and a picker; each step is a small
pure function whose docstring states its rule:

1. **scorer** (:func:`score_candidates`): every candidate's cost terms and
   score, and which candidates are warm. It runs first: the filter below
   applies only when some candidate is warm, and the decision record shows
   every candidate's figures, filtered or not.
2. **candidate filter** (:func:`cold_quota_filter`): the cold quota keeps a
   share of each worker's slots for requests that follow no cached prefix.
3. **picker** (:func:`deepest_holders`, :func:`tie_band_picker`): the best
   of the warm workers holding the deepest prefix; scores within the tie band
   count as equal, and among those the fewest in flight wins, or for
   one-off traffic (what such requests bring is rarely reused later) the
   least recently sent of those whose first token cannot be told from the
   earliest's (on a router replica,
   ``Router(replica_salt=)``, the fewer in flight of two of them drawn per
   request, so replicas that share a stale view do not all pick the same
   worker; a prefix's rendezvous home stays the same everywhere).
4. **rules**, in order, each of which may leave the picker's choice:
   :func:`hot_prefix_rule` (warm another replica for a prefix in demand),
   :func:`idle_copy_rule` (a copy the router makes itself into an idle
   worker, for a prefix whose busy holders are fewer than its share of the
   traffic),
   :func:`first_prefill_rule` (no worker idle and every holder still on its
   first prefill of a prefix that is most of the prompt: the one whose
   prefill ends first), then,
   when the picker's choice is not the lowest score overall,
   :func:`max_wait_rule` (with a cap set, off by default: never queue too
   long for a warm cache, counting a
   wait for KV memory; leaving pays :func:`switch_externality`, what the
   copy's prefill costs the requests queued after it on the target and
   those arriving while it runs, less what a second replica saves the
   prefix's own requests, as in the warm margin below),
   :func:`no_room_rule` (no copy into caches with no room, for a prefix one
   replica serves), :func:`prefill_in_progress_rule`
   (beside an idle worker, judge a holder whose prefill of the prefix is
   still running by when its first token really comes), then
   :func:`holder_band_rule` when the best holds the deepest prefix too
   (keep the picker's holder only while its first token is within the
   calibration band of the best's: no copy is at stake) or else
   :func:`warm_margin_rule` (keep the warm worker while it is nearly as
   good); with ``proactive_copy`` the
   hot-prefix rule's verdict is set aside for a copy of the router's own
   (never into a worker with a prefill pending, whose first tokens it would
   delay), and :func:`copy_rule` sends the request itself to the copy when
   its first token comes no later there.

With no warm worker the cold path (``_select_cold``) runs instead:
:func:`cold_pool_rule`, then for a prefix never seen :func:`new_home_rule`
(the emptiest cache, when later requests will follow this one) or the picker
among all workers, or :func:`rendezvous_home` for one seen before that no
cache holds any more. Under the cold quota, when every warm worker is out of
room, the lowest score among the workers with room wins.

Tiers (the one recorded is the chosen worker's):

1. ``exact``: a warm worker holding the deepest prefix any eligible warm worker holds;
2. ``partial``: a warm worker holding less;
3. ``cold``: a worker with no usable prefix;
4. ``cold_pool``: a worker of the configured ``cold_pool``.

Demand per prefix (read by the hot-prefix rule and the cold path) and the
fleet's arrival rate (read by :func:`switch_externality`) are the policy's
only state, kept by its hooks: counted per prefix of 1, 2, 4, 8, ...
blocks, so a session's history is told apart from the system prompt every
session shares; a burst is seen from the last ``burst_samples`` arrivals,
before the decayed rate has grown. The demand table is bounded by what the
index holds: once it doubles (past ``min_tracked_prefixes``), the prefixes no
worker holds any more are dropped (a prefix evicted everywhere before that
counts as never seen), and ``max_tracked_prefixes`` caps it (oldest first). A
request the engine did no prefill for (``on_rejected``) is taken out of the
counts again.

Parameters per output class live in :class:`OutputClassParams`; requests
expected to decode at least ``long_output_tokens`` use ``long`` (the expected
output is ``RoutingContext.output_tokens``: a client's ``max_tokens`` is a
cap, and :mod:`prefixrouter.core.output` learns how much of it answers use).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from prefixrouter.core.bucket import TokenBucket
from prefixrouter.core.cost import CostTerms
from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.index import PrefixIndex
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
        max_warm_wait_s: A cap on warm preference's queue wait, off by
            default (infinite): set, a request leaves a warm worker whose
            wait (queue and KV memory) is past it for a worker whose wait is
            within it whenever that brings its first token sooner, counting
            the switch's cost to the queue behind (:func:`max_wait_rule`),
            the warm margin notwithstanding; and the hot-prefix rule warms no
            worker whose queue is past it. It was 4 s (2 s for long
            generations) until the switch's cost was priced: then it moved
            only requests within the margin, whose predictions cannot tell
            the two workers apart, each at the price of a copy, and under
            overload every queue is past it (``llmd-customers`` at load 0.9,
            mean TTFT over seeds 0-1: -5 % text, -8 % token without it; the
            whole Mooncake conversation trace at 0.9: 1.22-1.23 -> 1.00-1.02
            s; every other cell of the tables unchanged). An operator with a
            queueing SLO sets it.
        decode_weight: Weight of the predicted decode time when ranking workers.
        switch_decode_weight: The same weight when a warm worker is compared
            with a cold one (leaving warm copies the prefix: a lasting cost
            against a transient difference in decode batches).
    """

    warm_margin_rel: float = 0.25
    warm_margin_abs_s: float = 0.05
    max_warm_wait_s: float = math.inf
    decode_weight: float = 0.0
    switch_decode_weight: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefixAwareParams:
    """Parameters of the ``prefix_aware`` policy.

    Attributes:
        short: Thresholds for short answers.
        long: Thresholds for long generations.
        long_output_tokens: Expected output (``RoutingContext.output_tokens``: the
            request's ``max_tokens`` at the fill answers showed) from which a
            request is a long generation.
        min_match_tokens: Matches shorter than this do not make a worker warm.
        min_confidence: Matches trusted less than this are scored as cold.
        cold_reserved_share: Share of each worker's slots warm preference may not fill.
        eviction_weight: Weight of the prefill time of what a copy would evict
            (the chance that the evicted blocks are asked for again).
        min_margin_share: Share of the warm margin kept even when the other
            worker's cache has room (a copy still costs memory and a prefill).
        switch_backlog_weight: Weight of what leaving a warm worker costs the
            requests queued after this one (:func:`switch_externality`: the
            prefill it adds to the target's queue times the requests waiting
            there and those arriving while it runs, less the prefill it
            spares the warm worker's, less what a second replica saves the
            prefix's own requests), on the cold
            side of the maximum wait and the warm margin. 0 judges a switch
            by this request's first token alone, which under load trades the
            fleet's throughput for one request: on the whole Mooncake
            conversation trace at load 0.9 the copies' prefill kept the
            queues growing (token mode, mean TTFT per thousand of its first
            four thousand requests: 1.06, 1.61, 2.95, 4.83 s; with weight 1:
            0.91, 1.08, 1.78, 3.19 s; 3: 0.90, 0.98, 1.66, 3.14 s; 10: 0.86,
            0.95, 1.13, 2.43 s; 30: 0.88, 1.07, 1.44, 2.04 s). A request
            delayed holds up the ones behind it in turn, so near saturation
            one added prefill costs several times its length per request
            waiting; 10 is where the trace stopped improving (it is
            1 / (1 - rho), the busy period's growth per unit of added work,
            at rho = 0.9). Those counts are before the copy's own drain
            (the arrivals during its prefill), which brought the whole
            trace from 1.71 to 1.22 s.
        home_by_hash: Send a prefix that no cache holds to its rendezvous-hash
            home among the workers within the margin of the best.
        new_home_emptiest: Send a prompt that matches nothing anywhere, when
            later requests were seen to reuse what requests like it bring
            (at least ``one_off_reuse_share`` of it), to the emptiest cache
            within the margin of the best, while every cache has room for it
            (:func:`new_home_rule`); one router only.
        hot_prefix_utilization: Per-replica load of one prefix above which it is hot.
        wait_on_prefill: Judge a holder whose prefill of the prefix is still
            running, when the best worker is idle, by when its first token
            really comes (:func:`prefill_in_progress_rule`) instead of by the
            warm margin.
        earliest_prefill: When no worker is idle and every holder of the
            prefix is still on its first prefill of it, take the holder whose
            prefill ends first (:func:`first_prefill_rule`), not the lowest
            score (often the one that started last).
        earliest_prefill_min_share: ``earliest_prefill`` applies only when
            the holders' prefix is at least this share of the prompt. Below
            it the holders share a chat template's first blocks, every
            worker does, and their queues hold other prompts, whose progress
            says nothing of this request's first token (live, cache
            pressure in token mode: the rule then piled a fleet's first
            documents onto one engine, 2.15x the oracle's mean TTFT against
            1.24x).
        idle_copy: Warm an idle worker, whose copy evicts nothing and takes
            at most ``1 - copy_max_kv_share`` of its KV, for a prefix whose
            holders are all busy while it brings more than their share of the
            routed requests, when the copy saves more than the warm margin
            (:func:`idle_copy_rule`); only with
            a prefill-only copy (``proactive_copy``, a prefix of at least
            ``copy_min_prefix_share`` of the prompt), so no user request pays
            for it.
        proactive_copy: When the hot-prefix rule calls for another replica,
            warm it with a prefill-only request of the router's own
            (``Selection.warm_up``) and route the request as if no copy were
            due, so that no user request pays the copy's cold prefill, unless
            the request's own first token comes no later on the new replica
            (:func:`copy_rule`: then it makes the copy itself); off, the
            request itself is sent to the new replica. On by default since
            a miss behind a running prefill no longer lowers a worker's trust
            (``benchmarks/decision_quality_notes.md``).
        copy_budget_share: Proactive copies' budget: the share of each
            worker's time its copies' predicted prefill may take, averaged
            over ``copy_budget_window_s`` (a token bucket in seconds of
            prefill, :class:`~prefixrouter.core.bucket.TokenBucket`; a copy
            goes whenever the bucket is not empty, into debt if it must, so
            one long document's copy is never refused for its size). Over
            the budget no copy goes and the request is routed as it was; the
            next request that calls for the copy asks again. Each router
            replica keeps its own budget (its own copies).
        copy_budget_window_s: The span that budget is averaged over (its
            burst: ``copy_budget_share * copy_budget_window_s`` seconds).
        copy_min_prefix_share: A prefill-only copy is sent only when the hot
            prefix is at least this share of the request's prompt. The copy is
            the request's whole prompt with ``max_tokens`` 1 (the prompt is
            what the router can send), so the rest of it is prefill spent on
            this request's own text, which no other request reuses: a
            521-token system block of 20,000-token conversations (the
            Mooncake trace) would cost 40 times its size. Below the share the
            request itself makes the copy, as with ``proactive_copy`` off.
        copy_max_kv_share: The hot-prefix rule warms no worker whose KV cache
            would be fuller than this share with the copy's blocks on top of
            what its running requests hold (see ``copy_room_filter``).
        copy_room_beside_holders: For the hot-prefix rule, a worker past
            ``copy_max_kv_share`` with the copy still has room when it would
            be less full of pinned blocks than the least full holder, where
            the request goes without a copy (``copy_room_filter``); the
            no-room rule keeps the absolute share.
        tie_band_rel: Cap on the tie band: scores within the candidates'
            calibration disagreement (at most this share) of the best count as
            equal, and among them the fewest requests in flight wins, or for
            one-off traffic the least recently sent of those whose first
            token is within an engine step of the earliest (see
            ``one_off_reuse_share``).
        holder_kv_wait: Between the holders of the deepest prefix, rank each
            by its head-of-line KV wait counted on the blocks that finishing
            requests free (:func:`holder_kv_wait_rank`), not on all used
            blocks; nothing is copied between holders, so the better
            prediction of that wait costs no copy.
        one_off_reuse_share: A request is one-off when, of the requests that
            brought new content after the same cached head, less than this
            share had it reused by a later request (a session's next turn, a
            document's next question); its near-equal are then ranked by
            their first tokens and then by how recently each was sent a
            request, since only its own first token is at stake
            (``one_off_pick``). 0 ranks every request by requests in flight.
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
            warm_margin_rel=0.25, warm_margin_abs_s=0.05, decode_weight=0.2
        )
    )
    long: OutputClassParams = field(
        default_factory=lambda: OutputClassParams(
            warm_margin_rel=0.1,
            warm_margin_abs_s=0.02,
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
    switch_backlog_weight: float = 10.0
    home_by_hash: bool = True
    new_home_emptiest: bool = True
    hot_prefix_utilization: float = 1.0
    wait_on_prefill: bool = True
    earliest_prefill: bool = True
    earliest_prefill_min_share: float = 0.5
    proactive_copy: bool = True
    idle_copy: bool = True
    copy_budget_share: float = 0.25
    copy_budget_window_s: float = 10.0
    copy_max_kv_share: float = 0.8
    copy_room_beside_holders: bool = True
    copy_min_prefix_share: float = 0.5
    tie_band_rel: float = 0.1
    holder_kv_wait: bool = True
    one_off_reuse_share: float = 0.5
    demand_window_s: float = 10.0
    burst_samples: int = 8
    reference_batch: int = 32
    cold_pool: str = ""
    max_tracked_prefixes: int = 100_000
    min_tracked_prefixes: int = 4096


@dataclass(slots=True)
class _Demand:
    """Request-rate estimate of one prefix (or of the whole fleet's arrivals).

    Two estimators, the larger wins: an exponentially decayed count over
    ``demand_window_s`` (steady demand, one float) and the span of the last
    ``burst_samples`` arrivals (a burst is seen after a handful of requests,
    long before the decayed count has grown).
    """

    rate: float
    last: float
    recent: deque[float]
    # Workers that sent a first token for a request of this prefix: its
    # prefill is done there, whatever the index still calls speculative.
    prefilled: tuple[WorkerId, ...] = ()
    reuse: _Reuse | None = None

    def count(self, now: float, tau: float) -> None:
        """Add an arrival at ``now`` to the decayed count (time constant ``tau``)."""
        # max(0, elapsed): a caller's clock that steps back must not overflow exp.
        elapsed = now - self.last
        elapsed = elapsed if elapsed > 0.0 else 0.0
        self.rate = self.rate * math.exp(-elapsed / tau) + 1.0 / tau
        self.last = now
        self.recent.append(now)

    def uncount(self, t: float, tau: float) -> None:
        """Take back the arrival counted at ``t`` (a request the engine refused)."""
        # The arrival added 1/tau at t; the estimate has decayed since, to self.last.
        rate = self.rate - math.exp(-max(0.0, self.last - t) / tau) / tau
        self.rate = rate if rate > 0.0 else 0.0
        if t in self.recent:
            self.recent.remove(t)


REUSE_MEMORY = 64.0
"""Requests with new content a head's reuse share remembers (halved past it)."""


@dataclass(slots=True)
class _Reuse:
    """How often the new content that followed one head was reused later.

    A request's *head* is the deepest tracked prefix (1, 2, 4, ... blocks)
    within its longest cached match, or none (the policy's root record); its
    *new content* the blocks past that match. ``new`` counts the requests
    that brought new content after this head, ``reused`` those whose new
    content a later request matched; both are halved once ``new`` passes
    :data:`REUSE_MEMORY`, so the share follows a change of traffic. Sessions
    under one system prompt, and documents asked about more than once, have
    a share near 1: where such a request goes, later ones follow. One-off
    questions under a shared system prompt or template, and a document's
    questions, have a share near 0.
    """

    new: float = 0.0
    reused: float = 0.0

    def started(self) -> None:
        """One more request brought new content after this head."""
        self.new += 1.0
        if self.new > REUSE_MEMORY:
            self.new *= 0.5
            self.reused *= 0.5

    def one_off(self, share: float) -> bool:
        """Whether less than ``share`` of the new content was reused (no record: False)."""
        return self.new > 0.0 and self.reused < share * self.new

    def followed(self, share: float) -> bool:
        """Whether at least ``share`` of the new content was reused (no record: False)."""
        return self.new > 0.0 and not self.one_off(share)


@dataclass(frozen=True, slots=True)
class Choice:
    """A step's verdict: which candidate, and why.

    Attributes:
        index: The chosen candidate's position in the candidate list.
        reason: One sentence for the decision record.
        abandoned: Warm preference was given up: the warm worker's wait made it too slow.
    """

    index: int
    reason: str
    abandoned: bool = False


@register
class PrefixAwarePolicy(Policy):
    """Lowest predicted TTFT with bounded warm preference (the default policy)."""

    name = "prefix_aware"
    Params = PrefixAwareParams
    params: PrefixAwareParams

    def __init__(self, params: PrefixAwareParams | None = None) -> None:
        super().__init__(params)
        # Demand per prefix, keyed by the block hash that ends it; see on_routed.
        self._demand: dict[int, _Demand] = {}
        self._sweep_at = self.params.min_tracked_prefixes  # see _sweep_demand
        # Proactive copies' budget per worker (admit_warm_up).
        self._copy_budget: dict[WorkerId, TokenBucket] = {}
        # Every routing of the fleet (peers' too), for the arrivals a copy delays.
        self._arrivals = _Demand(0.0, 0.0, deque(maxlen=0))
        # New content not yet reused: its marking block hash -> the head's
        # record (see _count_reuse); oldest first, for the bound.
        self._unreused: dict[int, _Reuse] = {}
        self._root_reuse = _Reuse()  # requests that matched nothing

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
        best = _argmin(scored, eligible)
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
            best = _argmin(scored, eligible)
            out = tuple(scored)
        salt = _request_salt(ctx)
        band = calibration_band(scored, holders, p.tie_band_rel)
        picked = tie_band_picker(
            scored, candidates, holders, band, _argmin(scored, holders), salt,
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
            least = _least_holder_share(candidates, scored, holders)
            if least > p.copy_max_kv_share:
                hot_room = room(True)
        choice = hot_prefix_rule(scored, hot_room, holders, settled, cls, demand)
        if choice is not None and roomy is not None and choice.index not in roomy:
            choice = Choice(
                choice.index,
                f"{choice.reason} (room beside its holders: "
                f"{_pinned_share(candidates, scored, choice.index, ctx.blocks.prompt_tokens):.0%}"
                f" pinned with the copy, the holders at least {least:.0%})",
            )
        # A copy the router can make itself: no user request pays its prefill.
        copyable = (
            p.proactive_copy
            and scored[picked].matched_tokens >= p.copy_min_prefix_share * ctx.blocks.prompt_tokens
        )
        if choice is None and copyable and roomy is not None and p.idle_copy:
            tracked = _tracked_blocks(ctx.blocks, scored[picked].matched_tokens)
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
        d = self._demand.get(_tracked_key(blocks.hashes, depth))
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
        rate = self.prefix_rate(_tracked_key(blocks.hashes, depth), ctx.now)
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
        ``tracked`` blocks (:func:`_tracked_blocks`), from the decayed counts
        over ``demand_window_s``."""
        fleet = self._steady_rate(self._arrivals, ctx.now)
        if tracked <= 0 or fleet <= 0.0:
            return 0.0
        key = _tracked_key(ctx.blocks.hashes, tracked)
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
                d = demand[key] = _Demand(0.0, now, recent)
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
        mark = _reuse_mark(hashes, matched)
        if mark is None or mark in unreused:
            return
        head = self._head_reuse(ctx, matched, create=True)
        if head is not None:
            if len(unreused) >= self.params.max_tracked_prefixes:
                unreused.pop(next(iter(unreused)))
            unreused[mark] = head
            head.started()

    def _head_reuse(self, ctx: RoutingContext, matched: int, create: bool) -> _Reuse | None:
        """The reuse record of the head within ``matched`` blocks, made if ``create``
        (None: none yet, or the head's demand was dropped)."""
        if matched <= 0:
            return self._root_reuse
        d = self._demand.get(_tracked_key(ctx.blocks.hashes, matched))
        if d is None:
            return None
        if d.reuse is None and create:
            d.reuse = _Reuse()
        return d.reuse

    def _ranks_one_off(self, ctx: RoutingContext, band: float, salt: int) -> bool:
        """Whether :func:`tie_band_picker` ranks this request's near-equal as a one-off's:
        one router (no ``salt``: a replica keeps the count), a band to rank within,
        and :meth:`_one_off`. The record is read only then (every request routes here)."""
        return band > 0.0 and not salt and self._one_off(ctx)

    def _one_off(self, ctx: RoutingContext) -> bool:
        """Whether later requests rarely reuse what requests like this bring (:class:`_Reuse`)."""
        reuse = self._reuse_record(ctx)
        return reuse is not None and reuse.one_off(self.params.one_off_reuse_share)

    def _reuse_record(self, ctx: RoutingContext) -> _Reuse | None:
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
        key = _tracked_key(ctx.blocks.hashes, blocks)
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
        mark = _reuse_mark(ctx.blocks.hashes, _deepest_match(ctx))
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

    def _steady_rate(self, d: _Demand, now: float) -> float:
        """The decayed count of ``d``'s arrivals, read at ``now`` (requests per second)."""
        return d.rate * math.exp(-max(0.0, now - d.last) / self.params.demand_window_s)

    def prefix_rate(self, last_block: int, now: float) -> float:
        """Requests per second for the prefix ending at block hash ``last_block``.

        Only prefixes of a power-of-two number of blocks are tracked (see
        :meth:`on_routed`); others read 0. See :class:`_Demand` for the estimate.
        """
        d = self._demand.get(last_block)
        if d is None:
            return 0.0
        steady = self._steady_rate(d, now)
        recent = d.recent
        if len(recent) == recent.maxlen and now > recent[0]:
            return max(steady, (len(recent) - 1) / (now - recent[0]))
        return steady


# --------------------------------------------------------------------- scorer


def score_candidates(
    ctx: RoutingContext,
    candidates: Sequence[WorkerView],
    params: PrefixAwareParams,
    cls: OutputClassParams,
    output: int,
) -> tuple[list[CandidateScore], list[int]]:
    """Scorer: every candidate's cost terms and score, and which candidates are warm.

    ``score = ttft + decode_weight * decode + eviction_weight * eviction``
    (module docstring), with ``decode_weight`` the output class's. A candidate
    is warm when it holds at least ``min_match_tokens`` reusable tokens with
    confidence at least ``min_confidence``; any other is predicted as if it
    held nothing, so a distrusted affinity pays the whole prefill. Engines
    recompute the last token of a fully cached prompt, so only the whole
    blocks before it are reusable. ``eviction`` is predicted from the blocks
    the candidate lacks beyond its free ones: storing them evicts as many.

    Returns:
        The scores in candidate order, and the warm candidates' indices in order.
    """
    blocks = ctx.blocks
    prompt = blocks.prompt_tokens
    bt = blocks.block_tokens
    reusable_cap = int((prompt - 1) // bt * bt) if prompt else 0
    # The loop runs once per candidate on every request: what it reads of
    # the params, the context and the index is bound to locals first.
    scored: list[CandidateScore] = []
    warm_any: list[int] = []
    matches = ctx.matches
    index = ctx.index
    predict = ctx.cost.predict
    min_match, min_conf = params.min_match_tokens, params.min_confidence
    decode_weight, eviction_weight = cls.decode_weight, params.eviction_weight
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
        lacking = n_blocks - held - index.free_blocks(wid)
        evicted = int(lacking * bt) if lacking > 0 else 0  # blocks.tokens_for(lacking)
        if warm:
            terms = predict(w, prompt, matched, conf, output, evicted)
            warm_any.append(i)
        else:
            terms = predict(w, prompt, 0, 0.0, output, evicted)
        score = terms.ttft_s + decode_weight * terms.decode_s + eviction_weight * terms.eviction_s
        scored.append(CandidateScore(wid, matched, conf, terms, score))
    return scored, warm_any


# ----------------------------------------------------------- candidate filter


def cold_quota_filter(
    candidates: Sequence[WorkerView], warm: Sequence[int], share: float
) -> Sequence[int]:
    """Candidate filter, the cold quota: the indices of the candidates this request may take.

    A request that follows a cached prefix (some candidate is ``warm``) may
    not take a worker's last ``share`` of sequence slots while another worker
    has room for it, so a continuous hot stream leaves room for the unique
    requests that would otherwise queue behind it. With no warm candidate, a
    share of 0, or room on every worker or on none, every candidate stays
    (``range(len(candidates))``).
    """
    everyone = range(len(candidates))
    if not warm or share <= 0:
        return everyone
    limit_share = 1.0 - share
    with_room = [i for i, w in enumerate(candidates) if w.in_flight < limit_share * w.max_slots]
    return with_room if with_room and len(with_room) < len(candidates) else everyone


# --------------------------------------------------------------------- picker


def deepest_holders(scored: Sequence[CandidateScore], warm: Sequence[int]) -> tuple[int, list[int]]:
    """The deepest prefix any of ``warm`` holds (tokens), and those of them holding it.

    The picker picks among these: leaving them for anyone else (cold, or
    holding a shorter prefix) recomputes part of the prompt, which only a
    rule may decide to pay for.
    """
    deepest = max([scored[i].matched_tokens for i in warm])
    return deepest, [i for i in warm if scored[i].matched_tokens >= deepest]


def holder_kv_wait_rank(scored: list[CandidateScore], holders: Sequence[int]) -> bool:
    """Picker's input, between holders: a holder's score carries its head-of-line KV
    wait as finishing requests free memory, beyond the least of the holders'.

    The cost model's ``memory_risk`` (part of every score) counts the
    shortfall of free KV blocks against all blocks in use. On a worker whose
    cache holds documents pinned by their readers, finishing readers free only
    their own blocks (question and answer), so the queue waits many times
    longer than that (simulated doc-qa with bursts: 2-10 s predicted as
    0.1-1.6 s, and a holder whose KV was full took every request of a
    burst, the best-predicted each time). ``memory_risk_freed_s`` counts the
    shortfall against the blocks the running requests free
    (:class:`~prefixrouter.core.cost.CostModel`). Between holders of one
    prefix nothing is copied, so each holder's score (``scored`` is changed
    in place) gets the excess of that wait over ``memory_risk``, less the
    least excess among the holders. The least burdened holder keeps its
    score and no score falls, so the rules that weigh leaving the holders
    for a copy see the holders at worst at that holder's own prediction: a
    cold worker never gains against a holder that is not blocked (the
    better wait used for every choice made the router copy contexts under
    cache pressure, each copy evicting one asked for again:
    ``benchmarks/tried/kv_admission_own_blocks.patch``). A sole holder is
    left alone. Terms stay as the model predicted them (calibration learns
    from them).

    Returns:
        Whether any score moved (the caller's best may then be another).
    """
    if len(holders) < 2:
        return False
    excess: list[float] = []
    for i in holders:
        t = scored[i].terms
        gap = 0.0 if t is None else t.memory_risk_freed_s - t.memory_risk_s
        excess.append(gap if gap > 0.0 else 0.0)
    least = min(excess)
    moved = False
    for i, gap in zip(holders, excess, strict=True):
        if gap > least:
            c = scored[i]
            score = c.score + gap - least
            scored[i] = CandidateScore(c.worker_id, c.matched_tokens, c.confidence, c.terms, score)
            moved = True
    return moved


def tie_band_picker(
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    indices: Sequence[int],
    band: float,
    best: int,
    salt: int = 0,
    one_off: bool = False,
) -> int:
    """Picker: the best of ``indices``, where scores within a tie band of the best count as equal.

    ``best`` is the index of the lowest score among ``indices`` (:func:`_argmin`;
    the cold path knows it already).

    Identical engines' predictions differ by their calibration (each learns
    its own scale from noisy observations, about 20% apart live), and a
    router that always takes the lowest prediction keeps feeding the worker
    whose scale happens to be lowest until its queue shows. The tie band
    ``band`` (relative) is how far the candidates' calibration scales
    disagree (:func:`calibration_band`, which the caller computes once and
    the rules read too); among candidates whose scores are within it of the best, the
    one with the fewest requests in flight wins, then the lowest score. With
    one candidate, or scales that agree, the lowest score wins.

    The count in flight is the right key where later requests follow this
    one (a session's first turn, a new document: the placement is kept, and
    the count spreads the sessions and documents each worker carries). A
    ``one_off`` request (``PrefixAwarePolicy._one_off``: what requests like it
    bring is rarely reused) brings nothing later, so only its own first
    token is at stake: :func:`one_off_pick` ranks its near-equal.

    ``salt`` (this request's on this router replica, :func:`_request_salt`;
    0 for one router) is for replicas that route on one view until their
    peers' routings reach them: sent to the fewest in flight, every request
    that reaches any of them within the lag goes to the same worker (stale
    load information herds; Mitzenmacher, "How useful is old information?",
    2000). With a salt the fewest in flight wins among two of the near-equal
    candidates drawn by the salt's rendezvous hash (the "power of two
    choices", which that paper shows keeps balancing on stale loads), so
    replicas, and one replica's successive requests, spread over the
    workers that count as equal. With two near-equal or fewer the salt
    changes nothing. A replica ranks by the count even for a one-off: its
    view lacks its peers' latest routings, so the count is what it knows,
    and the classic two choices rank by it. Scales that agree (no band) still leave exact ties
    (idle workers that no cache warms, as when a fleet starts): one router
    takes the earliest, a replica draws among them as above, since each
    replica taking the earliest would send a burst that reaches several
    replicas at once to one worker.
    """
    if band <= 0 and not salt:
        return best
    limit = scored[best].score * (1.0 + band)
    near = [i for i in indices if scored[i].score <= limit]
    if salt and len(near) > 2:
        # Two choices among the near-equal, drawn by the salt (see above).
        near = heapq.nlargest(2, near, key=lambda i: _rendezvous(salt, scored[i].worker_id))
    elif one_off and not salt:
        return one_off_pick(scored, candidates, near)
    return min(near, key=lambda i: (candidates[i].in_flight, scored[i].score))


def one_off_pick(
    scored: Sequence[CandidateScore], candidates: Sequence[WorkerView], near: Sequence[int]
) -> int:
    """Picker's key for a one-off request's near-equal ``near`` (:func:`tie_band_picker`):
    the least recently sent of the workers whose first token cannot be told
    from the earliest, then the lowest score.

    The calibration factors of the near-equal cannot be told apart, so each
    first token is read on the profile's scale (:func:`profile_first_token`).
    A first token comes at the end of an engine step, and where in the step
    in flight a request lands is unknown: each prediction spans half a step
    either way (``CostTerms.step_s``, the step of the batch it would join).
    The workers whose span overlaps the earliest's are equal for this
    request, and among them the one the router sent a request least
    recently wins (``WorkerView.since_routed_s``). That spaces each worker's
    arrivals as round robin does: a worker's stream of requests is then more
    regular than the fleet's, and a regular stream queues less than a
    random one of the same rate, which is where round robin led the
    load-balancing scenarios (``system-prompt``, ``templates-bad``). A worker
    whose first token is past the span keeps its place behind: a question to
    a 40,000-token document on a worker decoding many of them is tens of
    milliseconds later, a real difference, and spacing there lost
    (``benchmarks/decision_quality_notes.md``). Ranked before by the lowest
    score on the profile's scale, the decode that score weighs beside the
    first token often outranked tens of milliseconds of queue.
    """
    # Each candidate's span on the profile's scale: (first token, half a step).
    spans = {i: (profile_first_token(scored[i]), _profile_step(scored[i]) / 2.0) for i in near}
    first, half = spans[min(near, key=lambda i: spans[i][0])]
    latest = first + half  # the earliest's span ends here
    same = [i for i, (f, h) in spans.items() if f - h <= latest]
    return min(same, key=lambda i: (-candidates[i].since_routed_s, scored[i].score))


def profile_first_token(candidate: CandidateScore) -> float:
    """A candidate's predicted first token without its worker's calibration factor.

    Every term is the profile's prediction times the worker's factor
    (``CostModel.predict``), so this puts candidates whose factors cannot be
    told apart (:func:`tie_band_picker`) on one scale. A candidate without
    terms (a policy that does not use the cost model) reads its score.
    """
    t = candidate.terms
    if t is None or t.scale <= 0.0:
        return candidate.score
    return t.ttft_s / t.scale


def _profile_step(candidate: CandidateScore) -> float:
    """``CostTerms.step_s`` on the profile's scale (0 without terms)."""
    t = candidate.terms
    if t is None or t.scale <= 0.0:
        return 0.0
    return t.step_s / t.scale


def calibration_band(scored: Sequence[CandidateScore], indices: Iterable[int], cap: float) -> float:
    """How far the calibration scales of ``indices`` disagree (relative), at most ``cap``.

    Two predictions closer than this cannot be told apart: each worker's
    scale is learnt from noisy first tokens (live about 20 % apart; in the
    simulator a few percent). When every scale agrees (a fleet whose
    profile is right) predictions are trusted as they are and the band is 0.
    """
    # The lowest and highest scale in one pass: this runs on every request.
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
        return 0.0
    return max(0.0, min(cap, highest / lowest - 1.0))


def copy_room_filter(
    candidates: Sequence[WorkerView],
    scored: Sequence[CandidateScore],
    eligible: Sequence[int],
    holders: Sequence[int],
    prompt_tokens: int,
    max_share: float,
    beside_holders: bool = False,
) -> list[int]:
    """Candidate filter for the hot-prefix and no-room rules: the workers with room for a copy.

    A second replica of a prefix is there to take a share of its requests,
    so it needs room for the prefix's blocks *and* for those requests to run
    beside the ones it serves already. A worker whose KV would be more than
    ``max_share`` full with the copy's uncached blocks on top of what its
    running requests hold (``kv_used_blocks``: pinned, not evictable) is
    dropped: warming it would make the requests there wait for memory (two
    long documents pinned on one worker by their running questions). The
    share keeps the headroom an engine needs for its running batch to grow,
    as vLLM's ``gpu_memory_utilization`` keeps headroom below the device's
    memory. The ``holders`` stay (the rule skips them anyway); a worker that
    reports no capacity is kept (nothing is known against it).

    With ``beside_holders`` (the hot-prefix rule's call) the share is read
    beside the holders: a worker past ``max_share`` with the copy is still
    kept when it would be less full of pinned blocks than the least full
    holder, since without a copy the request waits for memory there
    instead. Past capacity the absolute share alone left a hot document's
    demand on holders pinned full by two documents' readers while a worker
    still finishing the previous document's questions was kept out
    (simulated doc-qa at load 1.1, seed 1: three holders waited 1-4 s for
    KV per request, the fourth worker got no request for 8 s; round robin's
    four copies waited none). The no-room rule keeps the absolute share:
    there the copy is not demanded, and reading it beside full holders made
    the router copy customers' contexts under cache pressure
    (``llmd-customers`` at 0.6, +5 % over seeds 0-3).
    """
    least = _least_holder_share(candidates, scored, holders) if beside_holders else 0.0
    kept: list[int] = []
    for i in eligible:
        if i in holders or candidates[i].kv_capacity_blocks <= 0:
            kept.append(i)
            continue
        share = _pinned_share(candidates, scored, i, prompt_tokens)
        if share <= max_share or share < least:
            kept.append(i)
    return kept


# ---------------------------------------------------------------------- rules


def hot_prefix_rule(
    scored: Sequence[CandidateScore],
    eligible: Sequence[int],
    holders: Sequence[int],
    settled: bool,
    cls: OutputClassParams,
    demand: Callable[[], tuple[float, int]],
) -> Choice | None:
    """Rule 1, hot prefix: warm another replica when the prefix needs more than hold it.

    ``demand()`` is the prefix's request rate and the replicas it needs at
    ``hot_prefix_utilization`` each (``PrefixAwarePolicy._replicas_needed``).
    When that is more than the ``holders``, the lowest score among the
    eligible candidates that do not hold the prefix is warmed now, instead of
    growing the warm queues. Not while the copy is not ``settled`` (held only
    speculatively: its first prefill may still be running, and a second copy
    would pay the same prefill again meanwhile, so queueing behind the first
    is the cheaper wait), and not when that other worker's own queue is past
    the maximum wait (when one is set); ``demand`` is then not computed at all.
    """
    if not settled:
        return None
    others = [i for i in eligible if i not in holders]
    if not others:
        return None
    other = _argmin(scored, others)
    terms = scored[other].terms
    if terms is None or terms.queue_wait_s > cls.max_warm_wait_s:
        return None
    rate, needed = demand()
    if needed <= len(holders):
        return None
    reason = (
        f"hot prefix: {rate:.1f} req/s needs {needed} replicas, "
        f"{len(holders)} hold it; warming {scored[other].worker_id}"
    )
    return Choice(other, reason)


def idle_copy_rule(
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    eligible: Sequence[int],
    holders: Sequence[int],
    picked: int,
    cls: OutputClassParams,
    prompt_tokens: int,
    max_kv_share: float,
    traffic_share: Callable[[], float],
) -> Choice | None:
    """Rule 1b, idle capacity: warm an idle worker for a prefix whose holders are all busy
    while it brings more than their share of the traffic.

    The hot-prefix rule reads a prefix's demand in engine time at the
    profile's speed; only the prefill part of that is calibrated (from first
    tokens), so on engines whose decoding is slower than the profile says it
    reads too few replicas. Live, four gateway replicas in front of four
    engines, a system prompt that every request shares, load 0.8: the
    demand read one replica, the first requests warmed two engines, and the
    other two got no request for the whole run (mean TTFT 266-281 ms against
    203-214 ms where the four shared the load evenly;
    ``benchmarks/decision_quality_notes.md``).
    The share of the routed requests is a count, not a speed: a prefix that
    brings share ``s`` of them needs ``ceil(s * workers)`` workers if no
    worker is to carry more than an even share of the traffic. Counted that
    way everywhere it copies where copies cost (the simulated table moved
    both ways: ``benchmarks/tried/traffic_share_replicas.patch``), so here it
    warms only a worker a copy costs nothing: idle (nothing in flight, no
    prefill pending) and with room that the copy fills without evicting
    anything, and only while every holder has requests in flight (an idle
    holder takes the prefix's next request anyway), and only where the
    copy would matter: once warm (its predicted first token less the
    prefill of the ``picked`` holder's match), the idle worker must beat the
    best holder by more than the class's warm margin (relative to itself),
    the gap within which the policy counts workers as nearly as good. A
    system prompt of a few hundred tokens (the Mooncake trace's) saves
    about 20 ms a request, and copies of it only moved the trace's bursts
    around (16 replicas at 10 ms: +5 points on one router's mean). And an
    idle worker is where the fleet's next new prefix goes: the copy may take
    at most ``max_kv_share`` of its KV (the caller passes the headroom the
    room filter keeps, ``1 - copy_max_kv_share``). Live, four replicas
    copied a 20,000-token document, 42 % of an engine's KV, into the last
    idle engine just before the next document came (doc-qa mean TTFT
    820-1,525 ms against 743-753 ms). ``traffic_share()`` is read only then.

    ``holders`` are the warm workers that hold the prefix the share is
    counted for: the deepest tracked prefix (1, 2, 4, ... blocks) within the
    picked holder's match, which for a conversation is often the system
    prompt every conversation shares, held by more workers than its
    history. The caller applies the rule only where the router can make the
    copy itself (``proactive_copy``, a prefix of at least
    ``copy_min_prefix_share`` of the prompt): the request is then routed as
    before and no user pays the copy's prefill.
    """
    if not holders or any(candidates[i].in_flight == 0 for i in holders):
        return None
    idle = [
        i
        for i in eligible
        if i not in holders
        and candidates[i].in_flight == 0
        and candidates[i].pending_prefill_tokens == 0
        and _evicts_nothing(scored[i])
        and _small_copy(candidates[i], scored[i], prompt_tokens, max_kv_share)
    ]
    if not idle:
        return None
    other = _argmin(scored, idle)
    t = scored[other].terms
    assert t is not None  # _evicts_nothing
    matched = scored[picked].matched_tokens
    warm_s = t.ttft_s - candidates[other].profile.prefill_time(matched, 0.0) * t.scale
    holder_s = min(_ttft(scored[i]) for i in holders)
    if holder_s - warm_s <= warm_s * cls.warm_margin_rel + cls.warm_margin_abs_s:
        return None  # warm, it would be nearly as good as a holder is now: not worth a copy
    share = traffic_share()
    needed = math.ceil(share * len(candidates) - 1e-9)  # exactly k workers' share needs k
    if needed <= len(holders):
        return None
    idle_id = scored[other].worker_id
    reason = (
        f"hot prefix: {share:.0%} of the traffic, {needed} of {len(candidates)} workers' "
        f"share, {len(holders)} hold it, all busy, {idle_id} idle; warming {idle_id}"
    )
    return Choice(other, reason)


def _copy_blocks(w: WorkerView, c: CandidateScore, prompt_tokens: int) -> int:
    """KV blocks a copy of the prompt would add to ``w`` (``c`` its score)."""
    block = w.block_size if w.block_size > 1 else 1
    return math.ceil(max(0, prompt_tokens - c.matched_tokens) / block)


def _pinned_share(
    candidates: Sequence[WorkerView], scored: Sequence[CandidateScore], i: int, prompt_tokens: int
) -> float:
    """Worker ``i``'s KV share pinned by its running requests, with a copy of a
    ``prompt_tokens`` prompt on top (0: none); 0 if it reports no capacity."""
    w = candidates[i]
    if w.kv_capacity_blocks <= 0:
        return 0.0
    return (w.kv_used_blocks + _copy_blocks(w, scored[i], prompt_tokens)) / w.kv_capacity_blocks


def _least_holder_share(
    candidates: Sequence[WorkerView], scored: Sequence[CandidateScore], holders: Sequence[int]
) -> float:
    """The least KV share pinned on a holder that reports its capacity (0 if none
    does): where the request waits for memory if no copy is made."""
    return min(
        (_pinned_share(candidates, scored, i, 0) for i in holders
         if candidates[i].kv_capacity_blocks > 0),
        default=0.0,
    )  # fmt: skip


def _small_copy(w: WorkerView, c: CandidateScore, prompt_tokens: int, max_share: float) -> bool:
    """Whether a copy fills at most ``max_share`` of ``w``'s KV (unknown capacity: yes)."""
    capacity = w.kv_capacity_blocks
    return capacity <= 0 or _copy_blocks(w, c, prompt_tokens) <= max_share * capacity


def _ttft(c: CandidateScore) -> float:
    """The candidate's predicted first token (its score when it has no cost terms)."""
    return c.terms.ttft_s if c.terms is not None else c.score


def _evicts_nothing(c: CandidateScore) -> bool:
    """Whether storing the prompt on the candidate evicts no cached block."""
    return c.terms is not None and c.terms.eviction_s == 0.0


def first_prefill_rule(
    scored: Sequence[CandidateScore],
    candidates: Sequence[WorkerView],
    holders: Sequence[int],
    best: int,
) -> Choice | None:
    """Rule 1a, every holder still on its first prefill of the prefix: the one that ends first.

    Called when no holder of the deepest prefix has prefilled it yet (each
    holds it speculatively, no first token came), no worker is idle (an
    idle one is :func:`prefill_in_progress_rule`'s case) and the prefix is
    at least ``earliest_prefill_min_share`` of the prompt: a prefix sent to
    several workers at once, as when a fleet starts on one shared system
    prompt. (A short head that every prompt shares, a chat template's first
    blocks, says nothing of whose queued prefill is this request's.)
    Every holder's queue then counts its whole pending prefill, so they tie
    or differ by prompt length, and the lowest score is often the holder
    that *started last*. Here each holder is judged by its first token less
    the time its engine has been on the head of its queue
    (``prefill_elapsed_s``, at most the queue wait), and the one whose
    prefill ends first is taken, if its corrected first token is no later
    than the best worker's. ``None`` otherwise (the other rules decide).

    Crediting the elapsed prefill everywhere sent ever more requests onto a
    holder whose prefill was running and lost on most scenarios
    (``benchmarks/decision_quality_notes.md``); here it only orders holders
    that are all in the same state, and the corrected first token must
    still beat the best's uncorrected one. At system-prompt 0.9 (seed 0)
    the ninth slowest request, the p99, had queued 162 ms behind the holder
    that started last while the first had 50 ms left; now 86 ms.
    """
    pick, pick_ttft = -1, math.inf
    for i in holders:
        t = scored[i].terms
        if t is None:
            return None
        elapsed = candidates[i].prefill_elapsed_s
        ttft = t.ttft_s - (elapsed if elapsed < t.queue_wait_s else t.queue_wait_s)
        if ttft < pick_ttft:
            pick, pick_ttft = i, ttft
    b = scored[best].terms
    if b is None or pick_ttft > b.ttft_s:
        return None
    reason = (
        f"every holder still on its first prefill: {scored[pick].worker_id} ends first, "
        f"{pick_ttft * 1e3:.0f} ms"
    )
    return Choice(pick, reason)


def max_wait_rule(
    scored: Sequence[CandidateScore],
    warm: int,
    best: int,
    cls: OutputClassParams,
    externality: float = 0.0,
) -> Choice | None:
    """Rule 2, maximum wait: leave the ``warm`` choice when its queue is past ``max_warm_wait_s``.

    Off by default (the cap is infinite; see ``OutputClassParams``): the warm
    margin, with the switch's cost priced, decides. With a cap set, warm
    preference never makes a request wait behind more than
    ``max_warm_wait_s`` of queue; the ``best`` score is chosen instead, and
    the decision marked ``warm_abandoned``. Only when leaving actually avoids
    the wait (the best's queue is within it) and brings the first token
    sooner, counting what the copy's added prefill costs the requests that
    queue after it (``externality``, :func:`switch_externality`): under
    overload every queue is long, and a copy would only add prefill work.
    The wait counts the expected wait for KV memory
    (``memory_risk_s``) beside the queue: a warm worker whose memory is
    pinned by its running requests keeps a request waiting as surely as a
    long queue, where the cost model's queue term does not show it.
    """
    w, b = scored[warm].terms, scored[best].terms
    assert w is not None and b is not None
    limit = cls.max_warm_wait_s
    w_wait, b_wait = w.queue_wait_s + w.memory_risk_s, b.queue_wait_s + b.memory_risk_s
    if w_wait > limit and b_wait <= limit and b.ttft_s + externality < w.ttft_s:
        reason = (
            f"left warm {scored[warm].worker_id}: queue wait {w_wait * 1e3:.0f} ms"
            f" > max {limit * 1e3:.0f} ms"
        )
        return Choice(best, reason, abandoned=True)
    return None


def no_room_rule(
    scored: Sequence[CandidateScore],
    warm: int,
    best: int,
    holders: Sequence[int],
    roomy: Callable[[], Sequence[int]],
    needed: Callable[[], int],
) -> Choice | None:
    """Rule 3, no room: keep the ``warm`` choice when no other worker has room for a copy.

    Leaving the warm worker for a better score elsewhere (``best``, not a
    holder: moving to another holder copies nothing) copies the prefix
    there. Where every other worker's KV would be past ``copy_max_kv_share``
    with the copy on top of what its running requests pin (``roomy()``, from
    :func:`copy_room_filter`, holds no non-holder; called, like ``needed()``,
    only once the cheaper conditions hold: this runs on every warm request) and the cost model
    expects the ``best`` to make the request wait for memory
    (``memory_risk_s``), the copy waits for running requests there to
    finish, then evicts other prefixes that are still asked for, and the
    work it adds is paid by every request queued behind it: under cache
    pressure one-off copies spread each prefix over every cache and thrash
    them all (150 customer contexts that do not all fit,
    ``llmd-customers``). So the warm choice stays, unless the prefix's
    demand wants more replicas than hold it (``needed()``, computed only
    here: a hot document is worth its copy). Where the best has the memory
    now, the margin rule decides as without pressure. The maximum wait
    (rule 2) still applies before this rule.
    """
    terms = scored[best].terms
    if terms is None or terms.memory_risk_s <= 0.0:
        return None
    if best in holders or any(i not in holders for i in roomy()):
        return None
    replicas = needed()
    if replicas > len(holders):
        return None
    reason = (
        f"no room for a copy elsewhere: kept warm, {len(holders)} of {max(1, replicas)}"
        " replicas its demand needs hold it"
    )
    return Choice(warm, reason)


def prefill_in_progress_rule(
    scored: Sequence[CandidateScore],
    holder: WorkerView,
    warm: int,
    best: int,
    cls: OutputClassParams,
    eviction_weight: float,
    rate: float,
    seen: int,
) -> Choice | None:
    """Rule 4a, a prefill in progress: beside an idle worker, judge the holder by
    when its first token really comes, without the warm margin.

    Called when the best-scoring worker is idle (nothing in flight). The
    rule applies when requests for the prefix arrive faster than one per
    its prefill on the holder (``rate`` times the prefill of the prefix, in
    the holder's calibrated time, at least 1): its first prefill, or the
    last, is then likely still running, and requests queue behind it. Two
    things the score gets wrong there, in opposite directions:

    * the holder's queue counts the whole queued prefill, though the engine
      has been on it for ``prefill_elapsed_s`` (the ledger's), and
    * the requests for the prefix that arrive while it runs join the same
      engine step as this one (a chunked-prefill engine prefills every
      admitted request's chunk in one step, and each first token comes at
      the step's end), so each adds its own prefill to this first token:
      ``rate`` times the queue left, times this request's prefill; at most
      ``seen`` of them (the recent arrivals the rate comes from: a rate
      read from two arrivals a microsecond apart says a burst, not its
      size).

    The warm margin is the price of a copy; an idle worker with room is
    charged none by :func:`cache_pressure`, and a copy into it costs no
    request a wait, so only the first token decides: the holder is kept if
    its corrected score is no higher than the idle worker's, else the idle
    worker is taken (marked ``warm_abandoned`` when it holds less of the
    prompt: a copy); ``None`` where the rule
    does not apply (then the margin rule decides). Measured: at
    system-prompt's start, requests 2-4 had queued behind the first prefill
    of the shared prompt and taken 150-180 ms while idle workers would have
    taken about 160 ms; the 99th percentile was one of them (153 ms, now
    65-80 ms). Crediting the progress alone sent more requests onto the
    holder (each predicted less) and lost everywhere (doc-qa +18 to +84 %),
    and dropping the margin's floor for idle workers alone copied prefixes
    that were not queued for (templates p99 +33 %, Mooncake +24 %):
    ``benchmarks/decision_quality_notes.md``.
    """
    w, b = scored[warm], scored[best]
    t = w.terms
    if t is None or b.terms is None or rate <= 0.0 or w.matched_tokens <= 0:
        return None
    prefix_prefill = holder.profile.prefill_time(w.matched_tokens, 0.0) * t.scale
    if rate * prefix_prefill < 1.0:
        return None
    elapsed = holder.prefill_elapsed_s
    done = elapsed if elapsed < t.queue_wait_s else t.queue_wait_s
    joining = rate * (t.queue_wait_s - done)
    joining = seen if joining > seen else joining
    warm_s = switch_score(w, cls, eviction_weight) - done + joining * t.prefill_s
    cold_s = switch_score(b, cls, eviction_weight)
    if warm_s <= cold_s:
        reason = (
            f"warm, its prefill in progress: {warm_s * 1e3:.0f} ms <= "
            f"idle {b.worker_id} {cold_s * 1e3:.0f} ms"
        )
        return Choice(warm, reason)
    reason = (
        f"idle {b.worker_id} {cold_s * 1e3:.0f} ms before warm {w.worker_id} "
        f"{warm_s * 1e3:.0f} ms (its prefill in progress)"
    )
    return Choice(best, reason, abandoned=b.matched_tokens < w.matched_tokens)


def warm_margin_rule(
    scored: Sequence[CandidateScore],
    warm: int,
    best: int,
    cls: OutputClassParams,
    pressure: float,
    eviction_weight: float,
    externality: float = 0.0,
) -> Choice:
    """Rule 4, warm margin: keep the ``warm`` choice while it is within a margin of the ``best``.

    Kept while ``switch(warm) <= switch(best) + pressure * (ttft(best) *
    warm_margin_rel + warm_margin_abs_s)``, else the best is chosen. Leaving
    the deepest prefix copies it: a lasting cost, while a difference in
    decode batches evens out within one request's lifetime, so both sides
    are compared by :func:`switch_score` (decode weighed by the class's
    ``switch_decode_weight``, 0 for short answers, not ``decode_weight``).
    The relative part applies to the best's TTFT, not its whole score, so
    weighing decode does not widen it. ``pressure`` in [0, 1] is how full the
    best's cache would be (:func:`cache_pressure`, at least
    ``min_margin_share``): a copy into a cache with room evicts nothing.
    The best's side also pays ``externality`` (:func:`switch_externality`).
    Leaving is marked ``warm_abandoned``: the warm worker was too slow.
    """
    w, b = scored[warm], scored[best]
    assert b.terms is not None
    warm_switch = switch_score(w, cls, eviction_weight)
    cold_switch = switch_score(b, cls, eviction_weight) + externality
    limit = cold_switch + pressure * (b.terms.ttft_s * cls.warm_margin_rel + cls.warm_margin_abs_s)
    if warm_switch <= limit:
        # The decision log says how much of the cold side is the queue the
        # copy would delay (the rest is the cold worker's own prediction).
        queued = f", {externality * 1e3:.0f} ms of it the queue behind" if externality else ""
        reason = (
            f"warm within margin: {warm_switch * 1e3:.0f} ms <= "
            f"{limit * 1e3:.0f} ms (best cold {b.worker_id} {cold_switch * 1e3:.0f} ms{queued})"
        )
        return Choice(warm, reason)
    reason = (
        f"warm {w.worker_id} predicted {warm_switch * 1e3:.0f} ms, "
        f"beyond margin of {b.worker_id} {cold_switch * 1e3:.0f} ms"
    )
    return Choice(best, reason, abandoned=True)


def holder_band_rule(
    scored: Sequence[CandidateScore],
    picked: int,
    best: int,
    cls: OutputClassParams,
    band: float,
    eviction_weight: float,
) -> Choice:
    """Rule 4b, between holders: keep the picker's holder while its first token is within
    the calibration band of the best's, when the best holds the deepest prefix too.

    The picker took ``picked`` among the holders whose *scores* are within
    the tie band of the best (the fewest in flight, or for a one-off
    :func:`one_off_pick`'s key). A score puts the expected
    answer's decode (weighed by ``decode_weight``) beside the first token: a
    few hundred tokens of answer are seconds of decode against tens of
    milliseconds of TTFT, so a band of 10 % of the score can span a first
    token 40 % later. Going to ``best`` copies nothing, so the warm margin
    (the price of a copy, :func:`warm_margin_rule`) does not apply; the
    picker's choice is kept while ``switch(picked) <= switch(best) * (1 +
    band)`` (:func:`switch_score`, the first token and what a copy would
    evict, decode weighed by ``switch_decode_weight``), ``band`` being how
    far the holders' calibrations disagree (:func:`calibration_band`), and
    the best is taken otherwise. On system-prompt, where every worker holds
    the prompt, the p99 at load 0.6 was such requests: 64 ms on the picker's
    holder where the best holder predicted 45 ms (the margin kept it).
    """
    w, b = scored[picked], scored[best]
    picked_switch = switch_score(w, cls, eviction_weight)
    best_switch = switch_score(b, cls, eviction_weight)
    limit = best_switch * (1.0 + band)
    if picked_switch <= limit:
        reason = (
            f"the picker's holder within the band: {picked_switch * 1e3:.0f} ms <= "
            f"{limit * 1e3:.0f} ms (best holder {b.worker_id} {best_switch * 1e3:.0f} ms)"
        )
        return Choice(picked, reason)
    reason = (
        f"holder {w.worker_id} predicted {picked_switch * 1e3:.0f} ms, beyond the "
        f"calibration band of holder {b.worker_id} {best_switch * 1e3:.0f} ms"
    )
    return Choice(best, reason)


def copy_rule(scored: Sequence[CandidateScore], choice: Choice, copy: Choice) -> Choice:
    """Rule 5, the copy's own request (``proactive_copy``): the request warms the copy
    itself when its first token comes no later there, cold prefill included.

    ``copy`` is the hot-prefix rule's verdict, set aside so that rules 2-4
    could route the request as if no copy were due (``choice``). The copy
    is made either way; the question left is who pays its prefill. When
    the request's predicted first token on the copy target is no later than
    on the choice, it loses nothing by paying it, and no prefill-only copy
    of the router's own is needed: one prefill instead of two, and no
    request is kept on a holder that the warm margin would keep only to
    avoid a copy that is being made anyway. Under load this is the common
    case: the holders' queues are what made the prefix hot (Mooncake at
    load 0.9: without this rule the request stayed on a long holder queue,
    985 -> 1,343 ms mean with copies on; with it, 986 ms).

    The first token, not the score. A score adds the answer's weighted
    decode (0.2 x seconds) to a first token of tens of milliseconds, so an
    idle copy target, which decodes faster, often scores lower while its
    cold prefill makes the first token three times later: at templates'
    load 0.6, four user requests paid a form's copy at 89-156 ms beside
    warm first tokens of 20-50 ms, and they set the p99 (now 9-11 % lower
    over seeds 0-3, 34 % over seeds 4-15). Comparing first tokens was tried
    before, when the warm margin still judged holders against each other,
    and kept doc-qa's questions on holders whose long-context batches were
    what made the document hot (load 0.9 mean +8 to +9 %); beside
    :func:`holder_band_rule` doc-qa 0.9 moves within noise over seeds 0-15
    (``benchmarks/decision_quality_notes.md``).
    """
    c, h = scored[copy.index].terms, scored[choice.index].terms
    if copy.index != choice.index and c is not None and h is not None and c.ttft_s <= h.ttft_s:
        return copy
    return choice


def switch_externality(
    warm: CostTerms | None,
    best: CostTerms | None,
    warm_waiting: int,
    best_waiting: int,
    weight: float,
    other_rate: float = 0.0,
    own_rate: float = 0.0,
) -> float:
    """What leaving ``warm`` for ``best`` costs the other requests, in seconds.

    A prefill put into a worker's queue delays every request that joins
    that queue before it drains. Two kinds join before then: about as many
    as wait there now (Little's law: the arrivals during the drain of the
    queue ahead are the arrival rate times its wait, which is the queue's
    length), and those that arrive while the prefill itself runs: the
    per-worker arrival rate of requests for other prefixes (``other_rate``)
    times its length, so a long copy into an idle worker still delays the
    requests that reach that worker meanwhile. Leaving puts ``best``'s
    prefill ``p_b`` (a copy: the whole uncached prompt) before the
    requests on ``best`` (``best_waiting`` now, not yet past their first
    token) and spares ``warm``'s ``p_w`` (the suffix only) before those on
    ``warm``::

        added = p_b * (n_b + other_rate * p_b) - p_w * (n_w + other_rate * p_w)

    times ``weight``, nothing when negative. A delayed request holds up
    those behind it in turn: in a queue at utilisation rho, work added
    extends the busy period by 1 / (1 - rho) times its length, so near
    saturation the cost compounds (the default 10 is that factor at
    rho = 0.9).

    The copy also gives the prefix a second replica: its own requests that
    arrive while the warm worker's wait ``W`` (queue and KV memory) drains,
    ``own_rate`` a second, can be served there instead, the one arriving at
    ``t`` sooner by up to ``W - t``: ``own_rate * W**2 / 2`` in all, taken
    off the cost. A hot document's copy pays for itself; a conversation's
    rarely does, its next turn comes after the queue has drained (on the
    whole Mooncake conversation trace at load 0.9, without the copy's own
    drain the mean TTFT was 1.71 s, with it 1.22 s; without the relief,
    doc-qa at 0.9 lost copies its documents needed, seed 0: 235 -> 383 ms).

    A target with nothing waiting and no other traffic delays no one, so a
    document that needs a second replica still gets one while the fleet
    has room (an earlier form charged the fleet's mean
    backlog to every copy, and live doc-qa kept its documents on the
    holders whose queues made that backlog, 1.30-1.58 s against 0.82 s).
    """
    if warm is None or best is None or weight <= 0.0:
        return 0.0
    b, w = best.prefill_s, warm.prefill_s
    added = b * (best_waiting + other_rate * b) - w * (warm_waiting + other_rate * w)
    wait = warm.queue_wait_s + warm.memory_risk_s
    cost = (weight * added if added > 0.0 else 0.0) - own_rate * wait * wait / 2.0
    return cost if cost > 0.0 else 0.0


def switch_score(c: CandidateScore, cls: OutputClassParams, eviction_weight: float) -> float:
    """The score that compares a warm worker with a cold one (see :func:`warm_margin_rule`)."""
    t = c.terms
    assert t is not None
    return t.ttft_s + cls.switch_decode_weight * t.decode_s + eviction_weight * t.eviction_s


def cache_pressure(index: PrefixIndex, worker: WorkerId, blocks: int) -> float:
    """How full ``worker``'s cache would be with ``blocks`` more, in [0, 1] (per the index).

    The warm margin is the price of copying a prefix into another cache: a
    worker with room takes the copy without evicting anything (no margin, so
    cold replicas warm up in parallel, as round robin would); a full one would
    evict other prefixes (the whole margin).
    """
    capacity = index.capacity(worker)
    if capacity <= 0:
        return 1.0
    return min(1.0, (index.blocks_of(worker) + blocks) / capacity)


def margin_limit(best: CandidateScore, cls: OutputClassParams, pressure: float) -> float:
    """The highest score that counts as within the margin of ``best``.

    The relative part of the margin applies to the best candidate's
    predicted TTFT, not its whole score, so weighing decode time does not
    widen it; ``pressure`` in [0, 1] scales the whole margin.
    """
    return best.score + pressure * (_ttft(best) * cls.warm_margin_rel + cls.warm_margin_abs_s)


# ------------------------------------------------------------------ cold path


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
    pi = _argmin(scored, pool_idx)
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
    session: ``_Reuse.followed``; before any such evidence, the picker
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
    home = max(near, key=lambda i: _rendezvous(first_block, scored[i].worker_id))
    return home, len(near)


# -------------------------------------------------------------------- helpers


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


def _tracked_depth(blocks: int) -> int:
    """The deepest tracked prefix (1, 2, 4, ... blocks) a prefix of ``blocks`` >= 1 covers."""
    return 1 << (blocks.bit_length() - 1)


def _tracked_blocks(blocks: PromptBlocks, matched_tokens: int) -> int:
    """Blocks of the deepest tracked prefix within ``matched_tokens``; 0 below one block."""
    depth = int(matched_tokens // blocks.block_tokens)
    return 0 if depth <= 0 else _tracked_depth(depth)


def _tracked_key(hashes: Sequence[int], blocks: int) -> int:
    """The demand table's key for a prefix of ``blocks`` blocks (``blocks`` >= 1): the
    hash ending the deepest tracked prefix it covers."""
    return hashes[_tracked_depth(blocks) - 1]


def _deepest_match(ctx: RoutingContext) -> int:
    """Blocks of the longest prefix any worker holds, at most the prompt's."""
    n = len(ctx.blocks.hashes)
    deepest = max((m.blocks for m in ctx.matches.values()), default=0)
    return deepest if deepest < n else n


def _reuse_mark(hashes: Sequence[int], matched: int) -> int | None:
    """The block hash that marks new content past ``matched`` blocks (None: none).

    The first tracked depth (1, 2, 4, ... blocks) past the match, or the last
    block when the prompt ends before it (``PrefixAwarePolicy._count_reuse``).
    """
    n = len(hashes)
    if n <= matched:
        return None
    first = 1 << matched.bit_length()
    return hashes[first - 1 if first <= n else n - 1]


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


def _rendezvous(block: int, worker: WorkerId) -> int:
    """Highest-random-weight score of (prefix, worker): stable across processes."""
    return int(xxhash.xxh3_64_intdigest(worker.encode("utf-8"), block & 0xFFFF_FFFF_FFFF_FFFF))


def _argmin(scored: Sequence[CandidateScore], indices: Sequence[int]) -> int:
    """Index of the lowest score; ties go to the earliest (deterministic)."""
    best = -1
    best_score = math.inf
    for i in indices:
        s = scored[i].score
        if s < best_score:
            best, best_score = i, s
    return best
