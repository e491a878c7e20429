"""Step 4, the rules that may leave the picker's warm choice for a better worker.

Each judges the warm worker the picker chose against the best score
overall: every holder still on its first prefill (:func:`first_prefill_rule`),
the maximum wait (:func:`max_wait_rule`, off by default), no room for a
copy (:func:`no_room_rule`), a prefill in progress beside an idle worker
(:func:`prefill_in_progress_rule`), then :func:`holder_band_rule` when the
best holds the prefix too, else the warm margin (:func:`warm_margin_rule`).
Leaving a warm worker copies its prefix; :func:`switch_externality` prices
what that copy costs the requests around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from prefixrouter.core.cost import CostTerms
from prefixrouter.core.policies.prefix_aware.choice import Choice, switch_score
from prefixrouter.core.policies.prefix_aware.params import OutputClassParams
from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.types import WorkerView


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
