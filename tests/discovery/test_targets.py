"""Recorded Kubernetes objects -> targets, and the configuration that asks for them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from prefixrouter.discovery.targets import (
    Target,
    TargetIndex,
    endpoint_slice_targets,
    pod_targets,
    selector_of_pool,
)
from prefixrouter.errors import ConfigError
from prefixrouter.gateway.cli import build_config
from prefixrouter.gateway.config import config_from_dict, discovery_spec
from prefixrouter.gateway.discovery_link import worker_config
from tests.discovery.apiserver import RECORDED_PORT, load_recording

SLICES = load_recording("endpointslices", RECORDED_PORT)
PODS = load_recording("pods", RECORDED_PORT)


def _step(recording: dict[str, Any], name: str, part: str = "watch") -> dict[str, Any]:
    obj: dict[str, Any] = next(e for e in recording[part] if e["step"] == name)["object"]
    return obj


def test_a_slice_names_its_pods_by_their_first_address_and_the_slice_port() -> None:
    first = SLICES["list"]["items"][0]
    assert endpoint_slice_targets(first, None) == [
        Target("vllm-6d9c7b5f4-2kqzx", "127.0.0.11", 8000, True),
        Target("vllm-6d9c7b5f4-h8w4m", "127.0.0.12", 8000, True),
    ]
    # A configured port wins over the slice's.
    assert {t.port for t in endpoint_slice_targets(first, 9000)} == {9000}


def test_readiness_follows_conditions_ready_and_nil_means_ready() -> None:
    probe_fails = _step(SLICES, "probe_fails")
    assert [t.ready for t in endpoint_slice_targets(probe_fails, None)] == [True, False]
    terminating = _step(SLICES, "pod_deleted", "gap")
    assert [t.ready for t in endpoint_slice_targets(terminating, None)] == [False]
    nil = copy.deepcopy(probe_fails)
    nil["endpoints"][1]["conditions"] = {}
    assert [t.ready for t in endpoint_slice_targets(nil, None)] == [True, True]


def test_slices_that_name_no_usable_engine() -> None:
    first = SLICES["list"]["items"][0]
    fqdn = {**first, "addressType": "FQDN"}
    assert endpoint_slice_targets(fqdn, None) == []
    two_ports = {**first, "ports": [{"name": "http", "port": 8000}, {"name": "m", "port": 9090}]}
    assert endpoint_slice_targets(two_ports, None) == []  # which one is the engine's? none
    assert len(endpoint_slice_targets(two_ports, 8000)) == 2
    no_pod = copy.deepcopy(first)
    del no_pod["endpoints"][0]["targetRef"]
    no_pod["endpoints"][1]["addresses"] = []
    assert endpoint_slice_targets(no_pod, None) == [
        Target("127.0.0.11:8000", "127.0.0.11", 8000, True)
    ]


def test_ipv6_addresses_are_bracketed_in_urls() -> None:
    t = Target("p", "fd00::1", 8000, True)
    assert t.host == "[fd00::1]"
    config = config_from_dict({"discovery": {"kind": "kubernetes", "service": "vllm"}})
    assert worker_config(config, t).url == "http://[fd00::1]:8000"


def test_pods_need_an_ip_a_ready_condition_and_no_deletion() -> None:
    running, pending, _ = PODS["list"]["items"]
    assert pod_targets(running, 8000) == [
        Target("vllm-llama-5c8b9d7f6-4tq8n", "127.0.0.21", 8000, True)
    ]
    assert pod_targets(pending, 8000) == []
    assert [t.ready for t in pod_targets(_step(PODS, "ip_assigned"), 8000)] == [False]
    assert [t.ready for t in pod_targets(_step(PODS, "terminating"), 8000)] == [False]
    assert pod_targets(running, None) == []


def _terminal(pod: dict[str, Any], phase: str, reason: str) -> dict[str, Any]:
    """``pod`` as the kubelet leaves it in a terminal phase: IP kept, Ready false."""
    out = copy.deepcopy(pod)
    st = out["status"]
    st.update(phase=phase, reason=reason, message=f"The pod is {reason}.")
    for c in st["conditions"]:
        if c["type"] in ("Ready", "ContainersReady"):
            c.update(status="False", reason="PodCompleted" if phase == "Succeeded" else "PodFailed")
    return out


def test_a_pod_in_a_terminal_phase_names_no_target_though_it_keeps_its_ip() -> None:
    """As the EndpointSlice controller: Succeeded and Failed pods are never endpoints."""
    running = PODS["list"]["items"][0]
    for phase, reason in (("Failed", "Evicted"), ("Failed", "OOMKilled"), ("Succeeded", "Done")):
        dead = _terminal(running, phase, reason)
        assert dead["status"]["podIP"] == "127.0.0.21"
        assert pod_targets(dead, 8000) == [], phase
        # Even with a Ready condition left True (a kubelet's last word), and
        # in the index that a list and the watch feed.
        stale = copy.deepcopy(dead)
        for c in stale["status"]["conditions"]:
            c["status"] = "True"
        assert pod_targets(stale, 8000) == []
        index = TargetIndex("Pod", 8000)
        index.replace([running])
        assert set(index.targets()) == {"vllm-llama-5c8b9d7f6-4tq8n"}
        assert index.apply("MODIFIED", stale)
        assert index.targets() == {}


def test_only_a_running_pod_is_ready() -> None:
    """A Pending pod with an IP is a target, not ready; so is one in phase Unknown."""
    running = PODS["list"]["items"][0]
    for phase in ("Pending", "Unknown"):
        pod = copy.deepcopy(running)
        pod["status"]["phase"] = phase
        assert pod_targets(pod, 8000) == [
            Target("vllm-llama-5c8b9d7f6-4tq8n", "127.0.0.21", 8000, False)
        ]


def test_the_pools_selector_and_port() -> None:
    assert selector_of_pool(PODS["pool"]) == ("app=vllm-llama", 8000)
    pool = copy.deepcopy(PODS["pool"])
    pool["spec"]["selector"]["matchLabels"] = {"tier": "gpu", "app": "x"}
    del pool["spec"]["targetPorts"]
    assert selector_of_pool(pool) == ("app=x,tier=gpu", None)
    pool["spec"]["selector"] = {}
    with pytest.raises(ValueError, match="matchLabels"):
        selector_of_pool(pool)


def test_the_index_replays_a_list_and_its_events() -> None:
    index = TargetIndex("EndpointSlice", None)
    index.replace([SLICES["list"]["items"][0]])
    assert set(index.targets()) == {"vllm-6d9c7b5f4-2kqzx", "vllm-6d9c7b5f4-h8w4m"}
    for event in SLICES["watch"] + SLICES["gap"]:
        assert index.apply(event["type"], event["object"])
    assert set(index.targets()) == {
        "vllm-6d9c7b5f4-2kqzx",
        "vllm-6d9c7b5f4-h8w4m",
        "vllm-6d9c7b5f4-x9jrd",
    }
    assert not index.apply("BOOKMARK", {"metadata": {"resourceVersion": "1"}})


def test_an_endpoint_in_two_slices_is_ready_if_either_says_so() -> None:
    index = TargetIndex("EndpointSlice", None)
    first = SLICES["list"]["items"][0]
    stale = copy.deepcopy(first)
    stale["metadata"]["name"] = "vllm-old"
    stale["endpoints"][0]["conditions"]["ready"] = False
    index.replace([stale, first])
    assert index.targets()["vllm-6d9c7b5f4-2kqzx"].ready


def test_a_discovered_worker_gets_the_template_and_its_kv_event_addresses() -> None:
    config = config_from_dict(
        {
            "discovery": {
                "kind": "kubernetes",
                "pool": "vllm-llama",
                "kv_events_port": 5557,
                "kv_replay_port": 5558,
                "worker": {"kind": "vllm", "models": ["llama"], "max_slots": 64},
            }
        }
    )
    assert config.kv_events_on
    wc = worker_config(config, Target("vllm-a", "10.4.2.7", 8000, True))
    assert (wc.url, wc.id, wc.models, wc.max_slots) == (
        "http://10.4.2.7:8000",
        "vllm-a",
        ["llama"],
        64,
    )
    assert wc.kv_events_topic == "vllm-a"  # the pod's --kv-events-config topic: $(POD_NAME)
    assert wc.kv_events_connect == "tcp://10.4.2.7:5557"
    assert wc.kv_replay_endpoint == "tcp://10.4.2.7:5558"
    assert not config_from_dict({}).kv_events_on


@pytest.mark.parametrize(
    ("spec", "fields"),
    [
        ("k8s:llm/app=vllm:8000", {"selector": "app=vllm", "port": 8000}),
        (
            "k8s:llm/app.kubernetes.io/name=vllm,tier!=cpu:8000",
            {"selector": "app.kubernetes.io/name=vllm,tier!=cpu", "port": 8000},
        ),
        ("k8s-pool:llm/vllm-llama", {"pool": "vllm-llama"}),
        ("k8s-service:llm/vllm", {"service": "vllm"}),
    ],
)
def test_discover_specs(spec: str, fields: dict[str, Any]) -> None:
    data = discovery_spec(spec)
    assert data["kind"] == "kubernetes" and data["namespace"] == "llm"
    assert {
        k: v for k, v in data.items() if v is not None and k not in ("kind", "namespace")
    } == fields


@pytest.mark.parametrize(
    "spec", ["k8s:llm", "k8s:/app=x", "dns:llm/x", "k8s-pool:llm/p:99999", "llm/x"]
)
def test_bad_discover_specs_name_the_forms(spec: str) -> None:
    with pytest.raises(ValueError, match=r"k8s|port"):
        discovery_spec(spec)


def test_discover_overrides_the_files_source(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("discovery:\n  kind: kubernetes\n  service: vllm\n  kv_events_port: 5557\n")
    cfg = build_config(
        path, None, 8080, "127.0.0.1", None, "prefix_aware", discover="k8s-pool:prod/pool-a"
    )
    d = cfg.discovery
    assert (d.namespace, d.pool, d.service, d.kv_events_port) == ("prod", "pool-a", None, 5557)
    with pytest.raises(ConfigError, match="--discover"):
        build_config(None, None, 8080, "127.0.0.1", None, "prefix_aware", discover="k8s:nope")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"kind": "kubernetes"}, "needs one of pool, selector, service"),
        ({"kind": "kubernetes", "pool": "a", "service": "b"}, "needs one of"),
        ({"kind": "kubernetes", "selector": "app=x"}, "selector needs port"),
        ({"service": "vllm"}, "needs kind: kubernetes"),
        (
            {"kind": "kubernetes", "service": "v", "worker": {"url": "http://x"}},
            "filled in by discovery",
        ),
        ({"kind": "kubernetes", "service": "v", "worker": {"kind": "tgi"}}, "worker: kind"),
    ],
)
def test_bad_discovery_sections_name_the_field(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config_from_dict({"discovery": section})
    assert "discovery" in str(info.value)
