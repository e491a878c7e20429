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
   in between is lost, so the loop lists again (1), at once. A watch that
   answers 410 again right after that fresh list (an API server whose watch
   cache lags behind its list, a proxy that replays the error) would make
   that a storm of full lists, so the relists that follow back off as
   failures do (4) until a watch holds. The episode is logged when it starts
   and when it ends, both at WARNING (whoever saw it start must see it end),
   never per relist. The loop also lists again every ``resync_s``, which
   heals anything a watch could have missed;
4. any other failure (API server unreachable, 403 for missing RBAC, a
   malformed answer) is logged and retried with a backoff doubling from
   ``retry_initial_s`` to ``retry_max_s``; the last known targets stay in
   force meanwhile (an API server outage must not empty the fleet). Each wait
   is drawn between half and all of the doubled one (jitter), so replicas
   that failed together (an API server restart) do not retry together, and
   the backoff starts over only once a watch holds (a list that works is not
   enough: a watch failing after each list would relist at the shortest
   wait for ever). The log line carries the API's own ``Status`` message
   (which names the missing permission or object), and an answer that is not
   the API's (a proxy's HTML error page) is said to be one, with its HTTP
   status and content type;
5. a **401 Unauthorized** means the credentials went stale: a kubeconfig's
   ``tokenFile`` was rotated, an exec plugin's token (``aws eks get-token``,
   ``gke-gcloud-auth-plugin``, ``kubelogin``) expired, or the file itself was
   rewritten. kubernetes-asyncio reads a kubeconfig once (``load_kube_config``;
   its ``refresh_token`` helper only renews exec and GCP tokens on a timer,
   never a ``tokenFile``), so the watcher configures a fresh client from the
   file, as kubectl and client-go do on a 401: the exec plugin runs again and
   the token file is read again. The first retry is at once; if the API still
   refuses, it reloads and retries with the backoff of (4), with one WARNING
   when the episode starts and one when the API accepts the credentials
   again. In a cluster, kubernetes-asyncio reads the service account's token
   again by itself (``load_incluster_config`` installs a
   ``refresh_api_key_hook`` that, on each request, re-reads the token file
   once a minute has passed since the last read); a 401 there reloads it at
   once all the same.

**InferencePool.** Its selector and target port are read before each list
and again each time a watch of its pods ends, which for a pool is every
``pool_check_s`` (10 s by default: the pods' watch is asked to end that
often, and is resumed from its version, so no relist unless the pool
changed; one GET and one watch request per period cost the API server
little, and keep the loop a single one, where watching the pool too would
need a second loop with its own versions, 410s and retries). An edit of
``spec.selector`` or ``targetPorts`` therefore takes effect within
``pool_check_s``: the pods are listed again with the new selector, and those
it no longer selects are drained. A **deleted** pool (404) does not drain
its pods: the watcher keeps the last selector and port it read, so the pods
it selected stay workers and keep following their own changes (ready, not
ready, deleted), with one WARNING, until the pool is back (another WARNING;
whatever selector it then has is taken). A pool is deleted and created again by ``kubectl
replace --force``, Helm and GitOps tools, and without a pool the Gateway
routes nothing to this picker anyway, so draining would only lose the cache
picture of every pod for nothing. A pool that is missing when the watcher
starts is an error like any other (4): there is no selector to keep.

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
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixrouter.discovery.targets import ObjectKind, Target, TargetIndex, selector_of_pool
from prefixrouter.errors import PrefixRouterError, exception_text

log = logging.getLogger("prefixrouter.discovery")

SERVICE_LABEL = "kubernetes.io/service-name"
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
SNIPPET_CHARS = 120
"""How much of an answer that is not the API's goes into a log line."""


