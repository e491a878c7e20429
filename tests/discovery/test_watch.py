"""The gateway's workers follow a (recorded) Kubernetes cluster.

A real gateway (its application, lifespan and registry, in the test's loop)
with ``discovery: {kind: kubernetes}`` lists and watches the API server of
:mod:`tests.discovery.apiserver`, which replays the recordings, through a
kubeconfig written into ``tmp_path``; the engines the recordings name (fake
vLLM servers, :mod:`tests.gateway.fakes`) listen on the recordings' loopback
pod IPs. Each step emits one recorded event and waits (bounded) until the
worker set follows; traffic then shows a pod that is not ready gets none.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.core.types import WorkerId
from prefixrouter.discovery.kubernetes import DiscoveryError
from prefixrouter.gateway.app import create_app
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.state import STATE, GatewayState
from prefixrouter.harness.ports import free_port
from prefixrouter.prometheus import samples
from tests.admin_client import ADMIN_CONFIG
from tests.cluster.live import until
from tests.discovery.apiserver import FakeApiServer, kubeconfig, load_recording
from tests.gateway.fakes import FakeEngine, make_app

TOKEN = "recorded-sa-token"
NAMESPACE = "llm"


@dataclass
class Cluster:
    """The fake API server, the engines by IP and the gateway in front."""

    api: FakeApiServer
    engines: dict[str, FakeEngine]
    client: TestClient[web.Request, web.Application]
    recording: dict[str, Any]

    @property
    def state(self) -> GatewayState:
        return self.client.app[STATE]

    def step(self, name: str, part: str = "watch") -> dict[str, Any]:
        return next(e for e in self.recording[part] if e["step"] == name)

    def workers(self) -> set[str]:
        return set(self.state.registry.workers)

    def routable(self) -> set[str]:
        return {v.worker_id for v in self.state.registry.views() if v.healthy}

    async def until_routable(self, ids: set[str], workers: set[str] | None = None) -> None:
        async def probe() -> bool:
            return self.routable() == ids and (workers is None or self.workers() == workers)

        await until(probe, f"routable {sorted(ids)}, workers {sorted(workers or ids)}")

    async def metrics(self) -> dict[tuple[str, str], float]:
        """The gateway's ``prefixrouter_discovery_*`` samples: (name, ready label) -> value."""
        resp = await self.client.get("/metrics")
        return {
            (s.name, s.labels.get("ready", "")): s.value
            for s in samples(await resp.text())
            if s.name.startswith("prefixrouter_discovery_")
        }

    async def traffic(self, n: int, seed: str) -> dict[str, int]:
        """Send ``n`` chats with prompts of their own; requests each engine got (by IP)."""
        before = {ip: len(e.requests) for ip, e in self.engines.items()}
        for i in range(n):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"{seed} question {i}: " + "x" * 40 * i}],
                "max_tokens": 2,
            }
            resp = await self.client.post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
        return {ip: len(e.requests) - before[ip] for ip, e in self.engines.items()}


@asynccontextmanager
async def cluster(
    tmp_path: Path, name: str, ips: list[str], discovery: dict[str, Any]
) -> AsyncIterator[Cluster]:
    """Engines on ``ips``, the API server with recording ``name``, a gateway watching it."""
    port = free_port()
    recording = load_recording(name, port)
    api = FakeApiServer(TOKEN)
    resource = "endpointslices" if "service" in discovery else "pods"
    api.load(resource, recording["list"])
    if "pool" in recording:
        api.add_pool(recording["pool"])
    engines = {ip: FakeEngine() for ip in ips}
    servers = [TestServer(make_app(e), host=ip, port=port) for ip, e in engines.items()]
    api_server = TestServer(api.app, host="127.0.0.1", port=0)
    await api_server.start_server()
    for s in servers:
        await s.start_server()
    path = kubeconfig(tmp_path / "kubeconfig", str(api_server.make_url("")), TOKEN, NAMESPACE)
    config = config_from_dict(
        {
            "server": dict(ADMIN_CONFIG),
            "discovery": {
                "kind": "kubernetes",
                "namespace": NAMESPACE,
                "kubeconfig": str(path),
                "worker": {"kind": "vllm"},
                **discovery,
            },
            "metrics_poll": {"interval_s": 0.2},
            "health": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "timeout_s": 1.0},
            "decision_log": {"flush_interval_s": 0.1},
        }
    )
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()  # the lifespan waits for the first list's workers
    try:
        yield Cluster(api, engines, client, recording)
    finally:
        await client.close()
        for s in servers:
            await s.close()
        await api_server.close()


