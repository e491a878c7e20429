"""Parameters of ``prefix_aware``: per output class and for the whole policy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
