"""deploy/kubernetes/: the manifests parse and agree with each other and with our CLI.

No cluster here to apply them to, so what would break on one is checked by
reading them: every selector matches the labels it must select, every port
the port it names, the EPP's flags are flags its command really has, its
``--discover`` names the pool, its configuration validates as the gateway's,
and the KV-event wiring of the vLLM pods is the one discovery connects to.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import typer.main
import yaml

from prefixrouter.cli import app
from prefixrouter.gateway.cli import apply_discover
from prefixrouter.gateway.config import config_from_dict

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
FILES = ("inferencepool.yaml", "epp.yaml", "vllm.yaml", "gateway.yaml")
EPP_FLAGS_FROM_ISSUE_16 = {"--http-port"}
"""The EPP's own flags beside serve's (issue 16): checked against serve's until `epp` exists."""


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for name in FILES:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text(encoding="utf-8")):
            assert doc["apiVersion"] and doc["metadata"]["name"], name
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} twice"
            assert "namespace" not in doc["metadata"], "namespaced by `kubectl apply -n`"
            out[key] = doc
    return out


DOCS = _docs()


def _one(kind: str) -> dict[str, Any]:
    found = [d for (k, _), d in DOCS.items() if k == kind]
    assert len(found) == 1, kind
    return found[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _args(container: dict[str, Any]) -> dict[str, str]:
    """``--flag=value`` (and bare ``--flag``) arguments, by flag."""
    out = {}
    for arg in container["args"]:
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
            out[flag] = value
    return out


def _port(container: dict[str, Any], name: str) -> int:
    port: int = next(p["containerPort"] for p in container["ports"] if p["name"] == name)
    return port


POOL = _one("InferencePool")
EPP = DOCS[("Deployment", "prefixrouter-epp")]
VLLM = DOCS[("Deployment", "vllm-llama")]


def test_every_manifest_has_the_api_versions_of_the_apis_it_uses() -> None:
    versions = {kind: d["apiVersion"] for (kind, _), d in DOCS.items()}
    assert versions["InferencePool"] == "inference.networking.k8s.io/v1"
    assert versions["Gateway"] == versions["HTTPRoute"] == "gateway.networking.k8s.io/v1"
    assert versions["Deployment"] == "apps/v1"
    assert versions["Role"] == versions["RoleBinding"] == "rbac.authorization.k8s.io/v1"


def test_the_pool_selects_the_vllm_pods_on_their_port() -> None:
    spec = POOL["spec"]
    labels = VLLM["spec"]["template"]["metadata"]["labels"]
    assert _selects(spec["selector"]["matchLabels"], labels)
    assert _selects(VLLM["spec"]["selector"]["matchLabels"], labels)
    assert not _selects(
        spec["selector"]["matchLabels"], EPP["spec"]["template"]["metadata"]["labels"]
    )
    (target,) = spec["targetPorts"]
    vllm = _container(VLLM)
    assert target["number"] == _port(vllm, "http") == int(_args(vllm)["--port"])


def test_the_pool_points_at_the_epp_service_and_its_grpc_port() -> None:
    ref = POOL["spec"]["endpointPickerRef"]
    service = DOCS[("Service", ref["name"])]
    assert ref.get("kind", "Service") == "Service"
    assert _selects(service["spec"]["selector"], EPP["spec"]["template"]["metadata"]["labels"])
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    epp = _container(EPP)
    assert _port(epp, grpc["targetPort"]) == int(_args(epp)["--port"])
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert _port(epp, http["targetPort"]) == int(_args(epp)["--http-port"])
    assert epp["readinessProbe"]["grpc"]["port"] == int(_args(epp)["--port"])


def test_the_epp_may_read_what_discovery_watches() -> None:
    pod = EPP["spec"]["template"]["spec"]
    account = DOCS[("ServiceAccount", pod["serviceAccountName"])]
    binding = _one("RoleBinding")
    assert {"kind": "ServiceAccount", "name": account["metadata"]["name"]} in binding["subjects"]
    role = DOCS[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for group, resource in [
        ("inference.networking.k8s.io", "inferencepools"),
        ("", "pods"),
        ("discovery.k8s.io", "endpointslices"),
    ]:
        for verb in ("get", "list", "watch"):
            assert (group, resource, verb) in granted, (group, resource, verb)


def test_the_epp_flags_are_the_cli_s_and_its_configuration_validates() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    epp = _container(EPP)
    assert epp["command"] == ["prefixrouter"] and epp["args"][0] == "epp"
    if "epp" in commands:
        known = {o for p in commands["epp"].params for o in p.opts}
    else:  # the EPP command lands on another branch (issue 16 item 1): serve's flags + its own
        known = {o for p in commands["serve"].params for o in p.opts} | EPP_FLAGS_FROM_ISSUE_16
    args = _args(epp)
    assert set(args) <= known, set(args) - known
    # Kubernetes expands $(POD_NAMESPACE) from the downward API.
    env = {e["name"]: e for e in epp["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    config_map = DOCS[
        ("ConfigMap", EPP["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"])
    ]
    mount = epp["volumeMounts"][0]["mountPath"]
    (file_name,) = config_map["data"]
    assert args["--config"] == f"{mount}/{file_name}"
    data = yaml.safe_load(config_map["data"][file_name])
    apply_discover(data, args["--discover"].replace("$(POD_NAMESPACE)", "llm"))
    config = config_from_dict(data, "epp.yaml ConfigMap")
    d = config.discovery
    assert (d.kind, d.namespace, d.pool) == ("kubernetes", "llm", POOL["metadata"]["name"])
    assert config.kv_events_on
    # KV events name token blocks: token mode, with the served model's tokenizer,
    # which the init container downloads into a volume the picker mounts.
    assert config.routing.mode == "token" and config.routing.tokenizer is not None
    spec = EPP["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    init_args = init["args"]
    assert _args(_container(VLLM))["--model"] in init_args and "tokenizer.json" in init_args
    assert "tokenizer_config.json" in init_args  # the chat template
    mounts = {m["name"]: m["mountPath"] for m in epp["volumeMounts"]}
    (init_mount,) = init["volumeMounts"]
    assert f"--local-dir={init_mount['mountPath']}" in init_args
    assert str(config.routing.tokenizer) == mounts[init_mount["name"]]


def test_vllm_publishes_kv_events_where_discovery_connects() -> None:
    vllm = _container(VLLM)
    args = _args(vllm)
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    events = json.loads(args["--kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    config_map = DOCS[("ConfigMap", "prefixrouter-epp")]
    discovery = yaml.safe_load(config_map["data"]["config.yaml"])["discovery"]
    # "*" makes vLLM bind; discovery connects to POD_IP:port.
    assert events["endpoint"] == f"tcp://*:{discovery['kv_events_port']}"
    assert events["replay_endpoint"] == f"tcp://*:{discovery['kv_replay_port']}"
    assert _port(vllm, "kv-events") == discovery["kv_events_port"]
    assert _port(vllm, "kv-replay") == discovery["kv_replay_port"]
    # The topic is the pod's name: the id discovery gives the pod's worker.
    assert events["topic"] == "$(POD_NAME)"
    env = {e["name"]: e for e in vllm["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_route_sends_the_api_to_the_pool_through_the_gateway() -> None:
    route = _one("HTTPRoute")
    gateway = _one("Gateway")
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gateway["metadata"]["name"])
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend["group"] == "inference.networking.k8s.io"
    assert (backend["kind"], backend["name"]) == ("InferencePool", POOL["metadata"]["name"])
    assert rule["matches"][0]["path"]["value"] == "/v1"


PROMETHEUS = DEPLOY.parent / "prometheus" / "prometheus.yml"


def _scrape_config_uncommented() -> dict[str, Any]:
    """``prometheus.yml`` with its commented Kubernetes jobs uncommented, as it says to."""
    lines = PROMETHEUS.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  # - job_name:"))
    jobs = lines[start:]
    assert all(line.startswith(("  # - ", "  #   ")) for line in jobs), "one block, at the end"
    text = "\n".join(lines[:start] + [line.replace("  # ", "  ", 1) for line in jobs])
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def test_the_prometheus_kubernetes_jobs_scrape_these_manifests_pods() -> None:
    """Uncommented as is, the file loads (unique job names) and each job keeps one Deployment."""
    config = _scrape_config_uncommented()
    names = [job["job_name"] for job in config["scrape_configs"]]
    assert len(names) == len(set(names)), names  # Prometheus refuses a repeated job_name
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    metrics_port = {
        "prefixrouter-epp": int(_args(_container(EPP))["--http-port"]),  # serves /metrics
        "vllm-llama": int(_args(_container(VLLM))["--port"]),
    }
    kept: dict[str, str] = {}
    for job in config["scrape_configs"]:
        if "kubernetes_sd_configs" not in job:
            continue
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod"
        (namespace,) = sd["namespaces"]["names"]
        assert f"kubectl create namespace {namespace}" in readme
        assert f"kubectl -n {namespace} apply -f deploy/kubernetes/" in readme
        rules = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
        app = rules[("__meta_kubernetes_pod_label_app",)]
        port = rules[("__meta_kubernetes_pod_container_port_name",)]
        assert app["action"] == port["action"] == "keep"
        for deployment in (EPP, VLLM):
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            if re.fullmatch(app["regex"], labels["app"]):  # Prometheus anchors its regexes
                assert labels["app"] not in kept, "two jobs scrape one Deployment"
                kept[labels["app"]] = job["job_name"]
                ports = _container(deployment)["ports"]
                (scraped,) = [p for p in ports if re.fullmatch(port["regex"], p["name"])]
                assert scraped["containerPort"] == metrics_port[labels["app"]]
                assert job.get("metrics_path", "/metrics") == "/metrics"
    assert set(kept) == {"prefixrouter-epp", "vllm-llama"}, kept