ENDPOINT_IPS = ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"]
POD0, POD1, POD2, POD3 = (
    WorkerId("vllm-6d9c7b5f4-2kqzx"),
    WorkerId("vllm-6d9c7b5f4-h8w4m"),
    WorkerId("vllm-6d9c7b5f4-q5tnv"),
    WorkerId("vllm-6d9c7b5f4-x9jrd"),
)


async def test_workers_follow_endpointslices_through_readiness_and_a_410(tmp_path: Path) -> None:
    async with cluster(tmp_path, "endpointslices", ENDPOINT_IPS, {"service": "vllm"}) as c:
        # The first list: one slice of two ready pods (the other Service's slice is not ours).
        assert c.workers() == {POD0, POD1}
        await c.until_routable({POD0, POD1})
        assert c.state.registry.workers[POD0].url.startswith("http://127.0.0.11:")
        lists = [q for q in c.api.requests if q["resource"] == "endpointslices"]
        assert lists[0]["labelSelector"] == "kubernetes.io/service-name=vllm"
        got = await c.traffic(6, "first")
        assert got["127.0.0.11"] + got["127.0.0.12"] == 6

        # A new pod in a new slice, not ready while it loads: a worker, no traffic.
        await until(_async(lambda: c.api.watch_count() == 1), "the watch")
        c.api.emit("endpointslices", c.step("scale_up"))
        await c.until_routable({POD0, POD1}, workers={POD0, POD1, POD2})
        assert (await c.traffic(6, "loading"))["127.0.0.13"] == 0
        c.api.emit("endpointslices", c.step("new_pod_ready"))
        await c.until_routable({POD0, POD1, POD2})

        # A failing readiness probe takes the pod out of routing, not out of the registry.
        kept = c.state.registry.workers[POD1]
        c.api.emit("endpointslices", c.step("probe_fails"))
        await c.until_routable({POD0, POD2}, workers={POD0, POD1, POD2})
        got = await c.traffic(8, "probe down")
        assert got["127.0.0.12"] == 0
        assert got["127.0.0.11"] + got["127.0.0.13"] == 8
        c.api.emit("endpointslices", c.step("probe_passes"))
        await c.until_routable({POD0, POD1, POD2})
        assert c.state.registry.workers[POD1] is kept

        # The watch drops; what happens before it is back is compacted away, so
        # resuming gets 410 Gone and only a fresh list shows the changes.
        c.api.pause_watches()
        c.api.drop_watches()
        for event in c.recording["gap"]:
            c.api.emit("endpointslices", event)
        c.api.compact()
        c.api.resume_watches()
        await c.until_routable({POD0, POD1, POD3})
        assert c.api.expired_answers >= 1
        watcher = c.state.discovery.watcher if c.state.discovery else None
        assert watcher is not None and watcher.stats.expired >= 1
        assert c.api.count("endpointslices", watch=False) >= 2
        got = await c.traffic(6, "after relist")
        assert got["127.0.0.13"] == 0
        m = await c.metrics()
        assert m[("prefixrouter_discovery_expired_total", "")] >= 1
        assert m[("prefixrouter_discovery_lists_total", "")] >= 2
        assert m[("prefixrouter_discovery_watch_events_total", "")] == 4  # the streamed ones
        assert m[("prefixrouter_discovery_targets", "true")] == 3
        assert m[("prefixrouter_discovery_errors_total", "")] == 0


async def test_workers_follow_the_pods_an_inferencepool_selects(tmp_path: Path) -> None:
    ips = ["127.0.0.21", "127.0.0.22", "127.0.0.29"]
    a, b = "vllm-llama-5c8b9d7f6-4tq8n", "vllm-llama-5c8b9d7f6-wz6kd"
    async with cluster(tmp_path, "pods", ips, {"pool": "vllm-llama"}) as c:
        # The pool's matchLabels and targetPorts pick the pods: the pending pod
        # (no IP yet) and the other app's pod are no workers.
        assert c.workers() == {a}
        pods = [q for q in c.api.requests if q["resource"] == "pods"]
        assert pods[0]["labelSelector"] == "app=vllm-llama"
        await c.until_routable({a})
        await until(_async(lambda: c.api.watch_count() == 1), "the watch")
        c.api.emit("pods", c.step("ip_assigned"))
        await c.until_routable({a}, workers={a, b})
        c.api.emit("pods", c.step("ready"))
        await c.until_routable({a, b})
        c.api.emit("pods", c.step("terminating"))
        await c.until_routable({b}, workers={a, b})
        got = await c.traffic(4, "terminating")
        assert got["127.0.0.21"] == 0 and got["127.0.0.29"] == 0
        c.api.emit("pods", c.step("gone"))
        await c.until_routable({b}, workers={b})


