"""``kubeai_chwbl``: KubeAI's ``PrefixHash`` strategy, consistent hashing with bounded loads.

Per PEERS.md: the key is the adapter name plus the first 100 characters of the
first user message, hashed with xxhash64 onto a ring where every endpoint has
256 virtual nodes (``xxh64(endpoint + str(i))``). Walking clockwise from the
key, take the first endpoint whose load satisfies::

    in_flight <= (total_in_flight + 1) / n * load_factor      (load_factor 1.25)

where ``in_flight`` is the router's own count of requests sent to an endpoint
and not finished (``WorkerView.in_flight``, filled from the driver's ledger)
and ``n`` the number of candidates. If none qualifies, the key's first
endpoint. Requests sharing a key therefore stick to one endpoint until it
carries more than its bounded share, then spill to the next one on the ring.

Approximation: simulated requests carry token ids, not text. The key uses
``request.first_user_text[:prefix_chars]`` when the driver set it; otherwise
the token ids ``tokens[first_user_offset : first_user_offset + prefix_chars /
CHARS_PER_TOKEN]`` (25 tokens ~ 100 characters at 4 characters a token); a
text-mode request without ``first_user_text`` keys on its first characters.

Stateless: the ring is a function of the candidate set, memoized in a small
module-level LRU cache (pure function, bounded), so ``select`` is pure and
``on_worker_removed`` has nothing to forget. KubeAI has no notion of cached
tokens: ``predicted_cached_tokens`` is 0.

``CandidateScore.score`` = the candidate's position in the clockwise walk
(0 = the key's own endpoint). Tiers: ``home`` (the key's endpoint),
``spill`` (a later one, the bound excluded earlier ones), ``overloaded``
(none qualified: the first).
"""

from __future__ import annotations

import bisect
import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from prefixrouter.core.policies.common import CHARS_PER_TOKEN
from prefixrouter.core.policy import CandidateScore, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import RoutingRequest, WorkerId, WorkerView


@dataclass(frozen=True, slots=True)
class KubeaiChwblParams:
    """Parameters of ``kubeai_chwbl`` (KubeAI defaults).

    Attributes:
        replication: Virtual nodes per endpoint on the ring.
        load_factor: Bound on an endpoint's load relative to the mean (+1).
        prefix_chars: Characters of the first user message in the key.
    """

    replication: int = 256
    load_factor: float = 1.25
    prefix_chars: int = 100


def key_bytes(request: RoutingRequest, prefix_chars: int) -> bytes:
    """The bytes KubeAI hashes: adapter, then the start of the first user message."""
    head = request.adapter.encode("utf-8")
    if request.first_user_text is not None:
        return head + request.first_user_text[:prefix_chars].encode("utf-8")
    if request.tokens is not None:
        n = max(1, round(prefix_chars / CHARS_PER_TOKEN))
        start = request.first_user_offset
        return head + array("I", request.tokens[start : start + n]).tobytes()
    assert request.text is not None
    return head + request.text[:prefix_chars].encode("utf-8")


@functools.lru_cache(maxsize=64)
def _ring(endpoints: tuple[WorkerId, ...], replication: int) -> tuple[list[int], list[WorkerId]]:
    """Sorted virtual-node hashes and their owners, for one set of endpoints."""
    nodes = sorted(
        (xxhash.xxh64_intdigest(f"{e}{i}".encode()), e)
        for e in endpoints
        for i in range(replication)
    )
    return [h for h, _ in nodes], [e for _, e in nodes]


def walk(key: int, endpoints: tuple[WorkerId, ...], replication: int) -> list[WorkerId]:
    """Endpoints in clockwise order from ``key``, each once.

    Args:
        key: The request's 64-bit key hash.
        endpoints: The candidate endpoints.
        replication: Virtual nodes per endpoint.
    """
    hashes, owners = _ring(endpoints, replication)
    start = bisect.bisect_left(hashes, key)
    order: list[WorkerId] = []
    seen: set[WorkerId] = set()
    size = len(owners)
    for k in range(size):
        e = owners[(start + k) % size]
        if e not in seen:
            seen.add(e)
            order.append(e)
            if len(order) == len(endpoints):
                break
    return order


@register
class KubeaiChwbl(Policy):
    """Consistent hashing of the conversation's start, with bounded loads."""

    name = "kubeai_chwbl"
    Params = KubeaiChwblParams
    params: KubeaiChwblParams

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        p = self.params
        key = xxhash.xxh64_intdigest(key_bytes(ctx.request, p.prefix_chars))
        by_id = {w.worker_id: w for w in candidates}
        order = walk(key, tuple(by_id), max(1, p.replication))
        position = {e: i for i, e in enumerate(order)}
        scores = tuple(CandidateScore(w.worker_id, score=position[w.worker_id]) for w in candidates)
        total = sum(w.in_flight for w in candidates)
        bound = (total + 1) / len(candidates) * p.load_factor
        for i, e in enumerate(order):
            load = by_id[e].in_flight
            if load <= bound:
                tier = "home" if i == 0 else "spill"
                reason = (
                    f"ring position {i} for key {key:016x}: {load} in flight <= bound {bound:.2f}"
                )
                return Selection(e, tier, reason, 0, scores)
        reason = f"every endpoint above the bound {bound:.2f}: the key's first endpoint"
        return Selection(order[0], "overloaded", reason, 0, scores)
