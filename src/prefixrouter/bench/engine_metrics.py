"""The engines' own counters: prefix-cache hits and queries, finished requests, per engine.

The benchmark reads what the engines counted, not what a router believes:
before and after one router's run it scrapes every engine's ``GET /metrics``
(vLLM names, which our simulated engine and real vLLM both expose) and takes
the differences (pages read with :mod:`prefixrouter.prometheus`):

* cached-token share = ``sum(delta vllm:prefix_cache_hits_total)`` /
  ``sum(delta vllm:prefix_cache_queries_total)``;
* requests per engine = ``delta vllm:request_success_total`` (all finish
  reasons), i.e. where the router actually sent the work.

:func:`scrape_each` reads past an engine that does not answer (None for it,
and why), for the read after a run, when an engine may have stopped.

:func:`kv_config` reads an engine's KV size as it reports it (what the
``cache-pressure`` scenario is sized from on real vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from prefixrouter.prometheus import totals

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SUCCESS = "vllm:request_success_total"
COUNTERS = (HITS, QUERIES, SUCCESS)


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One engine's counters at one moment (summed over labels)."""

    hits: float = 0.0
    queries: float = 0.0
    requests: float = 0.0

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.hits - other.hits, self.queries - other.queries, self.requests - other.requests
        )


def parse_counters(text: str) -> EngineCounters:
    """The counters in one Prometheus exposition (missing series count as 0)."""
    sums = totals(text, COUNTERS)
    return EngineCounters(sums.get(HITS, 0.0), sums.get(QUERIES, 0.0), sums.get(SUCCESS, 0.0))


async def scrape(urls: Sequence[str], timeout_s: float = 10.0) -> list[EngineCounters]:
    """Every engine's counters, in ``urls`` order.

    Raises:
        RuntimeError: An engine did not answer 200.
    """
    out: list[EngineCounters] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for url in urls:
            async with session.get(url.rstrip("/") + "/metrics") as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url}/metrics answered {resp.status}")
                out.append(parse_counters(await resp.text()))
    return out


async def scrape_each(
    urls: Sequence[str], timeout_s: float = 10.0
) -> tuple[list[EngineCounters | None], list[str]]:
    """Every engine's counters, in ``urls`` order, reading past an engine that does not answer.

    After a measured run, one engine that stopped must not cost the run the
    others' counters (nor the client's figures): its entry is None and the
    second list says why (``engine I (URL): reason``), one line per such
    engine.
    """
    counters: list[EngineCounters | None] = []
    problems: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for i, url in enumerate(urls):
            try:
                async with session.get(url.rstrip("/") + "/metrics") as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"/metrics answered {resp.status}")
                    counters.append(parse_counters(await resp.text()))
            except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as exc:
                counters.append(None)
                why = f"{exc}".strip() or type(exc).__name__
                problems.append(f"engine {i} ({url}): {why}")
    return counters, problems


def cached_share(deltas: Sequence[EngineCounters]) -> float:
    """Prompt tokens found in the engines' prefix caches over tokens looked up (0 if none)."""
    queries = sum(d.queries for d in deltas)
    return sum(d.hits for d in deltas) / queries if queries else 0.0


async def kv_config(url: str, timeout_s: float = 10.0) -> tuple[int, int]:
    """An engine's KV size as it reports it: ``(num_gpu_blocks, block_size)``.

    From ``vllm:cache_config_info``'s labels (the gateway's own reader,
    :func:`prefixrouter.gateway.workers.parse_engine_metrics`).

    Raises:
        RuntimeError: The engine did not answer 200 or reports no cache configuration.
    """
    from prefixrouter.gateway.workers import parse_engine_metrics

    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.get(url.rstrip("/") + "/metrics") as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"{url}/metrics answered {resp.status}")
        stats = parse_engine_metrics(await resp.text(), "vllm")
    if stats.num_blocks is None or stats.block_size is None:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info with its KV size")
    return stats.num_blocks, stats.block_size
