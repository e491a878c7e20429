"""Discovered engines -> the gateway's workers (``discovery: {kind: kubernetes}``).

:class:`DiscoveryLink` runs a :class:`~prefixrouter.discovery.kubernetes.KubernetesWatcher`
and keeps the :class:`~prefixrouter.gateway.workers.WorkerRegistry` in step with
its targets, through the registry's own calls (those behind ``POST`` and
``DELETE /admin/workers``), so a discovered worker is like any other:

* a new pod becomes a worker (:meth:`WorkerRegistry.add`: checked once, then
  polled), out of routing until it is ready;
* readiness changes flip :meth:`WorkerRegistry.set_ready` (its index entries
  stay);
* a pod that is gone (or whose address changed) is drained and removed
  (:meth:`WorkerRegistry.drain_and_remove`, ``proxy.drain_timeout_s``), in the
  background, so one long drain does not hold up the rest;
* a new pod that got the address of a pod still being drained (the network
  hands a freed IP to the next pod) would share its KV-event publisher
  (``kv_events_connect``), which the registry refuses: it waits, quietly,
  until that drain is over (the drain wakes the reconciler), then is added.
  Any other refusal is logged on each pass, so a pod that cannot be added
  is not mentioned once and then forgotten.

The watcher only records the newest target set and wakes the reconciler; the
reconciler applies the difference with the registry, one pass at a time, so
a burst of events costs one pass. The link owns only the workers it added:
a configured worker of the same id wins (logged once), and one the admin
API removed comes back on the next pass if its pod is still there
(Kubernetes is the source of truth).

Built by :func:`prefixrouter.gateway.state.build_state` and started in the
application's lifespan after the registry, so the gateway and the endpoint
picker, both built from one ``GatewayConfig``, get it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pydantic import ValidationError

from prefixrouter.core.types import WorkerId
from prefixrouter.discovery.kubernetes import KubernetesWatcher, WatchOptions
from prefixrouter.discovery.targets import Target
from prefixrouter.gateway.config import GatewayConfig, WorkerConfig
from prefixrouter.gateway.workers import WorkerRegistry

log = logging.getLogger("prefixrouter.gateway")


def watch_options(config: GatewayConfig) -> WatchOptions:
    """The watcher's options from ``config.discovery``."""
    d = config.discovery
    return WatchOptions(
        namespace=d.namespace,
        service=d.service,
        selector=d.selector,
        pool=d.pool,
        port=d.port,
        kubeconfig=d.kubeconfig,
        resync_s=d.resync_s,
        retry_max_s=d.retry_max_s,
        pool_check_s=d.pool_check_s,
    )


def worker_config(config: GatewayConfig, target: Target) -> WorkerConfig:
    """The ``workers:`` entry of a discovered engine (the module docstring's fields).

    Raises:
        ValidationError: The target makes an invalid entry (a bad address).
    """
    d = config.discovery
    data = {**d.worker, "url": f"{d.scheme}://{target.host}:{target.port}", "id": target.id}
    if d.kv_events_port is not None:
        data["kv_events_topic"] = target.id
        data["kv_events_connect"] = f"tcp://{target.host}:{d.kv_events_port}"
        if d.kv_replay_port is not None:
            data["kv_replay_endpoint"] = f"tcp://{target.host}:{d.kv_replay_port}"
    return WorkerConfig.model_validate(data)