def kubeconfig_files() -> list[Path]:
    """Where kubectl looks for its configuration: ``$KUBECONFIG`` (paths), else ~/.kube/config."""
    env = os.environ.get("KUBECONFIG", "")
    paths = [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return paths or [Path("~/.kube/config").expanduser()]


class DiscoveryError(PrefixRouterError):
    """The Kubernetes client cannot be configured (no kubeconfig, not in a cluster)."""


def describe_answer(
    status: int, reason: str | None, body: bytes | str | None, content_type: str | None
) -> str:
    """One line for a failed answer: the API's ``Status`` message, else what came instead.

    The API server explains every refusal in a ``v1.Status`` body (``"message":
    "... cannot get resource \"inferencepools\" in API group ..."``); the HTTP
    reason phrase (``Forbidden``) alone does not say what is missing. An answer
    that is not JSON (a load balancer's or proxy's HTML error page) is named
    as such, with its status, content type and first characters, so it is
    not mistaken for the API's word.
    """
    text = body.decode(errors="replace") if isinstance(body, bytes) else (body or "")
    if not text.strip():
        return f"API answered {status}: {reason or 'no body'}"
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("message"):
        return f"API answered {status}: {data['message']}"
    snippet = " ".join(text.split())[:SNIPPET_CHARS]
    kind = content_type or "no Content-Type"
    return f"HTTP {status} ({kind}), not a Kubernetes API answer (a proxy in between?): {snippet!r}"


def api_error(exc: Any) -> str:
    """:func:`describe_answer` for a kubernetes-asyncio ``ApiException``.

    Raised for a whole answer (``http_resp``: a read's 403 or 404), it holds
    the body and headers; raised for a watch's ``ERROR`` event, its reason is
    already ``Reason: message``.
    """
    headers = exc.headers if isinstance(exc.headers, Mapping) else {}
    return describe_answer(exc.status, exc.reason, exc.body, headers.get("Content-Type"))


def _answer_error(
    status: int, reason: str | None, body: bytes | str, content_type: str | None
) -> Exception:
    """An ``ApiException`` for an answer read here (``_preload_content=False``).

    It keeps the status (a 401 or 410 is handled by it) and carries the body,
    as the library's own exceptions do, so :func:`api_error` describes it.
    """
    from kubernetes_asyncio.client.exceptions import ApiException
    from multidict import CIMultiDict, CIMultiDictProxy

    exc = ApiException(status=status, reason=reason)
    exc.body = body.encode() if isinstance(body, str) else body
    exc.headers = CIMultiDictProxy(CIMultiDict({"Content-Type": content_type or ""}))
    return exc


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
        pool_check_s: How often the pool is read again (its pods' watch ends
            and resumes that often; the server counts in whole seconds, so at
            least 1).
        retry_initial_s: First wait after a failure (before jitter).
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
    pool_check_s: float = 10.0
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    request_timeout_s: float = 10.0

    @property
    def kind(self) -> ObjectKind:
        """The objects watched: a Service's EndpointSlices, or pods."""
        return "EndpointSlice" if self.service is not None else "Pod"

    @property
    def watch_s(self) -> int:
        """How long one watch is asked to last (``timeoutSeconds``, whole seconds, at least 1)."""
        period = self.resync_s if self.pool is None else min(self.resync_s, self.pool_check_s)
        return max(1, int(period))

    def describe(self) -> str:
        """One line naming the source (logs, errors)."""
        if self.service is not None:
            return f"EndpointSlices of Service {self.namespace}/{self.service}"
        if self.pool is not None:
            return f"pods of InferencePool {self.namespace}/{self.pool}"
        return f"pods {self.selector!r} in namespace {self.namespace}"


class Backoff:
    """Waits that double from ``initial_s`` up to ``max_s``, each drawn in [half, all] of it.

    The cap bounds every wait by ``max_s``; the jitter spreads replicas that
    failed at the same moment (an API server restart, a compaction) so that
    they do not come back at the same moment. ``rng`` makes it deterministic
    in tests.
    """

    def __init__(self, initial_s: float, max_s: float, rng: random.Random) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.rng = rng
        self.failures = 0
        """Failures since the last :meth:`reset`."""

    def next(self) -> float:
        """The wait after one more failure."""
        full = min(self.max_s, self.initial_s * 2.0 ** min(self.failures, 63))
        self.failures += 1
        return full * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        """A success: the next failure waits ``initial_s`` (or half of it) again."""
        self.failures = 0


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
    credential_reloads: int = 0
    """Clients configured again after a 401 (the kubeconfig read anew)."""
    pool_gone: bool = False
    """The InferencePool answered 404: its last selector is kept (module docstring)."""
    resource_version: str | None = None
    selector: str | None = None
    targets: dict[str, Target] = field(default_factory=dict)


class KubernetesWatcher:
    """Lists and watches one source and reports its targets (module docstring).

    Args:
        options: What to watch.
        on_change: Called with the full target set after each list and event.
        rng: Draws the backoff's jitter (None: a fresh, unseeded one).
    """

    def __init__(
        self,
        options: WatchOptions,
        on_change: Callable[[dict[str, Target]], None],
        rng: random.Random | None = None,
    ):
        self.options = options
        self.on_change = on_change
        self.stats = WatchStats()
        self.first_attempt = asyncio.Event()
        """Set once the first list succeeded or failed."""
        self._index = TargetIndex(options.kind, options.port)
        self._api: Any = None
        self._task: asyncio.Task[None] | None = None
        rng = rng if rng is not None else random.Random()
        self._errors = Backoff(options.retry_initial_s, options.retry_max_s, rng)
        """Waits after failures and refusals (reset by a watch that holds: :meth:`_held`)."""
        self._gone = Backoff(options.retry_initial_s, options.retry_max_s, rng)
        """Waits between relists while every watch answers 410 (reset by a watch that holds)."""
        self._gone_streak = 0
        """410s since the last watch that held: 1 is routine, 2 and more an episode."""
        self._refusals = 0
        """401s since the last watch that held; only the first is retried at once."""
        self._refusal_told = False
        """The 401 episode under way was logged (once: it may last until someone acts)."""

    async def start(self) -> None:
        """Configure the client and start the loop in the background.

        Raises:
            DiscoveryError: No usable client configuration.
        """
        self._api = await self._configure()
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

    def _in_cluster(self) -> bool:
        return self.options.kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))

    def _credentials(self) -> str:
        """Where the client's configuration comes from (logs)."""
        if self.options.kubeconfig is not None:
            return str(self.options.kubeconfig)
        if self._in_cluster():
            return "the pod's service account"
        return os.pathsep.join(map(str, kubeconfig_files()))

    async def _configure(self) -> Any:
        """A client configured afresh: the kubeconfig read (exec plugin run) or the pod's token.

        Raises:
            DiscoveryError: No usable client configuration.
        """
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        path = self.options.kubeconfig
        in_cluster = self._in_cluster()
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
        # kubernetes-asyncio takes a tokenFile as it is, newline included (a
        # file written by `echo`, a mounted Secret); aiohttp then refuses the
        # header. client-go trims it, and so do we: a token has no whitespace.
        token = configuration.api_key.get("BearerToken")
        if isinstance(token, str):
            configuration.api_key["BearerToken"] = token.strip()
        return client.ApiClient(configuration)

    # ------------------------------------------------------------------ loop

    async def _run(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        o = self.options
        while True:
            try:
                version = await self._list()
                self.first_attempt.set()
                self._accepted()
                listed_at = time.monotonic()
                while time.monotonic() - listed_at < o.resync_s:
                    started = time.monotonic()
                    version = await self._watch(version)
                    self._held()  # it ended as the server ends watches, not with a 410
                    if time.monotonic() - started < o.retry_initial_s:
                        # A server that ends every watch at once must not spin us.
                        await asyncio.sleep(o.retry_initial_s)
                    if o.pool is not None and await self._read_pool():
                        break  # the pool selects other pods, or another port: list them
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    await self._expired()
                elif exc.status == 401:
                    await self._unauthorized(api_error(exc))
                else:
                    await self._failed(api_error(exc))
            except Exception as exc:  # the loop must outlive any failure
                await self._failed(exception_text(exc))

    async def _expired(self) -> None:
        """A 410 Gone: list again, at once the first time, with backoff while it repeats."""
        self.stats.expired += 1
        self._gone_streak += 1
        if self._gone_streak == 1:
            log.info("discovery: watch expired (410 Gone): listing again")
            return
        wait = self._gone.next()
        if self._gone_streak == 2:
            log.warning(
                "discovery: %s: the watch answered 410 Gone again right after a fresh list; "
                "listing again with backoff (up to %.0f s) until a watch holds",
                self.options.describe(),
                self.options.retry_max_s,
            )
        await asyncio.sleep(wait)

    def _held(self) -> None:
        """A watch delivered an event or ended as the server ends watches: all is well.

        Only then do the backoffs start over. A list that works is not
        enough: if every watch after it fails (or answers 410), resetting
        there would relist at the shortest wait for ever.
        """
        if self._gone_streak >= 2:
            log.warning(
                "discovery: %s: watching again after %d lists answered by 410 Gone",
                self.options.describe(),
                self._gone_streak,
            )
        self._gone_streak = 0
        self._gone.reset()
        self._errors.reset()
        self._refusals = 0

    async def _unauthorized(self, error: str) -> None:
        """A 401: configure the client afresh (module docstring, 5) and retry."""
        self.stats.errors += 1
        self.stats.last_error = error
        self._refusals += 1
        try:
            api = await self._configure()
        except DiscoveryError as exc:
            reloaded = f"reloading credentials failed: {exc}"
        else:
            old, self._api = self._api, api
            self.stats.credential_reloads += 1
            await old.close()
            reloaded = f"credentials reloaded from {self._credentials()}"
            if self._refusals == 1:
                # The usual case: a token expired or was rotated under us; fresh
                # ones should be accepted, so the retry does not wait.
                log.info("discovery: %s: %s; %s", self.options.describe(), error, reloaded)
                return
        wait = self._errors.next()
        if not self._refusal_told:
            self._refusal_told = True
            log.warning(
                "discovery: %s: %s; %s; keeping %d known targets, reloading and retrying "
                "with backoff (up to %.0f s) without a word until the API accepts them",
                self.options.describe(),
                error,
                reloaded,
                len(self.stats.targets),
                self.options.retry_max_s,
            )
        self.first_attempt.set()
        await asyncio.sleep(wait)

    def _accepted(self) -> None:
        """A list worked: a 401 episode, if any, is over (said once).

        The count of refusals starts over only once a watch holds (:meth:`_held`),
        so that an API that took the list and refused the watch cannot make
        every retry an immediate one.
        """
        if self._refusal_told:
            log.warning(
                "discovery: %s: the API server accepts the reloaded credentials again",
                self.options.describe(),
            )
        self._refusal_told = False

    async def _failed(self, error: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = error
        wait = self._errors.next()
        log.warning(
            "discovery: %s: %s; keeping %d known targets, retrying in %.1f s",
            self.options.describe(),
            error,
            len(self.stats.targets),
            wait,
        )
        self.first_attempt.set()
        await asyncio.sleep(wait)

    def _list_call(self) -> tuple[Callable[..., Any], str]:
        from kubernetes_asyncio import client

        if self.options.service is not None:
            disc = client.DiscoveryV1Api(self._api)
            return disc.list_namespaced_endpoint_slice, f"{SERVICE_LABEL}={self.options.service}"
        selector = self.stats.selector or self.options.selector or ""
        return client.CoreV1Api(self._api).list_namespaced_pod, selector

    async def _read_pool(self) -> bool:
        """Take the pod selector and port from the ``InferencePool``; whether they changed.

        A 404 while a selector is known keeps that selector (the module
        docstring says why); without one (the first read) it is an error.
        """
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        o = self.options
        assert o.pool is not None  # only called for a pool
        try:
            pool = await client.CustomObjectsApi(self._api).get_namespaced_custom_object(
                POOL_GROUP,
                POOL_VERSION,
                o.namespace,
                POOL_PLURAL,
                o.pool,
                _request_timeout=o.request_timeout_s,
            )
        except ApiException as exc:
            if exc.status != 404 or self.stats.selector is None:
                raise
            if not self.stats.pool_gone:
                self.stats.pool_gone = True
                log.warning(
                    "discovery: InferencePool %s/%s is gone (%s); keeping its last selector "
                    "%r on port %s: the pods it selected stay workers until it is back",
                    o.namespace,
                    o.pool,
                    api_error(exc),
                    self.stats.selector,
                    self._index.port,
                )
            return False
        if self.stats.pool_gone:
            self.stats.pool_gone = False
            log.warning("discovery: InferencePool %s/%s is back", o.namespace, o.pool)
        selector, port = selector_of_pool(pool)
        port = o.port if o.port is not None else port
        if port is None:
            raise ValueError(f"InferencePool {o.pool!r} has no spec.targetPorts")
        changed = selector != self.stats.selector or port != self._index.port
        if changed:
            log.info("discovery: InferencePool %s selects %r on port %d", o.pool, selector, port)
        self.stats.selector = selector
        if port != self._index.port:
            self._index = TargetIndex("Pod", port)
        return changed

    async def _list(self) -> str:
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
            content_type = resp.headers.get("Content-Type")
            if resp.status != 200:
                raise _answer_error(resp.status, resp.reason, body, content_type)
        finally:
            resp.release()
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise _answer_error(resp.status, resp.reason, body, content_type)
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
                timeout_seconds=o.watch_s,
                allow_watch_bookmarks=True,
                # The server ends the watch; this only bounds a dead connection.
                _request_timeout=o.watch_s + o.request_timeout_s,
            )
            async for event in stream:
                if not isinstance(event, dict):
                    # kubernetes-asyncio hands on a line that is not JSON as it
                    # came (a proxy's error page): say so, never index into it.
                    resp = w.resp
                    status = resp.status if resp is not None else 0
                    reason = resp.reason if resp is not None else None
                    ctype = resp.headers.get("Content-Type") if resp is not None else None
                    raise _answer_error(status, reason, str(event), ctype)
                self._held()
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
