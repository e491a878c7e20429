"""Steps 1 and 2: every candidate's score, and the cold quota's filter.

:func:`score_candidates` predicts each candidate's cost terms and scores
them (first token, plus the output class's weight of decode and the
eviction a copy would cause), and says which are warm;
:func:`cold_quota_filter` keeps warm traffic off each worker's last share of
slots while another has room, so cold requests find one.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixrouter.core.policies.prefix_aware.params import OutputClassParams, PrefixAwareParams
from prefixrouter.core.policy import CandidateScore, RoutingContext
from prefixrouter.core.types import WorkerView


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
