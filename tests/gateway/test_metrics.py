"""The gateway's Prometheus exposition: names, labels, cumulative buckets."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from prefixrouter.gateway.metrics import GatewayMetrics, WorkerGauges

SYSTEM = ("prefix_class", "system")


def _samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = m.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_exposition_parses_with_the_expected_series() -> None:
    m = GatewayMetrics(warm_fraction=0.75)
    m.attach_live(lambda: [WorkerGauges("w0", True, 2, 0.5, 1.0)], lambda: 7)
    m.routed("exact", 0.003, True, "system")
    m.usage("tiny", "default", "system", 1000, 800, 900, 0.02)  # warm
    m.usage("tiny", "default", "system", 1000, 100, 0, 0.2)  # partial
    m.usage("tiny", "default", "system", 1000, 0, 0, None)  # not streamed: no TTFT
    m.request_done("w0", "exact", 200)
    m.request_done("", "none", 400)
    m.retried("w1", "502")
    m.eviction_observed(42.0, "document")
    s = _samples(m)
    cached = (
        ("kind", "cached"),
        ("model", "tiny"),
        ("pool", "default"),
        ("prefix_class", "system"),
    )
    assert s[("prefixrouter_input_tokens_total", cached)] == 900
    uncached = tuple((k, "uncached" if k == "kind" else v) for k, v in cached)
    assert s[("prefixrouter_input_tokens_total", uncached)] == 2100
    assert (
        s[
            (
                "prefixrouter_prefill_tokens_saved_total",
                (("model", "tiny"), ("prefix_class", "system")),
            )
        ]
        == 900
    )
    predicted = (("model", "tiny"), ("pool", "default"), ("prefix_class", "system"))
    assert s[("prefixrouter_predicted_cached_tokens_total", predicted)] == 900
    assert s[("prefixrouter_ttft_seconds_count", (("hit", "warm"), SYSTEM))] == 1
    partial_le = (("hit", "partial"), ("le", "{}"), SYSTEM)

    def bucket(le: str) -> float:
        key = tuple((k, v.format(le)) for k, v in partial_le)
        return s[("prefixrouter_ttft_seconds_bucket", key)]

    assert (bucket("0.25"), bucket("0.1"), bucket("+Inf")) == (1, 0, 1)
    exact = (("decision", "exact"), ("le", "0.005"), SYSTEM)
    assert s[("prefixrouter_queue_wait_seconds_bucket", exact)] == 1
    assert s[("prefixrouter_cache_prediction_error_tokens_count", ())] == 3
    assert s[("prefixrouter_cache_prediction_error_tokens_sum", ())] == 100 + 100 + 0
    assert s[("prefixrouter_warm_abandoned_total", (("prefix_class", "system"),))] == 1
    key = (("decision", "exact"), ("status", "200"), ("worker", "w0"))
    assert s[("prefixrouter_requests_total", key)] == 1
    assert s[("prefixrouter_retries_total", (("status", "502"), ("worker", "w1")))] == 1
    assert s[("prefixrouter_kv_evictions_total", (("source", "observed"),))] == 1
    assert s[("prefixrouter_kv_evictions_total", (("source", "mirrored"),))] == 7
    age = (("le", "60.0"), ("prefix_class", "document"))
    assert s[("prefixrouter_evicted_prefix_age_seconds_bucket", age)] == 1
    assert s[("prefixrouter_worker_in_flight", (("worker", "w0"),))] == 2


def test_hit_labels() -> None:
    m = GatewayMetrics(warm_fraction=0.5)
    assert m.hit_label(0, 100) == "cold"
    assert m.hit_label(49, 100) == "partial"
    assert m.hit_label(50, 100) == "warm"


def test_empty_exposition_is_valid() -> None:
    m = GatewayMetrics()
    m.attach_live(list, lambda: 0)
    s = _samples(m)
    assert s[("prefixrouter_cache_prediction_error_tokens_count", ())] == 0


def test_ttft_over_its_prediction_and_each_workers_speed_scale() -> None:
    m = GatewayMetrics()
    slow = WorkerGauges("w0", True, 0, 0.2, 0.0, speed_scale=2.5)
    m.attach_live(lambda: [slow, WorkerGauges("w1", True, 0, 0.2, 0.0)], lambda: 0)
    # 1.2 s observed against 0.3 s predicted (4x); 0.1 s against 0.1 s (exact).
    m.usage("tiny", "default", "document", 9000, 8000, 8000, 1.2, 0.3, "exact")
    m.usage("tiny", "default", "document", 9000, 0, 0, 0.1, 0.1, "cold")
    m.usage("tiny", "default", "document", 9000, 0, 0, None, 0.5, "cold")  # not streamed
    m.usage("tiny", "default", "document", 9000, 0, 0, 0.2, None, "cold")  # no prediction
    s = _samples(m)

    def bucket(decision: str, le: str) -> float:
        key = (("decision", decision), ("le", le))
        return s[("prefixrouter_ttft_prediction_ratio_bucket", key)]

    assert s[("prefixrouter_ttft_prediction_ratio_count", (("decision", "exact"),))] == 1
    assert s[("prefixrouter_ttft_prediction_ratio_sum", (("decision", "exact"),))] == 4.0
    assert (bucket("exact", "2.0"), bucket("exact", "4.0")) == (0, 1)
    assert (bucket("cold", "0.8"), bucket("cold", "1.25")) == (0, 1)
    assert s[("prefixrouter_ttft_prediction_ratio_count", (("decision", "cold"),))] == 1
    assert s[("prefixrouter_worker_speed_scale", (("worker", "w0"),))] == 2.5
    assert s[("prefixrouter_worker_speed_scale", (("worker", "w1"),))] == 1.0


def test_negative_usage_never_decreases_a_counter() -> None:
    m = GatewayMetrics(warm_fraction=0.75)
    m.attach_live(lambda: [], lambda: 0)
    m.usage("tiny", "default", "system", 100, 50, 50, None)
    m.usage("tiny", "default", "system", -15, -30, -5, None)  # a buggy engine's figures
    m.usage("tiny", "default", "system", 10, -30, 0, None)
    s = _samples(m)
    for name, value in s.items():
        if name[0].endswith("_total"):
            assert value >= 0, name
    labels = (("kind", "cached"), ("model", "tiny"), ("pool", "default"), SYSTEM)
    assert s[("prefixrouter_input_tokens_total", labels)] == 50
    saved = (("model", "tiny"), SYSTEM)
    assert s[("prefixrouter_prefill_tokens_saved_total", saved)] == 50
