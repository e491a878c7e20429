"""The watcher against an API server that fails it: 410 storms, stale credentials, refusals.

Each test runs a :class:`~prefixrouter.discovery.kubernetes.KubernetesWatcher`
on its own (no gateway) against the fake API server of
:mod:`tests.discovery.apiserver`, serving the recorded pods and InferencePool,
through a kubeconfig in ``tmp_path``, with short retry waits and a seeded
jitter. Each step waits (bounded) for what the watcher reports, and the log
lines it writes are checked: one per episode, with the API's own words.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from prefixrouter.discovery.kubernetes import Backoff, KubernetesWatcher, WatchOptions
from tests.cluster.live import until
from tests.discovery.apiserver import RECORDED_PORT, FakeApiServer, kubeconfig, load_recording

NAMESPACE = "llm"
POOL = "vllm-llama"
A, B = "vllm-llama-5c8b9d7f6-4tq8n", "vllm-llama-5c8b9d7f6-wz6kd"
SIDECAR = "sidecar-exporter-0"
FAST = {"retry_initial_s": 0.05, "retry_max_s": 0.5, "request_timeout_s": 5.0}
"""Retry waits short enough for a test, long enough to count relists against."""

PLUGIN = """\
import json, pathlib, sys
# An exec credential plugin (as aws eks get-token): prints the current token.
token = pathlib.Path(sys.argv[1]).read_text().strip()
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1",
    "kind": "ExecCredential",
    "status": {"token": token, "expirationTimestamp": "2099-01-01T00:00:00Z"},
}))
"""


class Run:
    """The API server, the watcher and what it said."""

    def __init__(self, api: FakeApiServer, watcher: KubernetesWatcher) -> None:
        self.api = api
        self.watcher = watcher

    def targets(self) -> set[str]:
        return set(self.watcher.stats.targets)

    def emit(self, step: str) -> None:
        recording = load_recording("pods", RECORDED_PORT)
        self.api.emit("pods", next(e for e in recording["watch"] if e["step"] == step))

    async def until(self, check: Callable[[], bool], what: str) -> None:
        async def probe() -> bool:
            return check()

        await until(probe, what)

    async def watching(self) -> None:
        await self.until(lambda: self.api.watch_count() == 1, "a watch open")


def _api(token: str) -> FakeApiServer:
    recording = load_recording("pods", RECORDED_PORT)
    api = FakeApiServer(token)
    api.load("pods", recording["list"])
    api.add_pool(recording["pool"])
    return api


@asynccontextmanager
async def run(
    tmp_path: Path,
    api: FakeApiServer,
    credentials: dict[str, Any] | None = None,
    **options: Any,
) -> AsyncIterator[Run]:
    """Serve ``api``, point a kubeconfig with ``credentials`` at it, start a watcher."""
    server = TestServer(api.app, host="127.0.0.1", port=0)
    await server.start_server()
    creds = credentials if credentials is not None else {"token": api.token}
    token = creds.pop("token", None)
    path = kubeconfig(tmp_path / "kubeconfig", str(server.make_url("")), token, NAMESPACE, **creds)
    o = WatchOptions(namespace=NAMESPACE, kubeconfig=path, **{"pool": POOL, **FAST, **options})
    watcher = KubernetesWatcher(o, lambda targets: None, rng=random.Random(7))
    await watcher.start()
    try:
        await watcher.first_attempt.wait()
        yield Run(api, watcher)
    finally:
        await watcher.stop()
        await server.close()


def _said(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.WARNING) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "prefixrouter.discovery" and r.levelno == level and text in r.getMessage()
    ]


def test_the_backoff_doubles_to_its_cap_and_draws_each_wait_in_its_upper_half() -> None:
    backoff = Backoff(0.5, 4.0, random.Random(3))
    waits = [backoff.next() for _ in range(8)]
    for wait, full in zip(waits, (0.5, 1, 2, 4, 4, 4, 4, 4), strict=True):
        assert full / 2 <= wait <= full
    assert len({round(w, 6) for w in waits[3:]}) == 5  # jittered, not one fixed value
    again = Backoff(0.5, 4.0, random.Random(3))
    assert [again.next() for _ in range(8)] == waits  # seeded: the same draws
    backoff.reset()
    assert backoff.next() <= 0.5


async def test_a_watch_that_keeps_answering_410_relists_with_backoff_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixrouter.discovery")
    api = _api("t")
    async with run(tmp_path, api) as r:
        await r.watching()
        lists_before = api.count("pods", watch=False)
        # A watch cache lagging behind the list: every watch, even from the
        # version a fresh list just gave, answers 410 Gone.
        api.watch_lags = True
        api.drop_watches()
        started = time.monotonic()
        await asyncio.sleep(2.0)
        relists = api.count("pods", watch=False) - lists_before
        elapsed = time.monotonic() - started
        # Without a backoff this is a relist every few milliseconds (hundreds);
        # with it, waits of 25-50 ms doubling to 250-500 ms: at most ~14 in 2 s.
        assert 3 <= relists <= 16, (relists, elapsed)
        assert r.watcher.stats.expired >= relists
        assert len(_said(caplog, "410 Gone again")) == 1  # once for the episode
        assert r.targets() == {A}  # the lists still work and keep the targets

        api.watch_lags = False
        await r.watching()
        r.emit("ip_assigned")  # the watch holds: it delivers an event
        await r.until(lambda: r.targets() == {A, B}, "the event")
        assert len(_said(caplog, "watching again after")) == 1
        # A single 410 later (history compacted while no watch was open) is
        # routine: one relist at once, and no warning.
        api.pause_watches()
        api.drop_watches()
        r.emit("ready")
        api.compact()
        api.resume_watches()
        expired = r.watcher.stats.expired
        await r.until(lambda: r.watcher.stats.expired == expired + 1, "a 410")
        await r.watching()
        assert len(_said(caplog, "410 Gone again")) == 1
        assert _said(caplog, "watch expired (410 Gone)", logging.INFO)


async def test_a_rotated_token_file_is_read_again_on_a_401(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixrouter.discovery")
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    api = _api("token-1")
    async with run(tmp_path, api, {"token_file": token_file}) as r:
        await r.watching()
        assert r.targets() == {A}
        # The token is rotated (a projected token, a CI secret): the API now
        # refuses the old one, and the next request must carry the new one.
        token_file.write_text("token-2\n")  # as `echo` writes it: the newline is no part
        api.token = "token-2"
        api.drop_watches()
        r.emit("ip_assigned")
        await r.until(lambda: r.targets() == {A, B}, "the pod seen with the new token")
        assert r.watcher.stats.credential_reloads == 1
        assert r.watcher.stats.errors == 1
        assert _said(caplog, "401", logging.INFO)
        assert not _said(caplog, "401")  # put right at once: nothing to warn about

        # Refused even with the file read again (rotated on the API's side
        # only): retried with backoff, the kubeconfig read before each try,
        # and said once.
        api.token = "token-3"
        api.drop_watches()
        await r.until(lambda: r.watcher.stats.credential_reloads >= 5, "reloads")
        assert len(_said(caplog, "API answered 401")) == 1
        assert r.targets() == {A, B}  # the known targets stay
        token_file.write_text("token-3\n")
        r.emit("ready")
        await r.until(lambda: api.watch_count() == 1 and r.watcher.stats.lists >= 3, "relist")
        assert len(_said(caplog, "accepts the reloaded credentials")) == 1


async def test_an_exec_plugins_token_is_renewed_on_a_401(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    current = tmp_path / "current-token"
    current.write_text("exec-1")
    api = _api("exec-1")
    command = [sys.executable, str(plugin), str(current)]
    async with run(tmp_path, api, {"exec_command": command}) as r:
        await r.watching()
        # The cloud's token expired: the API refuses it, the plugin now prints another.
        current.write_text("exec-2")
        api.token = "exec-2"
        api.drop_watches()
        r.emit("ip_assigned")
        await r.until(lambda: r.targets() == {A, B}, "the pod seen with the plugin's new token")
        assert r.watcher.stats.credential_reloads == 1


async def test_refusals_say_what_the_api_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RBAC's 403 names the missing permission; a missing pool's 404 names the pool."""
    api = _api("t")
    api.forbidden = {"inferencepools"}
    async with run(tmp_path, api) as r:
        error = r.watcher.stats.last_error or ""
        assert error.startswith("API answered 403: ")
        assert (
            'User "system:serviceaccount:llm:prefixrouter-epp" cannot get resource '
            '"inferencepools" in API group "inference.networking.k8s.io" in the namespace "llm"'
        ) in error
        assert error in _said(caplog, "keeping 0 known targets")[0]
        # The Role is fixed; now the pods are refused (the list's own answer).
        api.forbidden = {"pods"}
        await r.until(lambda: "pods" in (r.watcher.stats.last_error or ""), "the pods' 403")
        assert 'cannot list resource "pods" in API group ""' in (r.watcher.stats.last_error or "")
        api.forbidden = set()
        await r.watching()
        assert r.targets() == {A}
    api = _api("t")
    api.pools.clear()
    async with run(tmp_path, api) as r:
        assert r.watcher.stats.last_error == (
            'API answered 404: inferencepools.inference.networking.k8s.io "vllm-llama" not found'
        )


