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
from prefixrouter.core.events import BlockStored

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


def warm(router: Router, worker: WorkerId, toks: object, now: float = 0.0) -> None:
    """Make ``worker`` hold ``toks`` as if a request had been routed there."""
    req = request(f"warm-{worker}-{now}", toks)  # type: ignore[arg-type]
    router.index.on_routed(worker, router.blocks_for(req).hashes, now)


def hold(router: Router, worker: WorkerId, toks: object, now: float = 0.0) -> None:
    """Make ``worker`` hold ``toks`` for sure (the engine said so in a KV event)."""
    req = request(f"held-{worker}-{now}", toks)  # type: ignore[arg-type]
    router.apply(BlockStored(worker, router.blocks_for(req).hashes), now)
