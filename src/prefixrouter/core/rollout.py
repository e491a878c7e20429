"""One-class rollout: which requests are routed by prefix, and which by the baseline.

The seed's rollout moves one traffic class at a time, so the gain can be
proven on it before it is widened. :class:`RolloutPlan` splits the traffic
in two groups:

* ``prefix`` (the treatment): routed by the router's own policy
  (``prefix_aware``), with session affinity;
* ``baseline``: routed by a cache-blind policy from the registry
  (``round_robin`` or ``least_loaded``), as the fleet was before.

A request is in ``prefix`` when its prefix class (stated in ``X-Prefix-Class``
or inferred, :mod:`prefixrouter.prompt.classify`) is one of ``classes``, or
else when its *group key* falls in ``share`` of the key space: the key is
the session id when the request names one, else its prefix key (the hash of
its leading prefix), hashed with ``seed`` (xxh3) to a point in [0, 1). The
assignment is deterministic: every request for one document, and every turn
of one session, lands in the same group, in every process, so one group's
caches never serve the other's requests of the same prefix. Each group may be
confined to a worker pool (``RoutingRequest.pool``), so the two groups can
also be compared on separate hardware.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

PREFIX_GROUP = "prefix"
BASELINE_GROUP = "baseline"
GROUPS = (PREFIX_GROUP, BASELINE_GROUP)
_SPACE = float(1 << 64)


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """Who is routed by prefix (module docstring).

    Attributes:
        classes: Prefix classes routed by prefix, all of their requests.
        share: Share of the other requests routed by prefix, by their group key.
        baseline_policy: Registered name of the baseline group's policy.
        prefix_pool: Pool the ``prefix`` group is confined to (None: any).
        baseline_pool: Pool the ``baseline`` group is confined to (None: any).
        seed: Salt of the group-key hash (a new seed draws a new share).
    """

    classes: frozenset[str] = frozenset()
    share: float = 0.0
    baseline_policy: str = "round_robin"
    prefix_pool: str | None = None
    baseline_pool: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")

    @property
    def needs_key(self) -> bool:
        """Whether :meth:`group` reads the group key (a share strictly between 0 and 1)."""
        return 0.0 < self.share < 1.0

    def in_share(self, key: str) -> bool:
        """Whether ``key`` falls in the prefix-routed share (deterministic)."""
        if self.share >= 1.0:
            return True
        if self.share <= 0.0:
            return False
        point = xxhash.xxh3_64_intdigest(key.encode("utf-8"), self.seed) / _SPACE
        return point < self.share

    def group(self, prefix_class: str, key: str = "") -> str:
        """``prefix`` or ``baseline`` for a request of ``prefix_class`` and group ``key``."""
        if prefix_class in self.classes or self.in_share(key):
            return PREFIX_GROUP
        return BASELINE_GROUP

    def pool(self, group: str) -> str | None:
        """The pool ``group`` is confined to (None: any)."""
        return self.prefix_pool if group == PREFIX_GROUP else self.baseline_pool
