"""The Grafana dashboard and the alert rules read only series that live gateways export.

Every PromQL expression of ``deploy/grafana/prefixrouter-dashboard.json``
(each panel's targets and each variable's query) and of
``deploy/prometheus/alerts.yml`` is read with :mod:`tests.docs.promql`; each
metric it names must be on the live cluster's ``/metrics`` pages (the
``live_pages`` fixture: engines, two replicas, traffic), with samples, and
each label it matches or groups by must be one those samples carry (or one
Prometheus adds: ``job``, ``instance``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.docs.conftest import Page
from tests.docs.promql import parse
from tests.docs.test_metric_reference import documented

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "prefixrouter-dashboard.json"
PROMETHEUS = ROOT / "deploy" / "prometheus"
TARGET_LABELS = {"job", "instance"}
# Declared from the start but without a sample until the event happens (a
# retry, a lint finding in observe mode, a dropped fact): checked by type only.
# The seed's five metric groups (each must be broken down by prefix class):
# input tokens, TTFT by hit, queue wait by decision (its count: routed
# requests), evictions with their age, the warm-abandoned share.
SEED_GROUPS = {
    f"prefixrouter_{name}"
    for name in (
        "input_tokens_total",
        "ttft_seconds_bucket",
        "queue_wait_seconds_count",
        "evicted_prefix_age_seconds_bucket",
        "warm_abandoned_total",
    )
}
NO_SAMPLE_YET = {
    "prefixrouter_retries_total",
    "prefixrouter_lint_findings_total",
    "prefixrouter_cluster_facts_dropped_total",
    # Sampled once a tenant limit or the overload queue acts, which this traffic never
    # makes happen (tests/gateway/test_tenant_limits.py drives them); declared all the same.
    "prefixrouter_tenant_rejected_total",
    "prefixrouter_tenant_waiting",
    "prefixrouter_tenant_queue_wait_seconds_bucket",
}


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text(encoding="utf-8")))


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expression) for every panel target and every query variable."""
    dash = dashboard()
    out = [
        (f"panel {p['title']!r}", t["expr"])
        for p in dash["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']!r}", v["query"]["query"]))
    return out


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    return [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]


def _labels(pages: dict[str, Page], name: str) -> set[str]:
    seen: set[str] = set()
    for page in pages.values():
        seen |= page.labels_of(name)
    if not seen:  # no sample yet: the reference's labels for its family
        family = name.removesuffix("_total")
        for suffix in ("_bucket", "_sum", "_count"):
            family = family.removesuffix(suffix)
        seen = set(documented()[family][1])
    return seen | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())


def _check(pages: dict[str, Page], queries: list[tuple[str, str]]) -> set[str]:
    with_samples = set().union(*(p.sample_names for p in pages.values()))
    declared = {
        name
        for p in pages.values()
        for family, kind in p.families.items()
        for name in {
            "counter": [family + "_total"],
            "histogram": [family + s for s in ("_bucket", "_sum", "_count")],
        }.get(kind, [family])
    }
    used: set[str] = set()
    for where, expr in queries:
        q = parse(expr)
        assert q.metrics, f"{where}: no metric in {expr!r}"
        for m in q.metrics:
            assert m in declared, f"{where}: {m} is not exported"
            assert m in with_samples or m in NO_SAMPLE_YET, f"{where}: {m} has no sample"
        for m, labels in q.matchers.items():
            assert labels <= _labels(pages, m), f"{where}: {m} has no label {labels}"
        available = set().union(*(_labels(pages, m) for m in q.metrics))
        assert q.grouping <= available, f"{where}: grouped by {q.grouping - available}"
        used |= q.metrics
    return used


def test_every_dashboard_query_reads_exported_series(live_pages: dict[str, Page]) -> None:
    used = _check(live_pages, dashboard_queries())
    # The seed's five groups, predicted against actual, per worker, and the replicas' lag.
    wanted = SEED_GROUPS | {
        "prefixrouter_kv_evictions_total",
        "prefixrouter_queue_wait_seconds_bucket",
        "prefixrouter_predicted_cached_tokens_total",
        "prefixrouter_worker_in_flight",
        "prefixrouter_cluster_propagation_lag_seconds_bucket",
    }
    assert wanted <= used, wanted - used
    # The traffic made each TTFT panel's three lines exist.
    hits = {
        s.labels["hit"]
        for s in live_pages["r0"].samples
        if s.name.startswith("prefixrouter_ttft_seconds")
    }
    assert hits == {"warm", "partial", "cold"}


def test_every_alert_rule_reads_exported_series(live_pages: dict[str, Page]) -> None:
    assert len(_check(live_pages, alert_queries())) >= 8


def test_each_seed_group_is_broken_down_by_prefix_class() -> None:
    by_class: set[str] = set()
    for _, expr in dashboard_queries():
        q = parse(expr)
        if "prefix_class" in q.grouping:
            by_class |= q.metrics
    assert by_class >= SEED_GROUPS, SEED_GROUPS - by_class


def test_the_dashboard_is_a_grafana_model_on_a_datasource_variable() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
        assert {t["refId"] for t in p["targets"]} == {chr(65 + i) for i in range(len(p["targets"]))}
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"


def test_the_scrape_example_loads_the_alert_rules() -> None:
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text(encoding="utf-8"))
    assert cfg["rule_files"] == ["alerts.yml"]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "prefixrouter"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]


def test_promql_names_metrics_labels_and_skips_functions_and_variables() -> None:
    q = parse(
        "histogram_quantile(0.9, sum by (le, hit) (rate(prefixrouter_ttft_seconds_bucket"
        '{job=~"$job", prefix_class=~"$prefix_class"}[$__rate_interval]))) '
        '/ on (job) group_left sum(x_total{a="1,}b"}) > bool 2'
    )
    assert q.metrics == {"prefixrouter_ttft_seconds_bucket", "x_total"}
    assert q.matchers == {
        "prefixrouter_ttft_seconds_bucket": {"job", "prefix_class"},
        "x_total": {"a"},
    }
    assert q.grouping == {"le", "hit", "job"}
    lv = parse('label_values(prefixrouter_requests_total{job=~"$job"}, instance)')
    assert lv.metrics == {"prefixrouter_requests_total"} and lv.grouping == {"instance"}
    assert lv.matchers == {"prefixrouter_requests_total": {"job"}}
