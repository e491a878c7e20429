"""``round_robin``: cycle through the healthy candidates, blind to cache and load.

The cursor advances in :meth:`on_routed`, not in :meth:`select`, so selection
stays pure: asking twice without routing gives the same answer. No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixrouter.core.policy import NoParams, Policy, RoutingContext, Selection, register
from prefixrouter.core.types import WorkerId, WorkerView


@register
class RoundRobin(Policy):
    """Each request to the next candidate in worker-id order."""

    name = "round_robin"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        super().__init__(params)
        self._cursor = 0

    def select(self, ctx: RoutingContext, candidates: Sequence[WorkerView]) -> Selection:
        chosen = candidates[self._cursor % len(candidates)].worker_id
        return Selection(chosen, "round_robin", f"turn {self._cursor} of {len(candidates)}")

    def on_routed(self, ctx: RoutingContext, worker: WorkerId) -> None:
        self._cursor += 1
