"""The rules that copy a prefix: hot prefix, idle capacity, and the copy itself.

A prefix gets another replica when its demand needs more than hold it
(:func:`hot_prefix_rule`) or when its busy holders carry more than their
share of the traffic beside an idle worker (:func:`idle_copy_rule`); only
into workers with room for it (:func:`copy_room_filter`, read beside the
holders' own pinned share). The router makes such a copy itself where it
can (a prefill-only request), and :func:`copy_rule` sends the request that
asked for it to the copy when its first token comes no later there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from prefixrouter.core.policies.prefix_aware.choice import (
    Choice,
    argmin,
    evicts_nothing,
    predicted_ttft,
)
from prefixrouter.core.policies.prefix_aware.params import OutputClassParams
from prefixrouter.core.policy import CandidateScore
from prefixrouter.core.types import WorkerView


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
    least = least_holder_share(candidates, scored, holders) if beside_holders else 0.0
    kept: list[int] = []
    for i in eligible:
        if i in holders or candidates[i].kv_capacity_blocks <= 0:
            kept.append(i)
            continue
        share = pinned_share(candidates, scored, i, prompt_tokens)
        if share <= max_share or share < least:
            kept.append(i)
    return kept


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
    other = argmin(scored, others)
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
        and evicts_nothing(scored[i])
        and _small_copy(candidates[i], scored[i], prompt_tokens, max_kv_share)
    ]
    if not idle:
        return None
    other = argmin(scored, idle)
    t = scored[other].terms
    assert t is not None  # evicts_nothing
    matched = scored[picked].matched_tokens
    warm_s = t.ttft_s - candidates[other].profile.prefill_time(matched, 0.0) * t.scale
    holder_s = min(predicted_ttft(scored[i]) for i in holders)
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


def pinned_share(
    candidates: Sequence[WorkerView], scored: Sequence[CandidateScore], i: int, prompt_tokens: int
) -> float:
    """Worker ``i``'s KV share pinned by its running requests, with a copy of a
    ``prompt_tokens`` prompt on top (0: none); 0 if it reports no capacity."""
    w = candidates[i]
    if w.kv_capacity_blocks <= 0:
        return 0.0
    return (w.kv_used_blocks + _copy_blocks(w, scored[i], prompt_tokens)) / w.kv_capacity_blocks


def least_holder_share(
    candidates: Sequence[WorkerView], scored: Sequence[CandidateScore], holders: Sequence[int]
) -> float:
    """The least KV share pinned on a holder that reports its capacity (0 if none
    does): where the request waits for memory if no copy is made."""
    return min(
        (pinned_share(candidates, scored, i, 0) for i in holders
         if candidates[i].kv_capacity_blocks > 0),
        default=0.0,
    )  # fmt: skip


def _small_copy(w: WorkerView, c: CandidateScore, prompt_tokens: int, max_share: float) -> bool:
    """Whether a copy fills at most ``max_share`` of ``w``'s KV (unknown capacity: yes)."""
    capacity = w.kv_capacity_blocks
    return capacity <= 0 or _copy_blocks(w, c, prompt_tokens) <= max_share * capacity


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
