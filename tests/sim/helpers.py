"""Helpers for the simulator's tests (imported, not fixtures)."""

from __future__ import annotations

from array import array

from prefixrouter.core.types import PrefixClass, RequestId
from prefixrouter.sim.workload import SIM_NAMESPACE, SimRequest


def sim_request(
    i: int,
    arrival: float,
    *segments: array[int],
    output_tokens: int = 1,
    prefix_class: PrefixClass = PrefixClass.SESSION,
    first_user_offset: int = 0,
) -> SimRequest:
    """Request ``r{i}`` arriving at ``arrival``, its prompt ``segments`` in order (shared
    arrays stay shared), in the simulator's one namespace and group ``g``."""
    return SimRequest(
        request_id=RequestId(f"r{i}"),
        arrival=arrival,
        namespace=SIM_NAMESPACE,
        segments=segments,
        output_tokens=output_tokens,
        prefix_class=prefix_class,
        group="g",
        first_user_offset=first_user_offset,
    )
