"""List and watch the engines' EndpointSlices or pods with kubernetes-asyncio.

The loop is the one every Kubernetes controller runs (client-go's reflector):

1. **list** the objects (the selected Service's EndpointSlices, by the label
   ``kubernetes.io/service-name``, or the pods of a label selector; for an
   ``InferencePool``, read the pool first and take its selector and target
   port), replace the :class:`~prefixrouter.discovery.targets.TargetIndex`
   with them and remember the list's ``resourceVersion``;
2. **watch** from that version (``?watch=1&resourceVersion=RV``: a chunked
   stream of JSON lines ``{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK",
   "object": ...}``), applying each event and remembering each object's
   version; the server ends a watch after ``timeoutSeconds`` (``resync_s``),
   and it is resumed from the last version seen;
3. the server answers a watch from a version it no longer holds (its history
   is compacted) with an ``ERROR`` event of status **410 Gone**: what happened
   in between is lost, so the loop lists again (1). It also lists again every
   ``resync_s``, which heals anything a watch could have missed;
4. any other failure (API server unreachable, 403 for missing RBAC, a
   malformed answer) is logged and retried with a backoff doubling from
   ``retry_initial_s`` to ``retry_max_s``; the last known targets stay in
   force meanwhile (an API server outage must not empty the fleet).

After the list and after each event the watcher calls ``on_change`` with the
whole target set (cheap: tens of pods); the caller diffs it.

:class:`DiscoveryCollector` exports what it did as Prometheus metrics
(``prefixrouter_discovery_lists_total``, ``_watch_events_total``,
``_expired_total`` for the 410s, ``_errors_total``, and
``prefixrouter_discovery_targets{ready}``), so an API server that refuses the
EPP (403: missing RBAC) shows on a dashboard, not only in its log.

The client configuration comes from ``kubeconfig`` when given, else the pod's
service account (``KUBERNETES_SERVICE_HOST`` set: in a cluster), else
``$KUBECONFIG`` or ``~/.kube/config``. kubernetes-asyncio is imported when a
watcher starts, not with this module: it takes over a second to import and a
gateway without discovery never needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixrouter.discovery.targets import ObjectKind, Target, TargetIndex, selector_of_pool
from prefixrouter.errors import PrefixRouterError

log = logging.getLogger("prefixrouter.discovery")

SERVICE_LABEL = "kubernetes.io/service-name"
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def kubeconfig_files() -> list[Path]:
    """Where kubectl looks for its configuration: ``$KUBECONFIG`` (paths), else ~/.kube/config."""
    env = os.environ.get("KUBECONFIG", "")
    paths = [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return paths or [Path("~/.kube/config").expanduser()]


class DiscoveryError(PrefixRouterError):
    """The Kubernetes client cannot be configured (no kubeconfig, not in a cluster)."""


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """What to watch, where, and how often to start over.

    Exactly one of ``service``, ``selector`` and ``pool`` is set.

    Attributes:
        namespace: The namespace of the engines (and of the pool or Service).
        service: A Service whose EndpointSlices name the engines.
        selector: A label selector of the engines' pods.
        pool: An ``InferencePool`` whose selector and target port name them.
        port: The engines' port (None: the pool's, or each slice's only port).
        kubeconfig: A kubeconfig file (None: in-cluster, else the default one).
        resync_s: A watch lasts this long; a fresh list follows.
        retry_initial_s: First wait after a failure.
        retry_max_s: Longest wait between retries.
        request_timeout_s: Bound on one list or pool read.
    """

    namespace: str
    service: str | None = None
    selector: str | None = None
    pool: str | None = None
    port: int | None = None
    kubeconfig: Path | None = None
    resync_s: float = 300.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    request_timeout_s: float = 10.0

    @property
    def kind(self) -> ObjectKind:
        """The objects watched: a Service's EndpointSlices, or pods."""
        return "EndpointSlice" if self.service is not None else "Pod"

    def describe(self) -> str:
        """One line naming the source (logs, errors)."""
        if self.service is not None:
            return f"EndpointSlices of Service {self.namespace}/{self.service}"
        if self.pool is not None:
            return f"pods of InferencePool {self.namespace}/{self.pool}"
        return f"pods {self.selector!r} in namespace {self.namespace}"


