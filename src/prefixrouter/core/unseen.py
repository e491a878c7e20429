"""Peers' routings a replica cannot see yet: how many, and where to stand behind them.

Router replicas learn each other's routings one propagation lag late. Two
routings made less than a lag apart are each made without the other: on the
same view, so every replica that routes within the lag picks the same
"best" worker (the idle one, the least loaded warm one) and a burst piles
onto it. One router would have placed the same burst one request after the
other, each seeing the ones before.

**Counting what was not seen.** Routing ``y`` did not see routing ``x``
of another replica when ``x`` was made before it but reached ``y``'s
replica after it: ``u_x <= u_y < u_x + lag`` (``u``: when made, on this
replica's clock; a peer's is its arrival minus its propagation lag, and this
replica's own routings reach its peers about as late as theirs reach it).
:class:`UnseenPeers` keeps the routings of the last moments, this replica's
and every peer's, by time; each one that becomes known (one of ours when it
is made, a peer's when it arrives) is paired with those kept from other
replicas, each pair in which one did not see the other adds one to a decayed
sum (a tie, two routings made at the same instant, counts once), and each
routing one to a decayed count. Their ratio ``E`` is the expected number of
routings made before one routing that it did not see: about the other
replicas' rate times the lag under steady traffic, and ``(m - 1) / 2`` in
bursts of ``m`` simultaneous requests, which a rate over the lag would miss.
It is learnt from every replica's routings, so a replica that has routed
nothing yet knows it too. Without peers, or with no lag, it is 0.

**Standing behind them** (:meth:`UnseenPeers.ahead`). A routing is one of
several made on one view; the ones before it that it does not see number
``E`` on average, anywhere from none to ``2E`` (its place in a burst is not
known to it). One router would have made them one after the other, each
seeing the placements before it (water filling). Here each routing takes a
random place in that sequence, uniform over ``0 .. 2E`` (``2E`` rounded up
or down at random, in proportion), drawn from the request id and the
replica's salt, so replicas draw differently and a run is reproducible:
with ``s`` routings ahead of it, the dispatcher routes ``s`` stand-ins
first, each placed in copies of the views as the ledger would place it (one
more in flight, its uncached prefill and its prompt queued on the worker
chosen for it; past :data:`MAX_REROUTES` of them, in that many groups, so a
request costs a bounded number of routings), and routes the request itself
on those views. Replicas that
share a stale view then spread as one router would have spread the burst,
in expectation, instead of all taking its first place. The stand-ins are
copies of this request, since the peers' requests are not known: a warm
request's stand-ins add little prefill to its warm worker (the cost model
keeps it there), a cold one's a whole prompt each.

Pure: times are arguments, randomness is a hash.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import xxhash

KEPT = 4096
"""Routings kept at most (the newest by time)."""

HORIZON_LAGS = 4.0
"""Routings older than this many of the longest lag seen are dropped (no
later one can be unseen by them or they by it)."""

DECAY = 1.0 / 64
"""Weight of the newest routing in the decayed sums (about the last 64 routings)."""

LAG_WEIGHT = 1.0 / 16
"""Weight of the newest peer lag in the estimate of this replica's own lag."""

MAX_AHEAD = 16
"""Stand-ins placed ahead of one request at most."""

MAX_REROUTES = 8
"""Routings of stand-in groups per request at most: past this many stand-ins,
each routing places a group of them on the worker it chose (one more
routing per group, not per stand-in, bounds the CPU at high rates, where
``E`` is the rate times the lag)."""

_OWN = ""


class UnseenPeers:
    """The expected number of routings each routing does not see (module doc)."""

    def __init__(self) -> None:
        # Known routings, sorted by time: when made, by whom, and their lag.
        self._times: list[float] = []
        self._kept: list[tuple[float, str, float]] = []
        self._pairs = 0.0  # decayed count of pairs in which one did not see the other
        self._routings = 0.0  # decayed count of routings
        self._lag = 0.0  # this replica's routings' lag to its peers: its peers' to it
        self._max_lag = 0.0

    @property
    def expected(self) -> float:
        """Routings made before one routing that it does not see, on average (``E``)."""
        return self._pairs / self._routings if self._routings > 0 else 0.0

    def on_own(self, now: float) -> None:
        """This replica routed a request at ``now``."""
        self._add(now, _OWN, self._lag, now)

    def on_peer(self, origin: str, routed_at: float, now: float) -> None:
        """A routing of peer ``origin`` made at ``routed_at`` (this replica's clock) arrived."""
        lag = max(0.0, now - routed_at)
        self._lag += (lag - self._lag) * LAG_WEIGHT if self._routings else lag
        self._max_lag = max(self._max_lag, lag)
        self._add(min(routed_at, now), origin, lag, now)

    def _add(self, u: float, origin: str, lag: float, now: float) -> None:
        times, kept = self._times, self._kept
        reach = self._max_lag
        pairs = 0.0
        for i in range(bisect_left(times, u - reach), bisect_right(times, u + lag)):
            t, other, other_lag = kept[i]
            if other == origin:
                continue
            if t == u:
                pairs += 1.0  # made at one instant: the later of the two did not see the other
            elif t < u < t + other_lag or u < t < u + lag:
                pairs += 1.0
        keep = 1.0 - DECAY
        self._pairs = self._pairs * keep + pairs
        self._routings = self._routings * keep + 1.0
        at = bisect_right(times, u)
        times.insert(at, u)
        kept.insert(at, (u, origin, lag))
        old = bisect_left(times, now - HORIZON_LAGS * reach) if reach > 0 else len(times) - 1
        old = max(old, len(times) - KEPT)
        if old > 0:
            del times[:old]
            del kept[:old]

    def ahead(self, request_id: str, salt: int) -> int:
        """Stand-ins to route ahead of this request (0 for one router: ``salt`` 0)."""
        span = 2.0 * self.expected
        if not salt or span <= 0.0:
            return 0
        draw = xxhash.xxh3_64_intdigest(request_id.encode(), salt & 0xFFFF_FFFF_FFFF_FFFF)
        whole = int(span)
        if (draw & 0xFFFF_FFFF) / 2.0**32 < span - whole:  # round at random, in proportion
            whole += 1
        place = ((draw >> 32) * (whole + 1)) >> 32  # uniform in 0..whole
        return min(place, MAX_AHEAD)
