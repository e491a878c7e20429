"""The gateway's Prometheus metrics, in a registry of their own (one per app).

Per request (updated once, when the request ends):

* ``prefixrouter_requests_total{worker,decision,status}``: every request,
  ``decision`` = the tier (``none`` when it failed before routing), ``status``
  = the HTTP status the client got (``499`` when the client went away);
* ``prefixrouter_input_tokens_total{model,pool,kind,prefix_class}``: prompt
  tokens the engine reused (``kind="cached"``) or prefilled (``"uncached"``);
* ``prefixrouter_prefill_tokens_saved_total{model,prefix_class}``: the cached ones again;
* ``prefixrouter_predicted_cached_tokens_total{model,pool,prefix_class}``: the
  cached tokens the router predicted for the same requests (against
  ``input_tokens_total{kind="cached"}``: a gap is an input-identification problem);
* ``prefixrouter_ttft_seconds{hit,prefix_class}``: streaming time to first token by what the
  engine reported: ``warm`` (at least ``metrics.warm_fraction`` of the prompt
  reused), ``partial`` (some) or ``cold`` (none);
* ``prefixrouter_queue_wait_seconds{decision,prefix_class}``: the queue wait the cost model
  predicted on the chosen worker;
* ``prefixrouter_cache_prediction_error_tokens``: ``|predicted - actual|``
  cached tokens, when the engine reports them;
* ``prefixrouter_ttft_prediction_ratio{decision}``: a streamed request's
  time to first token over the cost model's prediction for the worker it
  was sent to (1: exact; 4: four times slower than predicted): the routing
  decisions are as good as these predictions;
* ``prefixrouter_warm_abandoned_total{prefix_class}``: requests that left a
  warm candidate because its wait made it too slow (beyond the warm margin,
  or past a maximum wait where one is set);
* ``prefixrouter_evicted_prefix_age_seconds{prefix_class}``: when a worker no longer holds a
  prefix it served before (a miss), the time since it last served it;
* ``prefixrouter_retries_total{worker,status}``: attempts abandoned before
  the first byte (unreachable worker: ``status="502"``; timed out:
  ``"504"``; or a refusal status);
* ``prefixrouter_kv_evictions_total{source}``: ``observed`` = those misses;
  ``mirrored`` = blocks the router's index dropped to mirror the engines' KV size.

Read at scrape time from the live state: per-worker gauges
``prefixrouter_worker_healthy``, ``_in_flight``, ``_kv_usage``,
``_engine_waiting``, ``_ejected`` and ``_speed_scale`` (the cost model's
calibration factor: how much slower than its speed profile the worker
answers), and the counter
``prefixrouter_worker_ejections_total`` (outlier ejection); and, from the proxy's upstream client,
``prefixrouter_upstream_connections_opened_total{worker}`` (steady under
steady traffic when keep-alive works) and
``prefixrouter_upstream_connections{worker,state="idle"|"busy"}``.

A replica of a cluster (:mod:`prefixrouter.cluster`) adds
``prefixrouter_cluster_propagation_lag_seconds`` (a peer's send to this
replica's receipt, live messages only, not the replay),
``prefixrouter_cluster_facts_published_total``,
``prefixrouter_cluster_facts_applied_total`` (rates with ``rate()``),
``prefixrouter_cluster_facts_dropped_total{reason}``,
``prefixrouter_cluster_sync_cpu_seconds_total`` (CPU spent encoding,
publishing, decoding and applying), ``prefixrouter_cluster_peers_gone_total``,
``prefixrouter_cluster_expired_routings_total``,
``prefixrouter_cluster_messages_heard_twice_total`` (skipped: a catch-up and the
live subscription overlap), ``prefixrouter_cluster_messages_missed_total``
(gaps in a peer's message numbers), ``prefixrouter_cluster_peers``,
``prefixrouter_cluster_connected`` (1 while NATS is reachable) and
``prefixrouter_cluster_ready``.

The per-request series are kept in plain dicts (:class:`_Counter`,
:class:`_Histogram`: one dict lookup and an add, no lock, which is safe in a
single-threaded event loop) and turned into Prometheus families only when
``/metrics`` is scraped. prometheus_client's own ``Counter.labels().inc()``
and ``Histogram.observe()`` take a lock and allocate per call, which costs
several microseconds per request on the hot path.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from prefixrouter.cluster.node import ClusterNode

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)
AGE_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)
# Observed over predicted: as many buckets below 1 as above (a factor of 2 apart, 1.25 round 1).
RATIO_BUCKETS = (0.0625, 0.125, 0.25, 0.5, 0.8, 1.25, 2.0, 4.0, 8.0, 16.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class WorkerGauges:
    """One worker's live figures for the scrape-time gauges."""

    worker: str
    healthy: bool
    in_flight: int
    kv_usage: float
    engine_waiting: float
    ejected: bool = False
    ejections: int = 0
    speed_scale: float = 1.0
    draining: bool = False