def _pod_event(c: Cluster, kind: str, pod: dict[str, Any], **status: Any) -> dict[str, Any]:
    """A watch event for ``pod`` with ``status`` fields changed, at the API's next version."""
    obj = copy.deepcopy(pod)
    obj["status"].update(status)
    obj["metadata"]["resourceVersion"] = str(c.api.version + 1)
    return {"type": kind, "object": obj}


async def test_an_evicted_pod_is_no_worker_and_the_pod_that_gets_its_ip_is_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With KV events on (as epp.yaml), a pod on an evicted pod's IP has that pod's publisher.

    The evicted pod (phase Failed, its podIP kept in the API) must stop being
    a worker, so the new pod's worker, whose ``kv_events_connect`` is the
    same ``tcp://IP:PORT``, can be added once the old one's requests are
    over; meanwhile it waits, without a warning.
    """
    caplog.set_level(logging.WARNING)
    ips = ["127.0.0.21", "127.0.0.22", "127.0.0.29"]
    a = WorkerId("vllm-llama-5c8b9d7f6-4tq8n")
    new = WorkerId("vllm-llama-5c8b9d7f6-r7xkp")
    discovery = {"pool": "vllm-llama", "kv_events_port": free_port()}
    async with cluster(tmp_path, "pods", ips, discovery) as c:
        await c.until_routable({a})
        assert c.state.registry.workers[a].config.kv_events_connect is not None
        await until(_async(lambda: c.api.watch_count() == 1), "the watch")
        engine = c.engines["127.0.0.21"]
        engine.delay_s = 2.0  # a request in flight when the pod is evicted
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        in_flight = asyncio.create_task(c.client.post("/v1/chat/completions", json=body))
        await until(_async(lambda: engine.running >= 1), "a request in flight")

        pod = c.recording["list"]["items"][0]
        ready_false = [
            {**cond, "status": "False", "reason": "PodFailed"}
            if cond["type"] in ("Ready", "ContainersReady")
            else cond
            for cond in pod["status"]["conditions"]
        ]
        evicted = _pod_event(
            c,
            "MODIFIED",
            pod,
            phase="Failed",
            reason="Evicted",
            message="The node was low on resource: memory.",
            conditions=ready_false,
        )
        c.api.emit("pods", evicted)
        # Out of routing at once; drained (its request finishes), then removed.
        await until(_async(lambda: not c.routable()), "the evicted pod out of routing")
        successor = _pod_event(c, "ADDED", pod)
        meta = successor["object"]["metadata"]
        meta["name"], meta["uid"] = new, "5e1d2c3b-0a9f-4e8d-b7c6-a5f4e3d2c1b0"
        c.api.emit("pods", successor)

        resp = await in_flight
        assert resp.status == 200
        resp.release()
        await c.until_routable({new}, workers={new})
        assert c.state.registry.workers[new].url.startswith("http://127.0.0.21:")
        engine.delay_s = 0.0
        assert (await c.traffic(3, "after eviction"))["127.0.0.21"] == 3
    refused = [r.getMessage() for r in caplog.records if "cannot add" in r.getMessage()]
    assert refused == []


async def test_an_api_server_refusing_the_token_leaves_the_gateway_up_and_retrying(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, "endpointslices", ENDPOINT_IPS[:2], {"service": "vllm"}) as c:
        c.api.token = "rotated"  # every request now gets 401
        watcher = c.state.discovery.watcher if c.state.discovery else None
        assert watcher is not None
        c.api.drop_watches()
        await until(_async(lambda: watcher.stats.errors >= 1), "a failed request")
        assert "401" in (watcher.stats.last_error or "")
        assert (await c.metrics())[("prefixrouter_discovery_errors_total", "")] >= 1
        assert c.workers() == {POD0, POD1}  # the known targets stay
        await c.until_routable({POD0, POD1})


async def test_no_kubeconfig_is_one_clear_error(tmp_path: Path) -> None:
    section = {"kind": "kubernetes", "selector": "app=vllm", "port": 8000}
    config = config_from_dict({"discovery": {**section, "kubeconfig": str(tmp_path / "missing")}})
    client = TestClient(TestServer(create_app(config)))
    with pytest.raises(DiscoveryError, match=r"no kubeconfig \(.*missing not found\)"):
        await client.start_server()
    await client.close()
    broken = tmp_path / "broken"
    broken.write_text("apiVersion: v1\nkind: Config\n")
    config = config_from_dict({"discovery": {**section, "kubeconfig": str(broken)}})
    client = TestClient(TestServer(create_app(config)))
    with pytest.raises(DiscoveryError, match="cannot configure Kubernetes"):
        await client.start_server()
    await client.close()


def _async(check: Any) -> Any:
    async def probe() -> bool:
        return bool(check())

    return probe
