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
only state, kept by its hooks (:mod:`.demand` says how it is counted and
bounded).

Parameters per output class live in :class:`OutputClassParams`; requests
expected to decode at least ``long_output_tokens`` use ``long`` (the expected
output is ``RoutingContext.output_tokens``: a client's ``max_tokens`` is a
cap, and :mod:`prefixrouter.core.output` learns how much of it answers use).

The package keeps one step per module: :mod:`.params` (the parameters),
:mod:`.scorer` (steps 1 and 2), :mod:`.picker` (step 3), :mod:`.rules`
(step 4: the rules that keep or leave the warm choice), :mod:`.copies` (the
rules that copy a prefix, and the copy's room), :mod:`.cold_path`,
:mod:`.choice` (what a rule returns, and the readings of a score that the
rules share), :mod:`.demand` (the policy's state) and :mod:`.policy`
(:class:`PrefixAwarePolicy`: the steps composed, and the hooks). Each step
is pure and imports only what it reads; only :mod:`.policy` knows the
order.
"""

from __future__ import annotations

from prefixrouter.core.policies.prefix_aware.choice import (
    Choice,
    cache_pressure,
    margin_limit,
    switch_score,
)
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
)
from prefixrouter.core.policies.prefix_aware.params import OutputClassParams, PrefixAwareParams
from prefixrouter.core.policies.prefix_aware.picker import (
    calibration_band,
    deepest_holders,
    holder_kv_wait_rank,
    one_off_pick,
    profile_first_token,
    tie_band_picker,
)
from prefixrouter.core.policies.prefix_aware.policy import PrefixAwarePolicy
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

__all__ = [
    "Choice",
    "OutputClassParams",
    "PrefixAwareParams",
    "PrefixAwarePolicy",
    "cache_pressure",
    "calibration_band",
    "cold_pool_rule",
    "cold_quota_filter",
    "copy_room_filter",
    "copy_rule",
    "deepest_holders",
    "first_prefill_rule",
    "holder_band_rule",
    "holder_kv_wait_rank",
    "hot_prefix_rule",
    "idle_copy_rule",
    "margin_limit",
    "max_wait_rule",
    "new_home_rule",
    "no_room_rule",
    "one_off_pick",
    "prefill_in_progress_rule",
    "profile_first_token",
    "rendezvous_home",
    "score_candidates",
    "switch_externality",
    "switch_score",
    "tie_band_picker",
    "warm_margin_rule",
]
