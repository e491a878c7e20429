"""Prometheus metrics of the simulated engine, under vLLM's names and labels.

Whatever scrapes a vLLM engine (our engine adapters, peer routers, dashboards)
can scrape this server unchanged. Every series carries ``engine`` and
``model_name`` labels, like vLLM v1's. Each app has its own
:class:`~prometheus_client.CollectorRegistry`, so several servers can live in
one process (tests).

Gauges are read from the engine model at scrape time (no bookkeeping per step):

* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: admitted /
  queued requests;
* ``vllm:kv_cache_usage_perc``: fraction (0-1) of KV blocks held by running
  requests; cached blocks that nothing holds count as free, as in vLLM;
* ``vllm:cache_config_info``: value 1, the cache configuration in labels
  (``block_size``, ``num_gpu_blocks``, ...);
* ``process_start_time_seconds`` (no labels, as prometheus_client's process
  collector exports it behind vLLM): when this server started, in Unix
  seconds. One process normally serves one engine, so it is the process's
  start; several servers in one process (tests) each have their own, so a
  router sees a restarted server as a new process either way.

Counters and histograms are updated on engine outputs (a
:class:`~prefixrouter.simulated_engine.runtime.RuntimeObserver`):

* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt
  tokens looked up / found in the prefix cache, counted when the prefill ends;
* ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``;
* ``vllm:request_success_total{finished_reason}`` (always ``length``: outputs
  are filler of exactly ``max_tokens`` tokens);
* ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds``: histograms with vLLM's buckets, in wall
  seconds (simulated times divided by the time scale), i.e. what clients see.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixrouter.sim.engine import Completed, EngineModel, FirstToken
from prefixrouter.simulated_engine.runtime import RequestHandle

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM v1's ``time_to_first_token_seconds`` buckets."""
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM v1's request latency and queue time buckets."""


class _EngineGauges(Collector):
    """Gauges computed from the engine model at scrape time."""

    def __init__(self, engine: EngineModel, labels: dict[str, str], cache_info: dict[str, str]):
        self._started = time.time()
        self._engine = engine
        self._names = list(labels)
        self._values = list(labels.values())
        self._cache_info = cache_info

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self._names)
        g.add_metric(self._values, value)
        return g

    def collect(self) -> Iterator[Metric]:
        eng = self._engine
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            eng.num_running,
        )  # fmt: skip
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            eng.num_waiting,
        )  # fmt: skip
        cap = eng.kv_capacity_blocks
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            eng.kv_used_blocks / cap if cap else 0.0,
        )  # fmt: skip
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self._cache_info, *self._names],
        )
        info.add_metric([*self._cache_info.values(), *self._values], 1.0)
        yield info
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=self._started,
        )


class EngineMetrics:
    """The metrics of one engine server (implements ``RuntimeObserver``).

    Args:
        engine: The engine model (gauges read it at scrape time).
        model_name: Served model name (``model_name`` label).
        engine_id: ``engine`` label.
        time_scale: Simulated seconds per wall second (engine times are divided by it).
    """

    def __init__(
        self, engine: EngineModel, model_name: str, engine_id: str, time_scale: float
    ) -> None:
        self.registry = CollectorRegistry()
        self._scale = time_scale
        labels = {"engine": engine_id, "model_name": model_name}
        names = list(labels)
        prof = engine.profile
        cache_info = {
            "block_size": str(prof.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(engine.kv_capacity_blocks),
            "num_cpu_blocks": "0",
            "prefix_caching_hash_algo": "xxhash",
            "profile": prof.name,
        }
        self.registry.register(_EngineGauges(engine, labels, cache_info))
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, registry=reg, buckets=buckets)

        values = list(labels.values())
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(*values)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*values)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(*values)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(*values)
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        ).labels(*values, "length")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(*values)  # fmt: skip
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        ).labels(*values)  # fmt: skip
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        ).labels(*values)

    # ------------------------------------------------------- RuntimeObserver

    def first_token(self, out: FirstToken, handle: RequestHandle | None, wall: float) -> None:
        """Count the prefill (cached or not) and observe TTFT and queue time."""
        self.prefix_queries.inc(out.prompt_tokens)
        self.prefix_hits.inc(out.cached_tokens)
        self.prompt_tokens.inc(out.prompt_tokens)
        self.queue.observe(out.queue_wait_s / self._scale)
        if handle is not None:
            self.ttft.observe(wall - handle.submitted)

    def completed(self, out: Completed, handle: RequestHandle | None, wall: float) -> None:
        """Count the generated tokens; a request still wanted counts as a success."""
        self.generation_tokens.inc(out.output_tokens)
        if handle is not None:
            self.success.inc()
            self.e2e.observe(wall - handle.submitted)

    # ------------------------------------------------------------ exposition

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