class _Counter:
    """A labelled counter: label values -> total."""

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + amount

    def family(self) -> Metric:
        fam = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        for key, value in sorted(self.values.items()):
            fam.add_metric(list(key), value)
        return fam


class _Histogram:
    """A labelled histogram: label values -> (per-bucket counts, sum)."""

    __slots__ = ("bounds", "doc", "labels", "name", "series")

    def __init__(
        self, name: str, doc: str, labels: tuple[str, ...], bounds: tuple[float, ...]
    ) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0.0] * (len(self.bounds) + 2)  # buckets, +Inf, sum
        s[bisect_left(self.bounds, value)] += 1  # le is inclusive
        s[-1] += value

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        if not self.labels and () not in self.series:
            self.series[()] = [0.0] * (len(self.bounds) + 2)
        for key, s in sorted(self.series.items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*self.bounds, float("inf")), s[:-1], strict=True):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            fam.add_metric(list(key), buckets, s[-1])
        return fam


LabelledCounter = _Counter
"""The lock-free labelled counter, for other modules' collectors (:mod:`.controls`)."""
LabelledHistogram = _Histogram
"""The lock-free labelled histogram, for other modules' collectors."""


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _Collector(Collector):
    def __init__(
        self,
        metrics: GatewayMetrics,
        workers: Callable[[], Iterable[WorkerGauges]],
        mirrored_evictions: Callable[[], int],
    ) -> None:
        self._m = metrics
        self._workers = workers
        self._mirrored = mirrored_evictions

    def collect(self) -> Iterator[Metric]:
        m = self._m
        for series in m.series:
            yield series.family()
        ev = CounterMetricFamily(
            "prefixrouter_kv_evictions",
            "KV prefix evictions: observed (a worker lost a prefix it served) or "
            "mirrored (index blocks dropped to match engine KV size).",
            labels=["source"],
        )
        ev.add_metric(["observed"], float(m.observed_evictions))
        ev.add_metric(["mirrored"], float(self._mirrored()))
        yield ev
        healthy = GaugeMetricFamily(
            "prefixrouter_worker_healthy", "1 if routable.", labels=["worker"]
        )
        flight = GaugeMetricFamily(
            "prefixrouter_worker_in_flight", "Requests sent and not finished.", labels=["worker"]
        )
        kv = GaugeMetricFamily(
            "prefixrouter_worker_kv_usage", "Engine KV usage (0-1), last poll.", labels=["worker"]
        )
        waiting = GaugeMetricFamily(
            "prefixrouter_worker_engine_waiting", "Engine queue, last poll.", labels=["worker"]
        )
        ejected = GaugeMetricFamily(
            "prefixrouter_worker_ejected",
            "1 while the worker is ejected for failing answers (outlier ejection).",
            labels=["worker"],
        )
        ejections = CounterMetricFamily(
            "prefixrouter_worker_ejections",
            "Outlier ejections of the worker since it joined.",
            labels=["worker"],
        )
        draining = GaugeMetricFamily(
            "prefixrouter_worker_draining",
            "1 while the worker is being removed: no new requests, its own finishing.",
            labels=["worker"],
        )
        speed = GaugeMetricFamily(
            "prefixrouter_worker_speed_scale",
            "The cost model's calibration factor: the worker's TTFTs over its speed "
            "profile's (1 = as profiled).",
            labels=["worker"],
        )
        for w in self._workers():
            ejected.add_metric([w.worker], 1.0 if w.ejected else 0.0)
            ejections.add_metric([w.worker], float(w.ejections))
            healthy.add_metric([w.worker], 1.0 if w.healthy else 0.0)
            flight.add_metric([w.worker], float(w.in_flight))
            kv.add_metric([w.worker], w.kv_usage)
            waiting.add_metric([w.worker], w.engine_waiting)
            speed.add_metric([w.worker], w.speed_scale)
            draining.add_metric([w.worker], 1.0 if w.draining else 0.0)
        yield healthy
        yield flight
        yield kv
        yield waiting
        yield ejected
        yield ejections
        yield speed
        yield draining


