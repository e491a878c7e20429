"""``least_loaded``: the candidate with the fewest in-flight requests.

Ties go to the first candidate in worker-id order. No parameters; blind to cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixrouter.core.policy import NoParams, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import WorkerView


@register
class LeastLoaded(Policy):
    """Fewest in-flight requests wins."""

    name = "least_loaded"
    Params = NoParams

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        best = min(candidates, key=lambda w: w.in_flight)
        return Selection(best.worker_id, "least_loaded", f"{best.in_flight} in flight, the fewest")
