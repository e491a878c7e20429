"""Per-tenant limits and priority: the pure rules (no clock reads, no I/O, no asyncio).

Every function here takes the time as an argument, so the rules are tested
without a clock; :mod:`prefixrouter.gateway.controls` applies them to live
requests.

**Rate** (:class:`~prefixrouter.core.bucket.TokenBucket`): a tenant with
``requests_per_s = r`` and ``burst = b`` has a bucket of ``b`` tokens,
refilled continuously at ``r`` a second. A request takes one token; with none
left it is refused, and told when the next token comes: ``Retry-After`` is
that wait rounded *up* to whole seconds (HTTP's unit), so a client that
honours it is never refused again for the same reason. A refused request takes
nothing.

**In flight** (:class:`TenantLimiter`): a tenant with ``max_in_flight = n``
has at most ``n`` requests between admission and their last byte; the
``n + 1``-th is refused (``Retry-After``: ``proxy.retry_after_s``, since when a
request ends cannot be known). The in-flight cap is checked before the
bucket, so a request refused for concurrency costs no token.

**Priority under overload** (:class:`WaitQueue`): when the gateway holds as
many requests as its capacity (``overload.max_in_flight``), a newcomer waits
in one queue for every tenant, ordered by its *virtual arrival*::

    key = arrival_time - priority * aging_s

The smallest key goes first (ties: first come). A request of priority ``p``
is thus served as if it had arrived ``p * aging_s`` earlier: higher priority
goes first, and each waiting request's standing improves against newcomers
as it waits. That is the starvation bound: a request of priority ``p`` that
arrives at ``t`` is admitted before every request of priority ``q`` that
arrives after ``t + (q - p) * aging_s``. However long a flood of priority
``q`` lasts, a lower priority's wait behind it is bounded by that gap plus the
time the capacity takes to serve what arrived before it. When the queue is
full (``overload.max_queue``), the request with the largest key (the newest
of the lowest priority) is shed, and a request that waits longer than
``overload.max_wait_s`` is shed too: both are answered 503 ``overloaded``.

The keys never change while requests wait (every waiter ages at the same
rate), so the order is a sorted list, kept with ``bisect``.
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass, field
from itertools import count
from typing import Generic, TypeVar

from prefixrouter.core.bucket import TokenBucket

T = TypeVar("T")

IDLE_TENANTS_MAX = 10_000
"""Tenants whose state :class:`TenantLimiter` keeps; past it, idle ones are forgotten."""


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits (None: no limit of that kind).

    Attributes:
        max_in_flight: Requests admitted and not finished.
        requests_per_s: Sustained request rate.
        burst: Requests above the rate allowed at once (None: ``ceil(requests_per_s)``).
    """

    max_in_flight: int | None = None
    requests_per_s: float | None = None
    burst: int | None = None

    @property
    def limited(self) -> bool:
        """Any limit is set."""
        return self.max_in_flight is not None or self.requests_per_s is not None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused, and when to try again.

    Attributes:
        reason: ``max_in_flight``, ``rate`` (429s) or ``queue_full``, ``queue_timeout`` (503s).
        retry_after_s: Whole seconds for ``Retry-After`` (at least 1).
        message: What the client reads.
    """

    reason: str
    retry_after_s: int
    message: str


def retry_after(wait_s: float) -> int:
    """A wait as ``Retry-After`` seconds: rounded up, at least 1."""
    return max(1, math.ceil(wait_s - 1e-9))


@dataclass(slots=True)
class _TenantState:
    in_flight: int = 0
    bucket: TokenBucket | None = None


class TenantLimiter:
    """Counts each tenant's requests in flight and takes from its bucket.

    Args:
        limits: The limits of the tenants that have their own rule.
        default: The limits of every other tenant (each with its own count and bucket).
        busy_retry_after_s: ``Retry-After`` of a refusal for concurrency.
    """

    def __init__(
        self, limits: dict[str, TenantLimit], default: TenantLimit, busy_retry_after_s: int
    ) -> None:
        self._limits = limits
        self._default = default
        self._busy_retry = busy_retry_after_s
        self._tenants: dict[str, _TenantState] = {}

    def limit_of(self, tenant: str) -> TenantLimit:
        """The limits that apply to ``tenant`` (its own, else the default rule's)."""
        return self._limits.get(tenant, self._default)

    def acquire(self, tenant: str, now: float) -> Refusal | None:
        """Admit one request of ``tenant`` (counted in flight), or say why not."""
        limit = self.limit_of(tenant)
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= IDLE_TENANTS_MAX:
                self._forget_idle(now)
            state = self._tenants[tenant] = _TenantState()
            if limit.requests_per_s is not None:
                burst = limit.burst if limit.burst is not None else math.ceil(limit.requests_per_s)
                state.bucket = TokenBucket(limit.requests_per_s, max(1, burst))
        who = f"tenant {tenant!r}" if tenant else "anonymous requests"
        cap = limit.max_in_flight
        if cap is not None and state.in_flight >= cap:
            return Refusal(
                "max_in_flight",
                self._busy_retry,
                f"{who} already has {state.in_flight} requests in flight (limit {cap})",
            )
        if state.bucket is not None:
            wait = state.bucket.take(now)
            if wait > 0.0:
                rate = state.bucket.rate
                return Refusal(
                    "rate",
                    retry_after(wait),
                    f"{who} is over its rate limit of {rate:g} requests per second",
                )
        state.in_flight += 1
        return None

    def release(self, tenant: str) -> None:
        """One admitted request of ``tenant`` finished."""
        state = self._tenants.get(tenant)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per tenant seen (for the gauge)."""
        return {t: s.in_flight for t, s in self._tenants.items()}

    def _forget_idle(self, now: float) -> None:
        """Drop tenants with nothing in flight and a full bucket: they hold no state."""
        idle = [
            t
            for t, s in self._tenants.items()
            if s.in_flight == 0 and (s.bucket is None or s.bucket.full(now))
        ]
        for t in idle:
            del self._tenants[t]


@dataclass(order=True, slots=True)
class _Entry(Generic[T]):
    key: float
    seq: int
    item: T = field(compare=False)


class WaitQueue(Generic[T]):
    """Requests waiting for capacity, in virtual-arrival order (module docstring).

    Args:
        aging_s: Seconds of arrival one priority level is worth.
        max_len: Most waiting requests; past it the last in order is shed.
    """

    def __init__(self, aging_s: float, max_len: int) -> None:
        if aging_s <= 0 or max_len < 0:
            raise ValueError(f"aging_s must be > 0 and max_len >= 0, got {aging_s}, {max_len}")
        self.aging_s = aging_s
        self.max_len = max_len
        self._entries: list[_Entry[T]] = []
        self._seq = count()

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, priority: int, arrival: float) -> float:
        """The virtual arrival of a request: smaller goes first."""
        return arrival - priority * self.aging_s

    def push(self, item: T, priority: int, arrival: float) -> T | None:
        """Queue ``item``; returns the item shed to make room (maybe ``item``), else None."""
        entry = _Entry(self.key(priority, arrival), next(self._seq), item)
        if len(self._entries) < self.max_len:
            insort(self._entries, entry)
            return None
        if not self._entries or entry > self._entries[-1]:
            return item  # it would be last: it is the one shed
        insort(self._entries, entry)
        return self._entries.pop().item

    def pop(self) -> T | None:
        """The next request to admit (None: nobody waits)."""
        return self._entries.pop(0).item if self._entries else None

    def remove(self, item: T) -> bool:
        """Take ``item`` out (it gave up waiting); whether it was there."""
        for i, e in enumerate(self._entries):
            if e.item is item:
                del self._entries[i]
                return True
        return False

    def items(self) -> list[T]:
        """The waiting items, first to be admitted first."""
        return [e.item for e in self._entries]