@dataclass(frozen=True, slots=True)
class UpstreamGauges:
    """One worker's upstream connections, for the scrape-time collector."""

    worker: str
    opened: int
    idle: int
    busy: int


class UpstreamCollector(Collector):
    """The proxy's connections per worker, read when ``/metrics`` is scraped."""

    def __init__(self, workers: Callable[[], Iterable[UpstreamGauges]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        opened = CounterMetricFamily(
            "prefixrouter_upstream_connections_opened",
            "Connections the proxy opened to the worker (keep-alive reuses them).",
            labels=["worker"],
        )
        now = GaugeMetricFamily(
            "prefixrouter_upstream_connections",
            "The proxy's connections to the worker, idle in the pool or carrying a request.",
            labels=["worker", "state"],
        )
        for w in self._workers():
            opened.add_metric([w.worker], float(w.opened))
            now.add_metric([w.worker, "idle"], float(w.idle))
            now.add_metric([w.worker, "busy"], float(w.busy))
        yield opened
        yield now


class ClusterCollector(Collector):
    """A replica's sync counters and gauges, read from its node when scraped."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    def collect(self) -> Iterator[Metric]:
        node = self._node
        st = node.stats
        yield CounterMetricFamily(
            "prefixrouter_cluster_facts_published",
            "Routing facts this replica published to its peers.",
            value=float(st.published_facts),
        )
        yield CounterMetricFamily(
            "prefixrouter_cluster_facts_applied",
            "Peers' routing facts applied to this replica's index and in-flight counts.",
            value=float(st.applied_facts),
        )
        dropped = CounterMetricFamily(
            "prefixrouter_cluster_facts_dropped",
            "Facts not published (disconnected, publish_failed, too_large) or not applied "
            "(fingerprint, stale_epoch, "
            "unknown_epoch, unknown_worker, unmatched, malformed).",
            labels=["reason"],
        )
        for reason, n in sorted(st.dropped.items()):
            dropped.add_metric([reason], float(n))
        yield dropped
        yield CounterMetricFamily(
            "prefixrouter_cluster_sync_cpu_seconds",
            "CPU time spent publishing and applying facts.",
            value=st.sync_cpu_s,
        )
        yield CounterMetricFamily(
            "prefixrouter_cluster_peers_gone",
            "Peer lives ended (silent past peer_ttl_s, or restarted under a new epoch).",
            value=float(st.peers_gone),
        )
        yield CounterMetricFamily(
            "prefixrouter_cluster_expired_routings",
            "Peer routings settled here because their settlement never came (open past "
            "the origin's request timeout).",
            value=float(st.expired_routings),
        )
        yield CounterMetricFamily(
            "prefixrouter_cluster_messages_heard_twice",
            "Peer messages skipped as already taken (a catch-up overlapping live ones).",
            value=float(st.duplicate_messages),
        )
        yield CounterMetricFamily(
            "prefixrouter_cluster_messages_missed",
            "Peer messages that never arrived (gaps in a peer life's message numbers).",
            value=float(st.missed_messages),
        )
        yield GaugeMetricFamily(
            "prefixrouter_cluster_peers", "Live peer replicas.", value=len(node.registry.live())
        )
        yield GaugeMetricFamily(
            "prefixrouter_cluster_connected",
            "1 while this replica is connected to NATS.",
            value=1.0 if node.connected else 0.0,
        )
        yield GaugeMetricFamily(
            "prefixrouter_cluster_ready",
            "1 once this replica has replayed the stream (GET /ready answers 200).",
            value=1.0 if node.ready else 0.0,
        )


class GatewayMetrics:
    """The metrics of one gateway; see the module docstring for the list."""

    def __init__(self, warm_fraction: float = 0.75) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.warm_fraction = warm_fraction
        self.observed_evictions = 0
        self.requests = _Counter(
            "prefixrouter_requests",
            "Requests by worker, routing decision and HTTP status.",
            ("worker", "decision", "status"),
        )
        self.input_tokens = _Counter(
            "prefixrouter_input_tokens",
            "Prompt tokens, cached (reused by the engine) or uncached (prefilled).",
            ("model", "pool", "kind", "prefix_class"),
        )
        self.predicted_cached = _Counter(
            "prefixrouter_predicted_cached_tokens",
            "Prompt tokens the router predicted the engine would reuse (answered requests).",
            ("model", "pool", "prefix_class"),
        )
        self.saved = _Counter(
            "prefixrouter_prefill_tokens_saved",
            "Prompt tokens the engines did not have to prefill.",
            ("model", "prefix_class"),
        )
        self.warm_abandoned = _Counter(
            "prefixrouter_warm_abandoned",
            "Requests that left a warm candidate because its wait made it too slow.",
            ("prefix_class",),
        )
        self.retries = _Counter(
            "prefixrouter_retries",
            "Attempts abandoned before the first byte (the request went to another worker).",
            ("worker", "status"),
        )
        self.ttft = _Histogram(
            "prefixrouter_ttft_seconds",
            "Time to first token of streamed requests, by engine-reported cache hit.",
            ("hit", "prefix_class"),
            TTFT_BUCKETS,
        )
        self.queue_wait = _Histogram(
            "prefixrouter_queue_wait_seconds",
            "Predicted queue wait on the chosen worker, by decision tier.",
            ("decision", "prefix_class"),
            WAIT_BUCKETS,
        )
        self.prediction_error = _Histogram(
            "prefixrouter_cache_prediction_error_tokens",
            "|predicted - actual| cached prompt tokens.",
            (),
            TOKEN_BUCKETS,
        )
        self.ttft_ratio = _Histogram(
            "prefixrouter_ttft_prediction_ratio",
            "Streamed requests: time to first token over the cost model's prediction "
            "for the chosen worker, by decision tier.",
            ("decision",),
            RATIO_BUCKETS,
        )
        self.evicted_age = _Histogram(
            "prefixrouter_evicted_prefix_age_seconds",
            "Age of prefixes a worker had lost when asked again (since it last served them).",
            ("prefix_class",),
            AGE_BUCKETS,
        )
        self.cluster_lag = _Histogram(
            "prefixrouter_cluster_propagation_lag_seconds",
            "A peer's fact message: its send to this replica's receipt (wall clocks).",
            (),
            LAG_BUCKETS,
        )
        self.lint_findings = _Counter(
            "prefixrouter_lint_findings",
            "Volatile fields before stable prompt content (linter in observe mode).",
            ("prefix_class", "kind"),
        )
        self.token_counts = _Counter(
            "prefixrouter_token_counts",
            "Text mode: new prefixes' token counts asked of the engines (POST /tokenize).",
            ("outcome",),
        )
        self.warm_ups = _Counter(
            "prefixrouter_warm_ups",
            "Proactive copies: the router's own prefill-only requests to a hot prefix's new copy.",
            ("outcome",),
        )
        self.series: tuple[_Counter | _Histogram, ...] = (
            self.lint_findings,
            self.token_counts,
            self.warm_ups,
            self.requests,
            self.input_tokens,
            self.predicted_cached,
            self.saved,
            self.warm_abandoned,
            self.retries,
            self.ttft,
            self.queue_wait,
            self.prediction_error,
            self.ttft_ratio,
            self.evicted_age,
        )
        self._cluster_collector: ClusterCollector | None = None
        # Exported from the start (a dashboard's query has a series before the first event).
        self.warm_abandoned.values[("unknown",)] = 0.0
        self.evicted_age.series[("unknown",)] = [0.0] * (len(AGE_BUCKETS) + 2)

    def attach_live(
        self, workers: Callable[[], Iterable[WorkerGauges]], mirrored_evictions: Callable[[], int]
    ) -> None:
        """Register the scrape-time collector (every series, worker gauges, evictions)."""
        self.registry.register(_Collector(self, workers, mirrored_evictions))

    def attach_cluster(self, node: ClusterNode) -> None:
        """Export a replica's cluster series (the lag histogram and the node's collector)."""
        if self._cluster_collector is None:
            self.series = (*self.series, self.cluster_lag)
            self._cluster_collector = ClusterCollector(node)
            self.registry.register(self._cluster_collector)

    def cluster_lag_observed(self, lag_s: float) -> None:
        """One peer message arrived ``lag_s`` after it was sent."""
        self.cluster_lag.observe((), lag_s)

    def hit_label(self, cached_tokens: int, prompt_tokens: int) -> str:
        """``warm`` / ``partial`` / ``cold`` for a request's engine-reported reuse."""
        if cached_tokens <= 0:
            return "cold"
        if prompt_tokens > 0 and cached_tokens >= self.warm_fraction * prompt_tokens:
            return "warm"
        return "partial"

    def request_done(self, worker: str, decision: str, status: int) -> None:
        """Count one finished request."""
        self.requests.inc((worker, decision, str(status)))

    def retried(self, worker: str, status: str) -> None:
        """An attempt on ``worker`` failed before the first byte."""
        self.retries.inc((worker, status))

    def routed(self, tier: str, queue_wait_s: float | None, warm_abandoned: bool, cls: str) -> None:
        """A request was routed (first attempt)."""
        if queue_wait_s is not None:
            self.queue_wait.observe((tier, cls), queue_wait_s)
        if warm_abandoned:
            self.warm_abandoned.inc((cls,))

    def usage(
        self,
        model: str,
        pool: str,
        cls: str,
        prompt_tokens: int,
        cached_tokens: int,
        predicted_cached: int,
        ttft_s: float | None,
        predicted_ttft_s: float | None = None,
        decision: str = "",
    ) -> None:
        """What the engine reported for a successful request (``decision``: its tier).

        Negative figures count as 0: a counter must never go down (``rate()``
        reads a decrease as a reset), whatever a caller passes.
        """
        prompt_tokens, cached_tokens = max(0, prompt_tokens), max(0, cached_tokens)
        cached = min(cached_tokens, prompt_tokens) if prompt_tokens else cached_tokens
        self.input_tokens.inc((model, pool, "cached", cls), cached)
        self.input_tokens.inc((model, pool, "uncached", cls), prompt_tokens - cached)
        self.predicted_cached.inc((model, pool, cls), max(0, predicted_cached))
        if cached:
            self.saved.inc((model, cls), cached)
        self.prediction_error.observe((), abs(predicted_cached - cached_tokens))
        if ttft_s is not None:
            self.ttft.observe((self.hit_label(cached_tokens, prompt_tokens), cls), ttft_s)
            if predicted_ttft_s is not None and predicted_ttft_s > 0.0:
                self.ttft_ratio.observe((decision,), ttft_s / predicted_ttft_s)

    def linted(self, prefix_class: str, findings: dict[str, int]) -> None:
        """Count the linter's findings for one request (observe mode)."""
        for kind, n in findings.items():
            self.lint_findings.inc((prefix_class, kind), n)

    def token_count(self, outcome: str) -> None:
        """A token count ended: ``ok``, ``error``, ``unsupported`` or ``skipped``."""
        self.token_counts.inc((outcome,))

    def warm_up(self, outcome: str) -> None:
        """A proactive copy ended: ``ok``, ``error``, ``skipped`` or ``over_budget``."""
        self.warm_ups.inc((outcome,))

    def eviction_observed(self, age_s: float, cls: str = "unknown") -> None:
        """A worker had lost a prefix (of prefix class ``cls``) it served ``age_s`` seconds ago."""
        self.observed_evictions += 1
        self.evicted_age.observe((cls,), max(0.0, age_s))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
