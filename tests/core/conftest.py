"""Shared builders for the routing-core tests."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from prefixrouter.core import CacheNamespace, RequestId, RoutingRequest, WorkerId, WorkerView

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
