"""The policy's state: demand per prefix and how often new content is reused.

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

A prefix is tracked by the hash of its last block (:func:`tracked_key`),
at depths of 1, 2, 4, 8, ... blocks (:func:`tracked_depth`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from prefixrouter.core.hashing import PromptBlocks
from prefixrouter.core.types import WorkerId


@dataclass(slots=True)
class Demand:
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
    reuse: Reuse | None = None

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
class Reuse:
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


def tracked_depth(blocks: int) -> int:
    """The deepest tracked prefix (1, 2, 4, ... blocks) a prefix of ``blocks`` >= 1 covers."""
    return 1 << (blocks.bit_length() - 1)


def tracked_blocks(blocks: PromptBlocks, matched_tokens: int) -> int:
    """Blocks of the deepest tracked prefix within ``matched_tokens``; 0 below one block."""
    depth = int(matched_tokens // blocks.block_tokens)
    return 0 if depth <= 0 else tracked_depth(depth)


def tracked_key(hashes: Sequence[int], blocks: int) -> int:
    """The demand table's key for a prefix of ``blocks`` blocks (``blocks`` >= 1): the
    hash ending the deepest tracked prefix it covers."""
    return hashes[tracked_depth(blocks) - 1]


def reuse_mark(hashes: Sequence[int], matched: int) -> int | None:
    """The block hash that marks new content past ``matched`` blocks (None: none).

    The first tracked depth (1, 2, 4, ... blocks) past the match, or the last
    block when the prompt ends before it (``PrefixAwarePolicy._count_reuse``).
    """
    n = len(hashes)
    if n <= matched:
        return None
    first = 1 << matched.bit_length()
    return hashes[first - 1 if first <= n else n - 1]
