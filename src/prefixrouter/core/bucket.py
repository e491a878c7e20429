"""A token bucket: a rate with a burst, on the caller's clock (pure).

``capacity`` tokens, refilled continuously at ``rate`` a second. Two ways to
draw on it:

* :meth:`TokenBucket.take` takes one token, or says how long until one is
  there (a tenant's request rate, :mod:`prefixrouter.gateway.limits`);
* :meth:`TokenBucket.spend` takes an amount of work that may exceed what
  the bucket holds, going into debt, whenever the bucket is not empty or in
  debt: a rate of work (seconds of a worker's time) where one piece of work
  can be larger than the burst, as a long document's copy
  (:mod:`prefixrouter.core.policies.prefix_aware`'s copy budget). Over a
  span ``T`` the work spent is at most ``capacity + rate * T`` plus one
  piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second (see the module docstring).

    Attributes:
        rate: Tokens per second.
        capacity: Most tokens held (the burst).
        tokens: Tokens now (starts full; negative: in debt).
        stamp: When ``tokens`` was last brought up to date (None: never).
    """

    rate: float
    capacity: float
    tokens: float = field(init=False)
    stamp: float | None = None

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.capacity <= 0:
            raise ValueError(
                f"a bucket needs rate > 0 and capacity > 0, got rate={self.rate} "
                f"capacity={self.capacity}"
            )
        self.tokens = self.capacity

    def _refill(self, now: float) -> None:
        if self.stamp is not None and now > self.stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        if self.stamp is None or now > self.stamp:
            self.stamp = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 when taken, else the seconds until one will be there."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def spend(self, now: float, amount: float) -> bool:
        """Spend ``amount`` if the bucket holds anything (into debt if it must); else False."""
        self._refill(now)
        if self.tokens <= 0.0:
            return False
        self.tokens -= amount
        return True

    def full(self, now: float) -> bool:
        """Whether the bucket is full at ``now`` (nothing to remember about it)."""
        self._refill(now)
        return self.tokens >= self.capacity