async def test_a_proxys_error_page_is_said_to_be_one_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    page = "<html>\n<head><title>502 Bad Gateway</title></head>\n<body>nginx</body>\n</html>\n"
    api = _api("t")
    async with run(tmp_path, api) as r:
        await r.watching()
        api.proxy_error = (502, "text/html", page)
        api.drop_watches()  # the next watch gets the proxy's page
        await r.until(lambda: r.watcher.stats.errors >= 2, "the watch and the list refused")
        said = _said(caplog, "known targets")
        assert said and not [s for s in said if "TypeError" in s]
        first = said[0]
        assert "HTTP 502 (text/html; charset=utf-8), not a Kubernetes API answer" in first
        assert "'<html>" in first
        assert r.targets() == {A}
        api.proxy_error = None
        r.emit("ip_assigned")
        await r.until(lambda: r.targets() == {A, B}, "the API back")


def _pool(api: FakeApiServer) -> dict[str, Any]:
    return copy.deepcopy(api.pools[(NAMESPACE, POOL)])


async def test_an_edited_pool_is_followed_within_pool_check_s(tmp_path: Path) -> None:
    api = _api("t")
    async with run(tmp_path, api, pool_check_s=1.0) as r:
        await r.watching()
        assert r.targets() == {A}
        lists = api.count("pods", watch=False)
        pool = _pool(api)
        pool["spec"]["selector"]["matchLabels"] = {"app": "sidecar-exporter"}
        api.update_pool(pool)
        # Well within resync_s (300 s): the next pool check, a second away.
        await r.until(lambda: r.targets() == {SIDECAR}, "the new selector's pods")
        assert r.watcher.stats.selector == "app=sidecar-exporter"
        pool = _pool(api)
        pool["spec"]["targetPorts"] = [{"number": 9000}]
        api.update_pool(pool)
        await r.until(
            lambda: {t.port for t in r.watcher.stats.targets.values()} == {9000}, "the new port"
        )
        assert api.count("pods", watch=False) == lists + 2  # a list per edit, no more
        # No edit: the pods' watch resumes from its version, without a list.
        await asyncio.sleep(2.5)
        assert api.count("pods", watch=False) == lists + 2


