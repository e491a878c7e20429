"""Session affinity: keep a conversation on the worker that holds its history.

A client that names its conversation (the gateway's ``X-Session-ID`` header)
gets its next turn routed where the last one was served, as long as keeping
it there is still the cache-aware choice a router would defend:

1. the worker can still serve the request (it passed every filter: healthy,
   model, adapter, tenant, pool), else the pin breaks with ``down`` (the
   health filter removed it, or the worker is gone) or ``filtered`` (another
   filter did);
2. **its prefix is still cached**: the index says the worker holds at least
   ``min_cached_tokens`` of this prompt (a share of the tokens the session's
   last turn sent, so a worker that kept only the system prompt every session
   shares does not count) with at least ``min_confidence``; else ``evicted``;
3. **the wait bound holds**: the cost model's predicted queue wait on the
   worker is at most ``max_wait_s`` (4 s by default; past it the policy,
   which weighs the wait against a copy's prefill, decides); else ``overloaded``.

When all three hold, :func:`hold_pin` returns the selection (tier
``affinity``) and the policy is not asked; otherwise the normal decision runs
and the driver moves the pin to wherever the request is served.

:class:`SessionTable` is the bounded table of pins (least recently used
sessions dropped first). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prefixrouter.core.policy import CandidateScore, RoutingContext, Selection
from prefixrouter.core.types import WorkerId, WorkerView

AFFINITY_TIER = "affinity"
HIT = "hit"
"""The pin held."""
BREAK_REASONS = ("down", "filtered", "evicted", "overloaded")
"""Why a pin broke (see the module docstring), in the order they are checked."""


@dataclass(frozen=True, slots=True)
class Pin:
    """A session's pin, as the driver hands it to :meth:`Router.route`.

    Attributes:
        worker: The worker that served the session's last turn.
        min_cached_tokens: Tokens of this prompt the index must say it holds.
        min_confidence: Least trust in that match.
        max_wait_s: Longest predicted queue wait on it.
    """

    worker: WorkerId
    min_cached_tokens: int = 1
    min_confidence: float = 0.5
    max_wait_s: float = 4.0


def hold_pin(
    pin: Pin,
    allowed: Sequence[WorkerView],
    removed: Mapping[WorkerId, str],
    ctx: RoutingContext,
) -> tuple[Selection | None, str]:
    """Keep the request on ``pin.worker`` if the rules hold (module docstring).

    Args:
        pin: The session's pin.
        allowed: The workers that passed the router's filters.
        removed: Worker -> the filter that removed it.
        ctx: The request's routing context (its blocks and index matches).

    Returns:
        ``(selection, "hit")`` when the pin holds, else ``(None, reason)`` with
        the reason one of :data:`BREAK_REASONS`.
    """
    wid = pin.worker
    view = next((w for w in allowed if w.worker_id == wid), None)
    if view is None:
        why = removed.get(wid)
        return None, "filtered" if why is not None and why != "health" else "down"
    blocks = ctx.blocks
    prompt = blocks.prompt_tokens
    m = ctx.matches.get(wid)
    held = 0
    confidence = 0.0
    if m is not None:
        # Engines recompute the last token of a fully cached prompt: only the
        # whole blocks before it are reusable (as the policies count them).
        reusable = int((prompt - 1) // blocks.block_tokens * blocks.block_tokens) if prompt else 0
        held = min(int(m.blocks * blocks.block_tokens), reusable)
        confidence = m.confidence
    if held <= 0 or held < pin.min_cached_tokens or confidence < pin.min_confidence:
        return None, "evicted"
    terms = ctx.cost.predict(view, prompt, held, confidence, ctx.output_tokens)
    if terms.queue_wait_s > pin.max_wait_s:
        return None, "overloaded"
    reason = (
        f"session pinned to {wid}: {held} of {prompt} tokens cached, "
        f"queue wait {terms.queue_wait_s * 1e3:.0f} ms"
    )
    candidate = CandidateScore(wid, held, confidence, terms, terms.ttft_s)
    return Selection(wid, AFFINITY_TIER, reason, held, (candidate,)), HIT


@dataclass(slots=True)
class SessionEntry:
    """Where a session's last turn was served.

    Attributes:
        worker: The worker.
        prompt_tokens: That turn's prompt length (estimated in text mode).
    """

    worker: WorkerId
    prompt_tokens: int


class SessionTable:
    """Session key -> :class:`SessionEntry`, at most ``max_sessions`` (LRU).

    Args:
        max_sessions: Bound on the table; the least recently used session
            (looked up or pinned) is dropped first.
        min_cached_share: Share of the last turn's prompt the worker must
            still hold for the next turn to stay (:attr:`Pin.min_cached_tokens`).
        min_confidence: :attr:`Pin.min_confidence`.
        max_wait_s: :attr:`Pin.max_wait_s`.
    """

    def __init__(
        self,
        max_sessions: int = 100_000,
        min_cached_share: float = 0.5,
        min_confidence: float = 0.5,
        max_wait_s: float = 4.0,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.min_cached_share = min_cached_share
        self.min_confidence = min_confidence
        self.max_wait_s = max_wait_s
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session: str) -> SessionEntry | None:
        """The session's entry (refreshes its recency), None if unknown."""
        entry = self._entries.get(session)
        if entry is not None:
            self._entries.move_to_end(session)
        return entry

    def pin_for(self, session: str) -> Pin | None:
        """The pin to route the session's next turn with, None if it has none."""
        entry = self.get(session)
        if entry is None:
            return None
        need = max(1, int(self.min_cached_share * entry.prompt_tokens))
        return Pin(entry.worker, need, self.min_confidence, self.max_wait_s)

    def pin(self, session: str, worker: WorkerId, prompt_tokens: int) -> None:
        """The session's turn was served on ``worker``: its next turn goes there."""
        entries = self._entries
        entries[session] = SessionEntry(worker, prompt_tokens)
        entries.move_to_end(session)
        while len(entries) > self.max_sessions:
            entries.popitem(last=False)
