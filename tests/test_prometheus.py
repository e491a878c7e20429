"""The one Prometheus text reader, against expositions prometheus_client itself writes.

The pages are produced the way engines produce them (a registry of counters,
gauges, a histogram and an info metric, then ``generate_latest``), not typed
by hand, so the test holds for what the gateway's pollers and the bench read.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from prefixrouter.bench.engine_metrics import EngineCounters, parse_counters
from prefixrouter.gateway.workers import parse_engine_metrics
from prefixrouter.prometheus import (
    Sample,
    families,
    histogram,
    histogram_quantile,
    samples,
    totals,
)


def _vllm_like_page() -> str:
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", ["engine", "model_name"], registry=reg)
    running.labels("0", "tiny").set(2)
    running.labels("1", "tiny").set(3)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["engine"], registry=reg)
    waiting.labels("0").set(1)
    hits = Counter("vllm:prefix_cache_hits", "hits", ["engine"], registry=reg)
    hits.labels("0").inc(750)
    queries = Counter("vllm:prefix_cache_queries", "queries", ["engine"], registry=reg)
    queries.labels("0").inc(1000)
    success = Counter("vllm:request_success", "done", ["finished_reason"], registry=reg)
    success.labels("length").inc(3)
    success.labels("stop").inc(2)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", buckets=(0.1, 1.0), registry=reg)
    ttft.observe(0.05)
    ttft.observe(0.5)
    info = Gauge("vllm:cache_config_info", "cache", ["block_size", "num_gpu_blocks"], registry=reg)
    info.labels("32", "640").set(1)
    Info("build", "build info", registry=reg).info({"version": 'a "quoted" \\ value'})
    return generate_latest(reg).decode()


def test_samples_keep_names_labels_and_values() -> None:
    page = _vllm_like_page()
    got = list(samples(page))
    assert Sample("vllm:num_requests_running", {"engine": "1", "model_name": "tiny"}, 3.0) in got
    assert Sample("vllm:prefix_cache_hits_total", {"engine": "0"}, 750.0) in got  # _total kept
    buckets = [s for s in got if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert [(s.labels["le"], s.value) for s in buckets] == [
        ("0.1", 1.0),
        ("1.0", 2.0),
        ("+Inf", 2.0),
    ]
    (build,) = [s for s in got if s.name == "build_info"]
    assert build.labels["version"] == 'a "quoted" \\ value'  # escapes undone


def test_families_name_each_declared_family_with_its_type_samples_or_not() -> None:
    page = _vllm_like_page()
    reg = CollectorRegistry()
    Counter("never_counted", "declared, no sample yet", ["worker"], registry=reg)
    got = families(page + generate_latest(reg).decode())
    assert got["vllm:prefix_cache_hits"] == "counter"  # the family, without _total
    assert got["vllm:time_to_first_token_seconds"] == "histogram"
    assert got["vllm:num_requests_waiting"] == "gauge"
    assert got["never_counted"] == "counter"
    assert "never_counted_total" not in {s.name for s in samples(page)}


def test_totals_sum_over_labels_and_leave_unseen_names_out() -> None:
    page = _vllm_like_page()
    assert totals(page, ["vllm:num_requests_running", "vllm:request_success_total", "nope"]) == {
        "vllm:num_requests_running": 5.0,
        "vllm:request_success_total": 5.0,
    }
    assert totals("", ["vllm:num_requests_running"]) == {}


def test_the_gateway_and_the_bench_read_the_same_page() -> None:
    page = _vllm_like_page()
    stats = parse_engine_metrics(page, "vllm")
    assert (stats.running, stats.waiting) == (5.0, 1.0)
    assert (stats.block_size, stats.num_blocks) == (32, 640)
    assert (stats.prefix_hits, stats.prefix_queries) == (750.0, 1000.0)
    assert parse_counters(page) == EngineCounters(750.0, 1000.0, 5.0)


def test_a_page_that_is_not_prometheus_text_raises() -> None:
    with pytest.raises(ValueError):
        list(samples("this is { not prometheus\n"))


def test_histogram_quantiles_match_prometheus_interpolation() -> None:
    reg = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", ["peer"], buckets=(0.001, 0.01, 0.1), registry=reg)
    for v in (0.0005,) * 50 + (0.005,) * 40:
        lag.labels("a").observe(v)
    for v in (0.05,) * 9 + (2.0,):
        lag.labels("b").observe(v)
    page = generate_latest(reg).decode()
    buckets = histogram(page, "lag_seconds")
    assert buckets == {0.001: 50, 0.01: 90, 0.1: 99, float("inf"): 100}  # summed over peers
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.001)  # 50 of 100 in the first
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.001 + 0.009 * 20 / 40)
    assert histogram_quantile(buckets, 1.0) == pytest.approx(0.1)  # +Inf: the top finite bound
    # A difference of two scrapes: only what happened in between.
    later = dict(buckets)
    later[0.1] += 100
    later[float("inf")] += 100
    between = {le: later[le] - buckets[le] for le in later}
    assert histogram_quantile(between, 0.99) == pytest.approx(0.01 + 0.09 * 99 / 100)
    assert histogram(page, "absent_seconds") == {} and histogram_quantile({}, 0.5) == 0.0
    with pytest.raises(ValueError):
        histogram_quantile(buckets, 1.5)
