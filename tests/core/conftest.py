"""Shared builders for the routing-core tests."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import replace

from prefixrouter.core import (
    CacheNamespace,
    Decision,
    RequestId,
    Router,
    RoutingRequest,
    WorkerId,
    WorkerView,
)

NS = CacheNamespace("model-a")


def tokens(start: int, n: int) -> array[int]:
    """``n`` distinct-looking token ids, deterministic in ``start``."""
    return array("I", ((start * 7919 + i * 31) % 50_000 for i in range(n)))


def request(
    rid: str,
    toks: Sequence[int],
    *,
    max_tokens: int = 128,
    ns: CacheNamespace = NS,
    **kw: object,
) -> RoutingRequest:
    return RoutingRequest(RequestId(rid), ns, tokens=toks, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def workers(n: int, **kw: object) -> list[WorkerView]:
    return [WorkerView(WorkerId(f"w{i}"), **kw) for i in range(n)]  # type: ignore[arg-type]


def send(
    router: Router, req: RoutingRequest, ws: list[WorkerView], to: WorkerId, now: float
) -> Decision:
    """Route ``req`` but send it to ``to`` (a hand-built history), then tell the router."""
    d = replace(router.route(req, ws, now), worker_id=to)
    router.on_routed(d, now)
    return d


def with_loads(*loads: int) -> list[WorkerView]:
    """One worker per figure, with that many requests in flight."""
    return [replace(w, in_flight=n) for w, n in zip(workers(len(loads)), loads, strict=True)]