@dataclass(slots=True)
class WatchStats:
    """What the watcher did (``/admin``-style introspection and tests)."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    expired: int = 0
    """Watches answered 410 Gone (then listed again)."""
    errors: int = 0
    last_error: str | None = None
    resource_version: str | None = None
    selector: str | None = None
    targets: dict[str, Target] = field(default_factory=dict)


class KubernetesWatcher:
    """Lists and watches one source and reports its targets (module docstring).

    Args:
        options: What to watch.
        on_change: Called with the full target set after each list and event.
    """

    def __init__(self, options: WatchOptions, on_change: Callable[[dict[str, Target]], None]):
        self.options = options
        self.on_change = on_change
        self.stats = WatchStats()
        self.first_attempt = asyncio.Event()
        """Set once the first list succeeded or failed."""
        self._index = TargetIndex(options.kind, options.port)
        self._api: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Configure the client and start the loop in the background.

        Raises:
            DiscoveryError: No usable client configuration.
        """
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        path = self.options.kubeconfig
        in_cluster = path is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        if not in_cluster:
            files = [path] if path is not None else kubeconfig_files()
            if not any(f.is_file() for f in files):
                raise DiscoveryError(
                    f"discovery: no kubeconfig ({', '.join(map(str, files))} not found) and "
                    "not in a cluster (KUBERNETES_SERVICE_HOST is unset): set "
                    "discovery.kubeconfig or KUBECONFIG"
                )
        try:
            if in_cluster:
                load_incluster: Callable[..., None] = config.load_incluster_config
                load_incluster(client_configuration=configuration)
            else:
                await config.load_kube_config(
                    config_file=str(path) if path is not None else None,
                    client_configuration=configuration,
                )
        except (config.ConfigException, OSError, ValueError) as exc:
            where = str(path) if path is not None else "in-cluster or default kubeconfig"
            msg = f"discovery: cannot configure Kubernetes ({where}): {exc}"
            raise DiscoveryError(msg) from None
        self._api = client.ApiClient(configuration)
        log.info("discovery: watching %s", self.options.describe())
        self._task = asyncio.get_running_loop().create_task(self._run(), name="discovery")

    async def stop(self) -> None:
        """Stop the loop and close the client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._api is not None:
            await self._api.close()
            self._api = None

    # ------------------------------------------------------------------ loop

    async def _run(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        o = self.options
        backoff = o.retry_initial_s
        while True:
            try:
                version = await self._list()
                self.first_attempt.set()
                backoff = o.retry_initial_s
                listed_at = time.monotonic()
                while time.monotonic() - listed_at < o.resync_s:
                    started = time.monotonic()
                    version = await self._watch(version)
                    if time.monotonic() - started < o.retry_initial_s:
                        # A server that ends every watch at once must not spin us.
                        await asyncio.sleep(o.retry_initial_s)
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    self.stats.expired += 1
                    log.info("discovery: watch expired (410 Gone): listing again")
                    continue
                await self._failed(f"API answered {exc.status}: {exc.reason}", backoff)
                backoff = min(o.retry_max_s, backoff * 2)
            except Exception as exc:  # the loop must outlive any failure
                await self._failed(f"{type(exc).__name__}: {exc}", backoff)
                backoff = min(o.retry_max_s, backoff * 2)

    async def _failed(self, error: str, backoff: float) -> None:
        self.stats.errors += 1
        self.stats.last_error = error
        log.warning(
            "discovery: %s: %s; keeping %d known targets, retrying in %.1f s",
            self.options.describe(),
            error,
            len(self.stats.targets),
            backoff,
        )
        self.first_attempt.set()
        await asyncio.sleep(backoff)

    def _list_call(self) -> tuple[Callable[..., Any], str]:
        from kubernetes_asyncio import client

        if self.options.service is not None:
            disc = client.DiscoveryV1Api(self._api)
            return disc.list_namespaced_endpoint_slice, f"{SERVICE_LABEL}={self.options.service}"
        selector = self.stats.selector or self.options.selector or ""
        return client.CoreV1Api(self._api).list_namespaced_pod, selector

    async def _read_pool(self) -> None:
        """Take the pod selector and port from the ``InferencePool`` (each list)."""
        from kubernetes_asyncio import client

        o = self.options
        assert o.pool is not None  # only called for a pool
        pool = await client.CustomObjectsApi(self._api).get_namespaced_custom_object(
            POOL_GROUP,
            POOL_VERSION,
            o.namespace,
            POOL_PLURAL,
            o.pool,
            _request_timeout=o.request_timeout_s,
        )
        selector, port = selector_of_pool(pool)
        port = o.port if o.port is not None else port
        if port is None:
            raise ValueError(f"InferencePool {o.pool!r} has no spec.targetPorts")
        if selector != self.stats.selector or port != self._index.port:
            log.info("discovery: InferencePool %s selects %r on port %d", o.pool, selector, port)
        self.stats.selector = selector
        if port != self._index.port:
            self._index = TargetIndex("Pod", port)

    async def _list(self) -> str:
        from kubernetes_asyncio.client.exceptions import ApiException

        if self.options.pool is not None:
            await self._read_pool()
        call, selector = self._list_call()
        resp = await call(
            self.options.namespace,
            label_selector=selector,
            _preload_content=False,
            _request_timeout=self.options.request_timeout_s,
        )
        try:
            body = await resp.read()
            if resp.status != 200:
                raise ApiException(status=resp.status, reason=body[:200].decode(errors="replace"))
        finally:
            resp.release()
        data = json.loads(body)
        items = data.get("items") or []
        self._index.replace(items)
        version = str((data.get("metadata") or {}).get("resourceVersion") or "")
        self.stats.lists += 1
        self.stats.resource_version = version
        self._report()
        return version

    async def _watch(self, version: str) -> str:
        """Apply one watch's events; return the version to resume from."""
        from kubernetes_asyncio import watch

        call, selector = self._list_call()
        o = self.options
        self.stats.watches += 1
        w = watch.Watch()
        async with w:
            stream = w.stream(
                call,
                o.namespace,
                label_selector=selector,
                resource_version=version,
                timeout_seconds=max(1, int(o.resync_s)),
                allow_watch_bookmarks=True,
                # The server ends the watch; this only bounds a dead connection.
                _request_timeout=o.resync_s + o.request_timeout_s,
            )
            async for event in stream:
                if self._index.apply(event["type"], event["raw_object"]):
                    self.stats.events += 1
                    self._report()
                self.stats.resource_version = w.resource_version
        return str(w.resource_version or version)

    def _report(self) -> None:
        targets = self._index.targets()
        self.stats.targets = targets
        self.on_change(targets)


class DiscoveryCollector(Collector):
    """Prometheus metrics of one watcher (read at scrape time; module docstring)."""

    def __init__(self, watcher: KubernetesWatcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[Metric]:
        """The watcher's counters and its targets by readiness."""
        s = self.watcher.stats
        for name, doc, value in (
            ("lists", "Full lists of the discovery source (start, 410 Gone, resync)", s.lists),
            ("watch_events", "Watch events applied (ADDED, MODIFIED, DELETED)", s.events),
            ("expired", "Watches the API server answered 410 Gone (then listed again)", s.expired),
            ("errors", "Failed lists and watches (retried with backoff)", s.errors),
        ):
            yield CounterMetricFamily(f"prefixrouter_discovery_{name}", doc, value=value)
        targets = GaugeMetricFamily(
            "prefixrouter_discovery_targets",
            "Engines the source names, by readiness",
            labels=["ready"],
        )
        ready = sum(1 for t in s.targets.values() if t.ready)
        targets.add_metric(["true"], ready)
        targets.add_metric(["false"], len(s.targets) - ready)
        yield targets