class DiscoveryLink:
    """Keeps the registry's discovered workers equal to the watcher's targets.

    Args:
        config: The gateway configuration (``discovery``, ``proxy.drain_timeout_s``).
        registry: The gateway's worker registry.
    """

    def __init__(self, config: GatewayConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self.watcher = KubernetesWatcher(watch_options(config), self._on_targets)
        self.owned: dict[WorkerId, str] = {}
        """The workers this link added: id -> URL."""
        self.passes = 0
        self._desired: dict[str, Target] | None = None
        self._wake = asyncio.Event()
        self._applied = asyncio.Event()
        self._draining: dict[WorkerId, asyncio.Task[None]] = {}
        self._clashes: set[WorkerId] = set()
        self._waiting: set[WorkerId] = set()
        """Pods waiting for a drain to free their KV-event address (logged once each)."""
        self._task: asyncio.Task[None] | None = None

    def _on_targets(self, targets: dict[str, Target]) -> None:
        self._desired = targets
        self._wake.set()

    async def start(self) -> None:
        """Start watching; return once the first list is applied (or has failed).

        Raises:
            DiscoveryError: No usable Kubernetes client configuration.
        """
        await self.watcher.start()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._reconcile(), name="discovery-link")
        await self.watcher.first_attempt.wait()
        if self._desired is not None:
            await self._applied.wait()

    async def stop(self) -> None:
        """Stop watching and reconciling; drains under way are cut short."""
        await self.watcher.stop()
        tasks = [t for t in (self._task, *self._draining.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        self._draining.clear()

    async def _reconcile(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._desired is None:
                continue
            try:
                await self._apply(self._desired)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let the reconciler die
                log.exception("discovery: applying targets failed: %s", exc)
            self.passes += 1
            self._applied.set()

    async def _apply(self, targets: dict[str, Target]) -> None:
        reg = self.registry
        wanted: dict[WorkerId, tuple[Target, WorkerConfig]] = {}
        for t in targets.values():
            try:
                wanted[WorkerId(t.id)] = (t, worker_config(self.config, t))
            except ValidationError as exc:
                log.warning("discovery: %s (%s) skipped: %s", t.id, t.address, exc)
        self._waiting &= wanted.keys()  # a waiting pod that went is told again if it comes back
        for wid, url in list(self.owned.items()):
            entry = wanted.get(wid)
            if wid not in reg.workers:  # removed by the admin API: re-added below
                del self.owned[wid]
            elif entry is None or entry[1].url != url:
                del self.owned[wid]
                self._drain(wid)
        adds = []
        for wid, (t, wc) in wanted.items():
            if wid in self.owned:
                reg.set_ready(wid, t.ready)
            elif wid in self._draining:
                continue  # re-added once its drain is over (the drain wakes us)
            elif wid in reg.workers:
                if wid not in self._clashes:
                    self._clashes.add(wid)
                    log.warning("discovery: pod %s has a configured worker's id: skipped", wid)
            elif (holder := self._held_by_drain(wc)) is not None:
                if wid not in self._waiting:  # the drain wakes us when it is over
                    self._waiting.add(wid)
                    log.info(
                        "discovery: %s waits for %s's drain (its KV-event address)", wid, holder
                    )
            else:
                adds.append(self._add(wc, t.ready))
        if adds:
            await asyncio.gather(*adds)

    def _held_by_drain(self, wc: WorkerConfig) -> WorkerId | None:
        """The worker being drained here whose KV-event publisher ``wc`` would reuse.

        (Its topic is its id, the pod's name: a pod of the same name waits
        for its own drain already.)
        """
        publisher = wc.kv_events_connect
        if publisher is None:
            return None
        for wid in self._draining:
            w = self.registry.workers.get(wid)
            if w is not None and w.config.kv_events_connect == publisher:
                return wid
        return None

    async def _add(self, wc: WorkerConfig, ready: bool) -> None:
        wid = WorkerId(wc.id)
        self._waiting.discard(wid)
        self.owned[wid] = wc.url
        try:
            await self.registry.add(wc, ready=ready)
        except (KeyError, ValueError) as exc:
            del self.owned[wid]
            log.warning("discovery: cannot add %s: %s", wid, exc)
            return
        log.info("discovery: added worker %s (%s%s)", wid, wc.url, "" if ready else ", not ready")

    def _drain(self, wid: WorkerId) -> None:
        async def drain() -> None:
            try:
                timeout = self.config.proxy.drain_timeout_s
                result = await self.registry.drain_and_remove(wid, timeout)
                log.info("discovery: removed worker %s (drained: %s)", wid, result["drained"])
            except KeyError:
                pass  # already removed (the admin API)
            finally:
                self._draining.pop(wid, None)
                self._wake.set()

        self._draining[wid] = asyncio.get_running_loop().create_task(drain(), name=f"drain-{wid}")
