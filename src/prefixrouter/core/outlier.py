"""Passive outlier ejection: a worker whose answers keep failing leaves routing for a while.

Health checks (``GET /health``) catch an engine that is down; they do not
catch one that is up and answers every request with a 500 (a bad model load, a
broken CUDA context, a full disk), which keeps its share of traffic and turns
it into errors. This module is the decision state machine that Envoy's outlier
detection (``consecutive_5xx``) runs, fed by the answers the gateway sees, with
the time passed in (no clock reads, no I/O):

1. **Count.** Each answer of a worker is a failure or a success; the driver
   decides which (the gateway: a 5xx, a connect error, a malformed or cut
   answer fail; any other answer succeeds; a client that left says nothing).
   A success resets the worker's run of failures.
2. **Eject.** ``consecutive_failures`` failures in a row eject the worker for
   ``base_ejection_s * n`` seconds, ``n`` being its ejection count (this one
   included), capped at ``max_ejection_s``: a worker that keeps failing stays
   out longer each time, as in Envoy.
3. **Fleet guard.** At most ``max(1, floor(max_ejected_share * fleet))``
   workers are ejected at once, and never the last routable one (the driver
   says how many *other* workers could take traffic now): a fleet-wide fault
   (a bad upstream dependency, an overload) must not eject every worker and
   answer nothing. A failure that cannot eject is still counted; the worker is
   ejected on a later failure once the guard allows it.
4. **Return on probation.** When its time is up (:meth:`OutlierDetector.release`)
   the worker takes traffic again, on probation: its first answer decides.
   A success ends the probation; a failure ejects it again at once (longer),
   so an engine that still fails costs one request per return, not
   ``consecutive_failures``.
5. **Forgive.** The ejection count drops by one for every ``max_ejection_s``
   a worker has been back without being ejected again, so that a fault weeks
   ago does not lengthen today's ejection.

Ejection is a reason for a worker to be out of routing beside the health
checks' verdict; the gateway folds both into the worker view's ``healthy``
flag, which the router's filter reads (one notion of "not routable").
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from prefixrouter.core.types import WorkerId


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """The ejection rules (module docstring).

    Attributes:
        consecutive_failures: Failures in a row that eject a worker.
        base_ejection_s: The first ejection's length; the ``n``-th lasts ``n`` times it.
        max_ejection_s: The longest ejection; also how long a worker must stay
            back for its ejection count to drop by one.
        max_ejected_share: Largest share of the fleet ejected at once (at
            least one worker, never the last routable one).
    """

    consecutive_failures: int = 5
    base_ejection_s: float = 5.0
    max_ejection_s: float = 120.0
    max_ejected_share: float = 0.5

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be at least 1")
        if not 0 < self.base_ejection_s <= self.max_ejection_s:
            raise ValueError("need 0 < base_ejection_s <= max_ejection_s")
        if not 0 < self.max_ejected_share <= 1:
            raise ValueError("max_ejected_share must be in (0, 1]")

    def ejection_s(self, ejections: int) -> float:
        """How long the ``ejections``-th ejection lasts."""
        return min(self.max_ejection_s, self.base_ejection_s * max(1, ejections))

    def max_ejected(self, fleet: int) -> int:
        """How many of ``fleet`` workers may be ejected at once."""
        return max(1, math.floor(self.max_ejected_share * fleet + 1e-9))


class Change(enum.StrEnum):
    """What an answer or the passing of time did to a worker."""

    EJECTED = "ejected"
    RETURNED = "returned"


@dataclass(frozen=True, slots=True)
class Transition:
    """A worker left routing or came back (the driver logs it and rebuilds its views).

    Attributes:
        worker_id: The worker.
        change: Ejected or returned.
        at: When.
        until: End of the ejection (ejected), else ``at``.
        ejections: The worker's ejection count (this one included).
        failures: Failures in a row that led to it (ejected).
    """

    worker_id: WorkerId
    change: Change
    at: float
    until: float
    ejections: int
    failures: int = 0


@dataclass(slots=True)
class _State:
    failures: int = 0
    ejections: int = 0
    total_ejections: int = 0
    ejected_until: float | None = None
    probation: bool = False
    returned_at: float | None = None


class OutlierDetector:
    """Per-worker failure runs and ejections (module docstring); the time is passed in.

    Args:
        policy: The rules.
    """

    def __init__(self, policy: OutlierPolicy) -> None:
        self.policy = policy
        self._states: dict[WorkerId, _State] = {}
        self._ejected: set[WorkerId] = set()
        self.next_release: float = math.inf
        """The earliest end of an ejection (``inf``: none): a driver checks
        ``now >= next_release`` before calling :meth:`release`, one comparison."""

    def ejected(self, worker_id: WorkerId) -> bool:
        """Whether the worker is ejected now."""
        return worker_id in self._ejected

    def ejected_count(self) -> int:
        """Workers ejected now."""
        return len(self._ejected)

    def ejections(self, worker_id: WorkerId) -> int:
        """How often the worker was ejected since it joined (for metrics)."""
        s = self._states.get(worker_id)
        return s.total_ejections if s is not None else 0

    def ejected_until(self, worker_id: WorkerId) -> float | None:
        """When the worker's ejection ends (None: not ejected)."""
        s = self._states.get(worker_id)
        return s.ejected_until if s is not None else None

    def success(self, worker_id: WorkerId, now: float) -> None:
        """The worker answered well: its run of failures (and any probation) ends."""
        s = self._states.get(worker_id)
        if s is None or worker_id in self._ejected:
            return  # an answer that started before the ejection says nothing new
        s.failures = 0
        s.probation = False

    def failure(
        self, worker_id: WorkerId, now: float, fleet: int, others_routable: int
    ) -> Transition | None:
        """The worker failed an answer; the ejection it causes, if any.

        Args:
            worker_id: The worker.
            now: The driver's clock.
            fleet: Workers in the fleet (not draining), this one included.
            others_routable: Workers other than this one that could take
                traffic now (healthy and not ejected).
        """
        s = self._states.setdefault(worker_id, _State())
        if worker_id in self._ejected:
            return None  # answers of requests sent before it was ejected
        s.failures += 1
        if not s.probation and s.failures < self.policy.consecutive_failures:
            return None
        if others_routable < 1 or len(self._ejected) >= self.policy.max_ejected(fleet):
            return None  # the fleet guard: keep it, count on
        return self._eject(worker_id, s, now)

    def _eject(self, worker_id: WorkerId, s: _State, now: float) -> Transition:
        p = self.policy
        if s.returned_at is not None and s.ejections:
            forgiven = int((now - s.returned_at) // p.max_ejection_s)
            s.ejections = max(0, s.ejections - forgiven)
        s.ejections += 1
        s.total_ejections += 1
        until = now + p.ejection_s(s.ejections)
        failures = s.failures
        s.ejected_until, s.failures, s.probation = until, 0, False
        self._ejected.add(worker_id)
        self.next_release = min(self.next_release, until)
        return Transition(worker_id, Change.EJECTED, now, until, s.ejections, failures)

    def release(self, now: float) -> list[Transition]:
        """Workers whose ejection has ended by ``now``: back in routing, on probation."""
        if now < self.next_release:
            return []
        back: list[Transition] = []
        nxt = math.inf
        for wid in sorted(self._ejected):
            s = self._states[wid]
            assert s.ejected_until is not None
            if s.ejected_until <= now:
                s.ejected_until, s.probation, s.returned_at = None, True, now
                back.append(Transition(wid, Change.RETURNED, now, now, s.ejections))
            else:
                nxt = min(nxt, s.ejected_until)
        for t in back:
            self._ejected.discard(t.worker_id)
        self.next_release = nxt
        return back

    def restarted(self, worker_id: WorkerId, now: float) -> bool:
        """A new engine process replaced the worker's: the old one's failures say nothing.

        Its ejection ends now, without probation, and its failure run and
        ejection count start again (``total_ejections`` keeps the history).
        An engine SIGKILLed under load fails every request it had in flight
        at once, often enough to be ejected before the health checks see it
        down; once the driver knows a new process answers (a changed process
        start time), keeping it out for the rest of that ejection only delays
        its return (as Envoy's ``successful_active_health_check_uneject_host``
        does for a host whose health checks pass again). Returns whether it
        was ejected.
        """
        s = self._states.get(worker_id)
        if s is None:
            return False
        was = worker_id in self._ejected
        s.failures, s.ejections, s.probation = 0, 0, False
        s.ejected_until, s.returned_at = None, now
        if was:
            self._ejected.discard(worker_id)
            self._update_next_release()
        return was

    def _update_next_release(self) -> None:
        """The earliest end of an ejection still running (inf: none), after one ended early."""
        until = (self._states[w].ejected_until for w in self._ejected)
        self.next_release = min((u for u in until if u is not None), default=math.inf)

    def forget(self, worker_id: WorkerId) -> None:
        """The worker left the fleet."""
        self._states.pop(worker_id, None)
        if worker_id in self._ejected:
            self._ejected.discard(worker_id)
            self._update_next_release()