async def test_a_deleted_pool_keeps_its_pods_and_follows_them_until_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = _api("t")
    async with run(tmp_path, api, pool_check_s=1.0) as r:
        await r.watching()
        pool = _pool(api)
        api.delete_pool(NAMESPACE, POOL)
        checks = api.count("inferencepools", watch=False)
        await r.until(lambda: api.count("inferencepools", watch=False) > checks, "a pool check")
        assert r.targets() == {A}
        # The pods are still followed, through the watch and through a relist
        # (a 410), with the pool's last selector.
        r.emit("ip_assigned")
        await r.until(lambda: r.targets() == {A, B}, "a pod's change")
        api.pause_watches()
        api.drop_watches()
        r.emit("ready")
        r.emit("gone")
        api.compact()
        api.resume_watches()
        await r.until(lambda: r.targets() == {B}, "the relist after the 410")
        assert r.watcher.stats.targets[B].ready
        assert r.watcher.stats.pool_gone
        gone = _said(caplog, "is gone")
        assert len(gone) == 1
        assert "keeping its last selector 'app=vllm-llama' on port 8000" in gone[0]
        assert "not found" in gone[0]
        # Back, with another selector: taken.
        pool["spec"]["selector"]["matchLabels"] = {"app": "sidecar-exporter"}
        api.update_pool(pool)
        await r.until(lambda: r.targets() == {SIDECAR}, "the pool back")
        assert not r.watcher.stats.pool_gone
        assert _said(caplog, "is back")[-1].endswith("is back")
