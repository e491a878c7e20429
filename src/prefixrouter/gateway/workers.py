"""The worker registry: health with backoff, metric polls, models, drain and remove.

Each worker has one background task (started in the app's lifespan, or when
added through the admin API) that, every ``metrics_poll.interval_s`` while the
worker is healthy:

1. checks health (``GET /health``; ``/v1/models`` for plain OpenAI servers);
2. discovers the models and LoRA adapters it serves (``GET /v1/models``; an
   entry whose ``parent`` differs from its ``id`` is an adapter), unless the
   configuration lists them: at its first passed check, again every
   ``metrics_poll.models_interval_s`` (adapters loaded or unloaded at
   runtime), and at once when the engine shows it may serve something else:
   it restarted (step 3 saw a new process), it is back after being down, or
   it answered 404 for a model it listed (:meth:`WorkerRegistry.rediscover`,
   from the proxy, which retries that request elsewhere). A model it stops
   listing leaves its routing at once, and the name stays known
   (:meth:`WorkerRegistry.serves`: 503 while no worker lists it, as for a
   removed worker's, not 404). A failed listing keeps the last list. Each
   entry's ``root``, ``parent`` and ``max_model_len`` are kept for
   ``GET /v1/models``;
3. scrapes ``/metrics`` for the engine's queue (running, waiting), KV usage and
   KV size (vLLM's ``vllm:cache_config_info`` labels ``block_size`` and
   ``num_gpu_blocks``) and mirrors the KV room in the router's index
   (:meth:`Dispatcher.mirror_capacity`, the formula the simulator uses too).

A failed check (or a request that could not reach the worker) takes the worker
out of routing once ``health.unhealthy_after`` checks in a row failed; it is
then re-checked after ``backoff_initial_s``, multiplied by ``backoff_factor``
per failure up to ``backoff_max_s`` (2 s by default, so a restarted engine
gets traffic within about that of answering again), and returns on the first
success.

**Suspect.** A request whose worker sent no first byte in time (or whose
stream stalled, or whose connection broke mid-answer, as every stream of a
crashed engine does) marks the worker *suspect* (:meth:`WorkerRegistry.mark_suspect`):
it leaves routing at once and its poller checks it at once. A passing check
brings it back (a slow engine is back within milliseconds); a failing one
counts as usual, so a frozen engine is marked down by its first check's
timeout instead of after its next poll. No request is routed to a frozen
engine in the meantime, and its index entries are untouched.

**The index through an outage.** A worker marked down keeps its index
entries, demoted to speculative (:meth:`Dispatcher.worker_down`): an engine that
was frozen, overloaded or cut off still has its cache, so wiping it after one
health timeout under load would throw away its warm prefixes. The entries are
cleared (:meth:`Dispatcher.worker_restarted`) only when the engine shows it is a
new process: its ``process_start_time_seconds`` changed, or its prefix-cache
counters (``vllm:prefix_cache_queries_total``) went backwards; the KV-event
feed clears them on a sequence reset. An engine that reports neither (no
``/metrics``) keeps the speculative entries until they expire (the index's
speculative TTL) or miss. A worker back from being down (or from an
outlier ejection, below) gets its calibration restarted from the fleet's
best either way
(:meth:`Dispatcher.worker_up`): its factor is as old as the outage, while the
others kept learning, and one past the tie band above theirs would get no
cold request until they queued.

Routing reads prebuilt :class:`~prefixrouter.core.types.WorkerView` objects,
one per worker, refreshed in place: the poller writes the engine figures, the
in-flight ledger's figures are copied in just before each decision
(:meth:`WorkerRegistry.views`). The list is rebuilt only when membership,
health or draining changes.

Draining (``DELETE /admin/workers/{id}``): the worker leaves routing at once;
its in-flight requests finish (up to a timeout); then the router forgets it
(index, calibration, policy state) and its poller stops. Requests still running
on a removed worker complete normally but feed nothing back, so the index never
holds entries of a worker that is gone. A worker is drained once: a second
``DELETE`` joins the drain under way (:meth:`WorkerRegistry.drain_and_remove`),
and removal acts on that very worker, never on one added since under its id.
Its models stay known (:meth:`WorkerRegistry.serves`): their requests get 503
with ``Retry-After`` while no worker serves them, not 404.

**Outlier ejection** (:meth:`WorkerRegistry.observe`, the state machine in
:mod:`prefixrouter.core.outlier`): every answer a worker gives is a success or
a failure (a 5xx other than 504, a refused or broken connection, a malformed
or cut answer; a timeout is the suspect mark's business, a client that left
says nothing). ``outlier.consecutive_failures`` failures in a row take a
worker whose health checks pass out of routing for a while (longer each time,
capped; never more than ``outlier.max_ejected_share`` of the fleet, never the
last routable worker); it comes back on probation, checked before each
routing decision (:meth:`WorkerRegistry.views`: one comparison when nothing
is due). An ejected worker keeps its index entries and its poller, as a
suspect one does: its cache is intact.

Readiness (:meth:`WorkerRegistry.set_ready`, from endpoint discovery: a pod
whose readiness probe fails, or that is terminating): a worker that is not
ready gets no new requests, as one marked down, but keeps its index entries
as they are and its poller: its cache is intact, and the pod usually comes
back (or goes, and is then drained and removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import zmq

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.outlier import OutlierDetector, OutlierPolicy, Transition
from prefixrouter.core.types import WorkerId, WorkerView
from prefixrouter.errors import exception_text
from prefixrouter.gateway.config import GatewayConfig, WorkerConfig, engine_key
from prefixrouter.gateway.metrics import WorkerGauges
from prefixrouter.gateway.upstream import Endpoint
from prefixrouter.prometheus import samples
from prefixrouter.real_engines.kv_events import NamespaceSeed, endpoint_key
from prefixrouter.real_engines.kv_subscriber import KvEventSubscriber, WorkerFeed
from prefixrouter.sim.profiles import get_profile

log = logging.getLogger("prefixrouter.gateway")

CLIENT_GONE = 499
"""The status of an attempt whose client left (nginx's): no verdict on the worker."""

GONE_MODELS_KEPT = 1024
"""How many model and adapter names of removed workers, or that a worker stopped
listing, stay known (the newest)."""

REDISCOVER_MIN_S = 1.0
"""A 404 for a listed model asks for a new listing only if the last is older than
this: an engine that lists a model yet refuses it costs a listing a second, not
one per request."""

MODEL_CARD_FIELDS = ("root", "parent", "max_model_len")
"""vLLM's model-card fields kept from a worker's listing for ``GET /v1/models``."""

# Engine kind -> (running, waiting, KV usage 0-1) metric sample names.
ENGINE_METRICS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        ("vllm:num_requests_running",),
        ("vllm:num_requests_waiting",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",), ("sglang:token_usage",)),
    "llamacpp": (
        ("llamacpp:requests_processing",),
        ("llamacpp:requests_deferred",),
        ("llamacpp:kv_cache_usage_ratio",),
    ),
    "openai": ((), (), ()),
}
CACHE_INFO = ("vllm:cache_config_info",)


@dataclass(slots=True)
class EngineStats:
    """The engine's own figures from its last metrics poll."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    start_time: float | None = None
    """``process_start_time_seconds``: changes when the engine restarts."""
    scraped_at: float | None = None

    def restarted_since(self, before: EngineStats) -> bool:
        """Whether these figures come from a newer engine process than ``before``'s.

        A restart shows as a changed process start time or as a counter that
        went backwards (a new process counts from 0).
        """
        t0, t1 = before.start_time, self.start_time
        if t0 is not None and t1 is not None and abs(t1 - t0) > 1e-3:
            return True
        old, new = before.prefix_queries, self.prefix_queries
        return old is not None and new is not None and new < old


def parse_engine_metrics(text: str, kind: str) -> EngineStats:
    """The figures the router uses from a Prometheus text page (summed over engines).

    The page is read by :func:`prefixrouter.prometheus.samples`, the project's one parser.
    """
    running_names, waiting_names, usage_names = ENGINE_METRICS.get(kind, ENGINE_METRICS["vllm"])
    stats = EngineStats()
    usage: list[float] = []
    for s in samples(text):
        name = s.name
        if name in running_names:
            stats.running += s.value
        elif name in waiting_names:
            stats.waiting += s.value
        elif name in usage_names:
            usage.append(s.value)
        elif name in CACHE_INFO:
            bs, nb = s.labels.get("block_size"), s.labels.get("num_gpu_blocks")
            if bs and bs.isdigit():
                stats.block_size = int(bs)
            if nb and nb.isdigit():
                stats.num_blocks = (stats.num_blocks or 0) + int(nb)
        elif name == "vllm:prefix_cache_queries_total":
            stats.prefix_queries = (stats.prefix_queries or 0.0) + s.value
        elif name == "vllm:prefix_cache_hits_total":
            stats.prefix_hits = (stats.prefix_hits or 0.0) + s.value
        elif name == "process_start_time_seconds":
            stats.start_time = max(stats.start_time or 0.0, s.value)
    if usage:
        stats.kv_usage = max(0.0, min(1.0, sum(usage) / len(usage)))
    return stats


@dataclass(eq=False, slots=True)
class Worker:
    """One upstream engine and the gateway's picture of it."""

    config: WorkerConfig
    view: WorkerView
    headers: dict[str, str]
    endpoint: Endpoint
    healthy: bool = True
    suspect: bool = False
    suspect_since: float = 0.0
    draining: bool = False
    removed: bool = False
    ready: bool = True
    """Kubernetes readiness (discovered workers): not ready = no new requests."""
    ejected: bool = False
    """Out of routing for failing answers (outlier ejection, module docstring)."""
    ejections: int = 0
    restarts: int = 0
    feed_restarts: int = 0
    """The KV-event feed's restart count at the last metrics scrape."""
    failures: int = 0
    reached: bool = False
    """A health check has passed at least once (:meth:`WorkerRegistry.serves`)."""
    backoff_s: float = 0.0
    last_error: str | None = None
    models: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()
    discovered: bool = False
    """Its model list is current: False makes the next passed check list it again."""
    models_at: float = -math.inf
    """When its models were last listed (the registry's clock)."""
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per listed name, the card fields it reported (:data:`MODEL_CARD_FIELDS`)."""
    engine: EngineStats = field(default_factory=EngineStats)
    foreign: int = 0
    task: asyncio.Task[None] | None = None
    drain: asyncio.Task[dict[str, Any]] | None = None
    """Its drain and removal, once a ``DELETE`` started it (every caller awaits this one)."""
    feed: WorkerFeed | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to make the poller check now (a suspect worker)."""

    @property
    def id(self) -> WorkerId:
        """The worker id."""
        return self.view.worker_id

    @property
    def url(self) -> str:
        """Base URL (no trailing slash, no ``/v1``)."""
        return self.config.url

    @property
    def routable(self) -> bool:
        """Takes new requests: health checks pass, not suspect, not draining, ready, not
        ejected (``prefixrouter_worker_healthy``, the dashboard's ``healthy``)."""
        return (
            self.healthy
            and not self.suspect
            and not self.draining
            and self.ready
            and not self.ejected
        )

    @property
    def kv_size_known(self) -> bool:
        """The engine's KV size is known (configured or polled): the index mirrors it,
        else it keeps its default capacity, a placeholder."""
        return self.config.kv_capacity_blocks is not None or bool(self.engine.num_blocks)

    def to_dict(self, in_flight: int, index_blocks: int | None = None) -> dict[str, Any]:
        """A JSON-ready state record for ``/admin/workers``.

        Args:
            in_flight: The gateway's requests running on it.
            index_blocks: Blocks the router's index holds for it.
        """
        e = self.engine
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.config.kind,
            "pool": self.config.pool,
            "healthy": self.healthy,
            "suspect": self.suspect,
            "ready": self.ready,
            "ejected": self.ejected,
            "ejections": self.ejections,
            "restarts": self.restarts,
            "draining": self.draining,
            "models": sorted(self.models),
            "adapters": sorted(self.adapters),
            "in_flight": in_flight,
            "index_blocks": index_blocks,
            "failures": self.failures,
            "last_error": self.last_error,
            "engine": {
                "running": e.running,
                "waiting": e.waiting,
                "kv_usage": e.kv_usage,
                "block_size": e.block_size,
                "num_blocks": e.num_blocks,
                "prefix_cache_hit_rate": (
                    e.prefix_hits / e.prefix_queries
                    if e.prefix_queries and e.prefix_hits is not None
                    else None
                ),
            },
            "view": {
                "kv_capacity_blocks": self.view.kv_capacity_blocks,
                "kv_used_blocks": self.view.kv_used_blocks,
                "block_size": self.view.block_size,
                "max_slots": self.view.max_slots,
            },
            "kv_events": (
                {
                    **self.feed.stats.to_dict(self.feed.translator),
                    "connect": self.feed.publisher,  # None: the engine connects to us
                }
                if self.feed is not None
                else None
            ),
        }


def _card_fields(item: dict[str, Any]) -> dict[str, Any]:
    """The :data:`MODEL_CARD_FIELDS` of one ``/v1/models`` entry that have their
    type (``root`` a string; ``parent`` a string or null, vLLM's null for a base
    model; ``max_model_len`` a positive integer)."""
    out: dict[str, Any] = {}
    root = item.get("root")
    if isinstance(root, str):
        out["root"] = root
    if "parent" in item and isinstance(item["parent"], str | None):
        out["parent"] = item["parent"]
    mml = item.get("max_model_len")
    if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0:
        out["max_model_len"] = mml
    return out


def _may_serve_any(w: Worker) -> bool:
    """Whether ``w`` makes every model name known (:meth:`WorkerRegistry.serves`).

    Its model list is unknown, and it is healthy and was reached once or
    not checked yet (``failures`` counts checks since the last one passed).
    """
    if w.models or w.adapters or not w.healthy:
        return False
    return w.reached or w.failures == 0


class WorkerRegistry:
    """Every worker, their health pollers and the views the router reads.

    Args:
        config: The gateway configuration (health, poll and proxy settings).
        dispatch: The routing core (in-flight figures and drain progress,
            capacity mirror, workers down, restarted and removed).
        clock: The gateway's monotonic clock.
    """

    def __init__(
        self,
        config: GatewayConfig,
        dispatch: Dispatcher,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.dispatch = dispatch
        self.clock = clock
        self.workers: dict[WorkerId, Worker] = {}
        self._routable: list[Worker] = []
        self._views: list[WorkerView] = []
        self._models: frozenset[str] = frozenset()
        self._adapters: frozenset[str] = frozenset()
        self._known: frozenset[str] = frozenset()
        self._gone: dict[str, None] = {}
        """Names of removed workers' models and adapters, oldest first (GONE_MODELS_KEPT)."""
        self._serves_any = True  # until the first worker: any name may be served (serves)
        self._cache_models: dict[str, str] = {}  # alias -> its class's name (cache_model)
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=config.health.timeout_s)
        self._poll_timeout = aiohttp.ClientTimeout(total=config.metrics_poll.timeout_s)
        self.events: KvEventSubscriber | None = None
        self._seed_for: Callable[[Worker], NamespaceSeed] | None = None
        o = config.outlier
        policy = OutlierPolicy(
            o.consecutive_failures, o.base_ejection_s, o.max_ejection_s, o.max_ejected_share
        )
        self.outliers = OutlierDetector(policy) if o.enabled else None
        self.on_check: Callable[[Worker, bool], None] | None = None
        """Told of each health check's result: the proxy's upstream timeouts
        cut only requests of a worker silent on every channel (see
        :mod:`prefixrouter.gateway.upstream`)."""
        for wc in config.workers:
            self._add(wc)

    def attach_events(
        self, events: KvEventSubscriber, seed_for: Callable[[Worker], NamespaceSeed]
    ) -> None:
        """Feed every worker's KV events (present and future) through ``events``.

        Args:
            events: The gateway's subscriber.
            seed_for: The namespace seed function of a worker's event chains.
        """
        self.events, self._seed_for = events, seed_for
        for w in self.workers.values():
            self._listen(w)

    def _listen(self, w: Worker) -> None:
        if self.events is None or self._seed_for is None:
            return
        topic = w.config.kv_events_topic
        assert topic is not None  # WorkerConfig fills in the worker id
        try:
            w.feed = self.events.add_worker(
                w.id,
                topic,
                self._seed_for(w),
                w.config.kv_replay_endpoint,
                self.config.kv_events.max_blocks_per_worker,
                w.config.kv_events_connect,
            )
        except zmq.ZMQError as exc:
            raise ValueError(f"kv_events_connect: cannot connect: {exc}") from None

    # ------------------------------------------------------------- membership

    def topic_owner(self, topic: str) -> WorkerId | None:
        """The worker whose KV events come on ``topic``, if any.

        Topics are unique, as in the configuration, whether or not KV events
        are on. A removed worker's feed holds its topic until its poller has
        stopped, so the subscriber's feeds are asked too.
        """
        for w in self.workers.values():
            if w.config.kv_events_topic == topic:
                return w.id
        if self.events is not None:
            for feed in self.events.feeds():
                if feed.topic == topic:
                    return feed.worker_id
        return None

    def publisher_owner(self, publisher: str) -> WorkerId | None:
        """The worker whose engine's KV-event publisher is ``publisher``, if any (two
        spellings of one socket are one publisher: :func:`endpoint_key`)."""
        key = endpoint_key(publisher)
        for w in self.workers.values():
            if w.config.kv_events_connect and endpoint_key(w.config.kv_events_connect) == key:
                return w.id
        if self.events is not None:
            for feed in self.events.feeds():
                if feed.publisher and endpoint_key(feed.publisher) == key:
                    return feed.worker_id
        return None

    def engine_owner(self, url: str) -> WorkerId | None:
        """The worker whose URL reaches the same engine as ``url`` (:func:`.config.engine_key`)."""
        key = engine_key(url)
        for w in self.workers.values():
            if engine_key(w.config.url) == key:
                return w.id
        return None

    def _add(self, wc: WorkerConfig, ready: bool = True) -> Worker:
        if WorkerId(wc.id) in self.workers:
            raise KeyError(wc.id)
        topic = wc.kv_events_topic
        if topic is not None and (owner := self.topic_owner(topic)) is not None:
            raise KeyError(f"kv_events_topic {topic!r} is used by worker {owner!r}")
        publisher = wc.kv_events_connect
        if publisher is not None and (owner := self.publisher_owner(publisher)) is not None:
            raise KeyError(f"kv_events_connect {publisher!r} is used by worker {owner!r}")
        view = WorkerView(
            worker_id=WorkerId(wc.id),
            pool=wc.pool,
            models=frozenset(wc.models),
            adapters=frozenset(wc.adapters),
            tenants=frozenset(wc.tenants) if wc.tenants is not None else None,
            max_slots=wc.max_slots,
            block_size=wc.block_size or self.config.routing.block_size or 16,
        )
        if wc.kv_capacity_blocks is not None:
            view.kv_capacity_blocks = wc.kv_capacity_blocks
        profile = wc.profile or self.config.policy.profile
        if profile:  # else the generic SpeedProfile (config.PolicyConfig.profile)
            view.profile = get_profile(profile).speed
        headers = {"Authorization": f"Bearer {wc.api_key}"} if wc.api_key else {}
        w = Worker(
            config=wc,
            view=view,
            headers=headers,
            endpoint=Endpoint.from_url(wc.url, headers),
            models=frozenset(wc.models),
            adapters=frozenset(wc.adapters),
            discovered=bool(wc.models),
            backoff_s=self.config.health.backoff_initial_s,
            ready=ready,
        )
        self._listen(w)  # before joining: a refused topic leaves the registry unchanged
        self.workers[w.id] = w
        self._mirror_capacity(w)
        self._rebuild()
        return w

    async def add(self, wc: WorkerConfig, ready: bool = True) -> Worker:
        """Add a worker, check it once and start its poller.

        ``ready=False`` adds it out of routing until :meth:`set_ready` (a pod
        that is not ready yet).

        Raises:
            KeyError: A worker with that id exists, or its ``kv_events_topic``
                or ``kv_events_connect`` is another worker's (the registry is
                then unchanged).
            ValueError: Its ``kv_events_connect`` cannot be connected to.
        """
        w = self._add(wc, ready)
        await self.check(w)
        self._start(w)
        return w

    def set_ready(self, worker_id: WorkerId, ready: bool) -> None:
        """Let a worker take new requests or not (module docstring, readiness).

        Raises:
            KeyError: No such worker.
        """
        w = self.workers[worker_id]
        if w.ready != ready:
            w.ready = ready
            log.info("worker %s %s", w.id, "ready" if ready else "not ready: out of routing")
            self._rebuild()

    async def drain_and_remove(self, worker_id: WorkerId, timeout_s: float) -> dict[str, Any]:
        """Stop routing to a worker, wait for its requests, then forget it.

        A worker is drained once. A call for a worker already draining joins
        the drain under way: it waits for the same removal and returns the
        same result (the first call's timeout holds; its own is not used).
        Joining rather than refusing (409), because ``DELETE`` is idempotent:
        a client that lost the first answer retries it, and endpoint discovery
        and the admin API may both remove one pod's worker; each learns when
        the worker is gone and how its drain went. The drain runs as a task of
        its own, so a caller that leaves (the gateway cancels the handler of a
        client that disconnects) neither abandons it halfway, which would
        leave the worker draining for ever, nor cuts it short for the others.

        Returns:
            ``{"id", "removed": True, "drained": bool, "in_flight_left": int, "waited_s"}``.

        Raises:
            KeyError: No such worker.
        """
        w = self.workers[worker_id]
        if w.drain is None:
            w.draining = True
            self._rebuild()
            loop = asyncio.get_running_loop()
            w.drain = loop.create_task(self._drain(w, timeout_s), name=f"drain-{w.id}")
        return dict(await asyncio.shield(w.drain))

    async def _drain(self, w: Worker, timeout_s: float) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for ``w``'s requests to finish, then remove it."""
        start = self.clock()
        deadline = start + timeout_s
        # The ledger's figures are read afresh each time (never a load object
        # kept from before), and the wait ends once the worker is removed.
        while not w.removed and self.clock() < deadline:
            if self.dispatch.load(w.id).in_flight == 0:
                break
            await asyncio.sleep(0.02)
        left = 0 if w.removed else self.dispatch.load(w.id).in_flight
        await self._remove(w)
        return {
            "id": w.id,
            "removed": True,
            "drained": left == 0,
            "in_flight_left": left,
            "waited_s": round(self.clock() - start, 3),
        }

    async def _remove(self, w: Worker) -> None:
        """Forget ``w``, this very object: never a worker added since under the same id.

        Its poller is cancelled, and what is kept under its id (the
        dispatcher's index, ledger and calibration, the outlier state, the
        KV-event feed) is forgotten only while ``w`` holds the id, all before
        the first wait: once the id is free, a worker added under it owns
        what is kept under it. Its models and adapters are remembered
        (:meth:`serves`).
        """
        if w.removed:
            return
        w.removed = True
        task, w.task = w.task, None
        if task is not None:
            task.cancel()  # it runs no more of its code: nothing it does lands on the id
        if self.workers.get(w.id) is w:
            del self.workers[w.id]
            self.dispatch.remove_worker(w.id)
            if self.outliers is not None:
                self.outliers.forget(w.id)
            if self.events is not None:
                self.events.remove_worker(w.id)
        self._remember_gone(w.models | w.adapters)
        self._rebuild()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _remember_gone(self, names: frozenset[str]) -> None:
        """Keep ``names`` known (:meth:`serves`) after a worker stopped serving them.

        A removed worker's names, and those a worker stopped listing: while
        no worker lists one, its requests get 503 (an outage), not 404. The
        newest :data:`GONE_MODELS_KEPT` are kept.
        """
        gone = self._gone
        for name in names:
            gone.pop(name, None)  # to the newest end
            gone[name] = None
        while len(gone) > GONE_MODELS_KEPT:
            del gone[next(iter(gone))]

    # ------------------------------------------------------------- routing reads

    def _rebuild(self) -> None:
        self._routable = [w for w in self.workers.values() if not w.draining]
        self._views = [w.view for w in self._routable]
        for w in self._routable:
            w.view.healthy = w.routable
        live = self._routable
        self._models = frozenset().union(*(w.models for w in live)) if live else frozenset()
        self._adapters = frozenset().union(*(w.adapters for w in live)) if live else frozenset()
        # Known names (serves): every registered worker's, draining or down
        # included, and those of removed workers.
        every = self.workers.values()
        self._known = frozenset(self._gone).union(*(w.models | w.adapters for w in every))
        self._serves_any = any(_may_serve_any(w) for w in every)
        self._cache_models = alias_classes(s for w in every for s in _same_root(w))

    def cache_model(self, name: str) -> str:
        """The name a model's cache namespace goes by: one for all its aliases.

        vLLM's ``--served-model-name a b`` serves one base model under
        several names, and its prefix cache does not know which name a
        request used: ``a`` and ``b`` requests share every block. Its listing
        gives each name the same ``root`` (the model's path), so the
        base-model names one worker lists with one ``root`` are aliases of one
        model (:func:`_same_root`; a server that lists several models without
        roots, Ollama's, keeps them apart), and the names of each such class
        (joined across workers that list a name in common) hash in one
        namespace, the class's first name in sorted order (the one a worker's
        KV events are put in, ``state._event_namespace``). Adapters keep their
        own names: an adapter's blocks are its own.
        """
        return self._cache_models.get(name, name)

    def views(self) -> list[WorkerView]:
        """The routable workers' views with fresh in-flight figures (not draining)."""
        now = self.clock()  # once: this runs on every request
        det = self.outliers
        if det is not None and det.next_release <= now:
            self._returned(det.release(now))
        fill = self.dispatch.fill
        for w in self._routable:
            fill(w.view, now)
            if w.foreign:
                w.view.in_flight += w.foreign
        return self._views

    def serves(self, model: str) -> bool:
        """Whether ``model`` (a model or adapter name) is known: else a request for it is a 404.

        A known model's request is routed, and gets 503 with ``Retry-After``
        when no worker can take it now. The rule:

        * A name a registered worker lists is known, whether that worker is
          healthy, down or draining; so is one that a removed worker listed
          (the newest :data:`GONE_MODELS_KEPT` names, for the gateway's
          lifetime). Draining or removing a model's last worker, or losing
          every worker, is an outage, not a model that never existed: OpenAI
          SDKs retry a 503 but not a 404 (``NotFoundError``).
        * Any name is known while a worker *may serve any model*: one whose
          model list is unknown (it has not listed its models yet, or does
          not list them) and that is healthy or not checked yet. A worker
          never reached stops counting at its first failed health check, and
          one that went down stops counting until it is back: a dead worker
          must not turn every mistyped name into a 503 that clients retry for
          ever. (A server that does not list its models should have them
          configured, ``models:``: while it is down, its model is unknown.)
        * Any other name was never served here: 404 ``model_not_found``.
          Until the first worker is registered (a gateway whose workers all
          come from discovery or the admin API), every name is known: nothing
          says yet which will be served.

        O(1): the sets are rebuilt when membership, health or a model list changes.
        """
        return self._serves_any or model in self._known

    def models(self) -> list[str]:
        """The union of the workers' models and adapters, sorted."""
        return sorted(self._models | self._adapters)

    def adapters(self) -> frozenset[str]:
        """Adapter names any worker serves."""
        return self._adapters

    def gauges(self) -> list[WorkerGauges]:
        """Scrape-time figures per worker."""
        return [
            WorkerGauges(
                w.id,
                w.routable,
                self.dispatch.load(w.id).in_flight,
                w.engine.kv_usage,
                w.engine.waiting,
                w.ejected,
                w.ejections,
                self.dispatch.speed_scale(w.id),
                w.draining,
            )
            for w in self.workers.values()
        ]

    def observe(
        self, w: Worker, status: int, *, unreachable: bool = False, suspect: bool = False
    ) -> None:
        """One answer of ``w`` for outlier ejection (module docstring).

        Args:
            w: The worker.
            status: The attempt's status (the gateway's: 502 for a malformed
                or cut answer, 499 for a client that left).
            unreachable: The worker could not be reached (connect error,
                closed before any byte).
            suspect: A first-byte or stall timeout: the suspect mark decides.
        """
        det = self.outliers
        if det is None or w.removed or suspect or status == CLIENT_GONE:
            return
        now = self.clock()
        if not unreachable and not 500 <= status < 600:
            if status != 429:  # an overload refusal says nothing about the engine's health
                det.success(w.id, now)
            return
        if status == 504 and not unreachable:
            return  # a timeout: the suspect mark's business
        fleet = [x for x in self.workers.values() if not x.draining]
        others = sum(1 for x in fleet if x is not w and x.view.healthy)
        t = det.failure(w.id, now, len(fleet), others)
        if t is None:
            return
        w.ejected, w.ejections = True, det.ejections(w.id)
        log.warning(
            "worker %s ejected for %.1f s (ejection %d, %d failures in a row, last: %s)",
            w.id, t.until - now, t.ejections, t.failures,
            "unreachable" if unreachable else status,
        )  # fmt: skip
        self._rebuild()

    def _returned(self, back: list[Transition]) -> None:
        for t in back:
            w = self.workers.get(t.worker_id)
            if w is None:
                continue
            w.ejected = False
            # Out of routing for the ejection: its calibration is as old, and
            # probation needs requests to reach it.
            self.dispatch.worker_up(w.id)
            log.info("worker %s back from ejection %d, on probation", w.id, t.ejections)
        if back:
            self._rebuild()

    def mark_failed(self, w: Worker, error: str) -> None:
        """A request could not reach ``w``: take it out of routing until a check passes."""
        if w.removed:
            return  # its id may be another worker's by now
        w.last_error = error
        w.failures += 1
        w.backoff_s = self._backoff(w.failures)
        if w.healthy:
            log.warning("worker %s unreachable (%s): out of routing", w.id, error)
            self._went_down(w)

    def mark_suspect(self, w: Worker, error: str) -> None:
        """``w`` went silent on a request: out of routing until a check passes, checked now.

        Not a failure by itself: the check decides (see the module docstring).
        """
        if w.removed or w.suspect or not w.healthy:
            return
        w.suspect, w.suspect_since = True, self.clock()
        w.last_error = error
        log.warning("worker %s suspect (%s): out of routing until a check passes", w.id, error)
        self._rebuild()
        w.wake.set()

    def _went_down(self, w: Worker) -> None:
        """Take ``w`` out of routing; keep its cache picture, demoted to speculative.

        The KV-event sequence and hash map are kept as well, so that a
        restarted engine's feed shows as a sequence reset (which clears the
        worker) and an engine that only paused goes on where it left off.
        """
        w.healthy = False
        demoted = self.dispatch.worker_down(w.id, self.clock())
        log.info("worker %s down: %d index entries kept as speculative", w.id, demoted)
        self._rebuild()

    def _restarted(self, w: Worker) -> None:
        """The engine is a new process with an empty cache: forget its entries and feed state.

        Unless its KV-event feed saw the restart first (a sequence reset since
        the last scrape): the feed cleared the entries then, and what the new
        process published since is right, so it is kept. Its calibration
        restarts from the fleet's best in both cases.
        """
        w.restarts += 1
        det = self.outliers
        if det is not None and det.restarted(w.id, self.clock()):
            # The failures that ejected it were the old process's (OutlierDetector.restarted).
            w.ejected = False
            log.info("worker %s restarted: its ejection ends", w.id)
            self._rebuild()
        if w.feed is not None and w.feed.stats.restarts > w.feed_restarts:
            log.warning("worker %s restarted (its KV events said so first)", w.id)
            self.dispatch.worker_restarted(w.id, self.clock(), clear_entries=False)
            return
        log.warning("worker %s restarted: its index entries are cleared", w.id)
        self.dispatch.worker_restarted(w.id, self.clock())
        if self.events is not None:
            self.events.forget_engine(w.id)

    # ------------------------------------------------------------- polling

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Check every worker once (concurrently), then start the pollers."""
        self._session = session
        workers = list(self.workers.values())
        await asyncio.gather(*(self.check(w) for w in workers))
        for w in workers:
            self._start(w)

    async def stop(self) -> None:
        """Stop every poller and every drain under way (the gateway is closing)."""
        tasks = [t for w in self.workers.values() for t in (w.drain, w.task) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def _start(self, w: Worker) -> None:
        if self._session is not None and w.task is None and not w.removed:
            w.task = asyncio.get_running_loop().create_task(self._poll(w), name=f"poll-{w.id}")

    async def _poll(self, w: Worker) -> None:
        interval = self.config.metrics_poll.interval_s
        while not w.removed:
            if not w.wake.is_set():
                delay = interval if w.healthy and not w.suspect else w.backoff_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await w.wake.wait()
            w.wake.clear()
            try:
                await self.check(w)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let a poller die
                log.exception("poll of %s failed: %s", w.id, exc)

    def _backoff(self, failures: int) -> float:
        h = self.config.health
        return float(
            min(h.backoff_max_s, h.backoff_initial_s * h.backoff_factor ** max(0, failures - 1))
        )

    async def check(self, w: Worker) -> bool:
        """One health check (+ model discovery and metrics when healthy)."""
        session = self._session
        if session is None or w.removed:
            return w.healthy
        started = self.clock()
        ok, error = await self._get_ok(session, w, w.config.health_path or "/health")
        if w.removed:
            return False  # removed while its check was out (the first one, from add)
        if not ok:
            if self.on_check is not None:
                self.on_check(w, False)
            w.failures += 1
            w.last_error = error
            w.backoff_s = self._backoff(w.failures)
            if w.healthy and w.failures >= self.config.health.unhealthy_after:
                log.warning("worker %s unhealthy (%s)", w.id, error)
                self._went_down(w)
            elif w.failures == 1 and not w.reached:
                self._rebuild()  # never reached: it no longer makes every model known (serves)
            return False
        first_contact, w.reached = not w.reached, True
        w.failures = 0
        w.backoff_s = self.config.health.backoff_initial_s
        if self.on_check is not None:
            self.on_check(w, True)
        outage_error = w.last_error
        restarts = w.restarts
        if w.config.metrics_path:
            await self._scrape(session, w)
        if w.removed:
            return False
        if w.restarts != restarts or not w.healthy:
            # A new process, or back from an outage (a restart without
            # /metrics): it may serve other models or adapters now.
            w.discovered = False
        if self._models_due(w):
            await self._discover(session, w)
            if w.removed:
                return False
        # A check sent before the worker went silent does not clear it: the
        # check the mark asked for (next) decides.
        if not w.healthy or (w.suspect and w.suspect_since <= started):
            if not w.healthy:
                # Back from an outage: its calibration is as old as the outage
                # (a suspect one that passed at once was out for milliseconds).
                self.dispatch.worker_up(w.id)
            w.healthy, w.suspect = True, False
            if w.last_error is outage_error:  # not one this check's scrape just set
                w.last_error = None  # the outage's error, shown beside "healthy", misled
            log.info("worker %s healthy again", w.id)
            self._rebuild()
        elif first_contact:
            self._rebuild()  # one that failed its first checks may serve any model now (serves)
        return True

    async def _get_ok(
        self, session: aiohttp.ClientSession, w: Worker, path: str
    ) -> tuple[bool, str]:
        try:
            async with session.get(w.url + path, headers=w.headers, timeout=self._timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return True, ""
                return False, f"{path} answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return False, f"{path}: {exception_text(exc)}"

    def _models_due(self, w: Worker) -> bool:
        """Whether ``w``'s models are to be listed now (module docstring, step 2)."""
        if w.config.models:
            return False  # configured: never listed
        if not w.discovered:
            return True
        return self.clock() - w.models_at >= self.config.metrics_poll.models_interval_s

    def rediscover(self, w: Worker) -> None:
        """``w`` answered 404 for a model it listed: list its models again, now.

        Its poller checks it at once (health, metrics, models). At most once
        per :data:`REDISCOVER_MIN_S`: an engine that lists a model and refuses
        it anyway must not be listed once per request.
        """
        if w.removed or w.config.models or not w.discovered:
            return  # gone, configured, or a listing is already due
        if self.clock() - w.models_at < REDISCOVER_MIN_S:
            return
        log.info("worker %s refused a model it listed: listing its models again", w.id)
        w.discovered = False
        w.wake.set()

    async def _discover(self, session: aiohttp.ClientSession, w: Worker) -> None:
        try:
            async with session.get(
                w.url + "/v1/models", headers=w.headers, timeout=self._poll_timeout
            ) as resp:
                if resp.status != 200:
                    return
                data = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError):
            return  # the last list stands; the next check tries again
        if w.removed:
            return
        models: set[str] = set()
        adapters: set[str] = set()
        cards: dict[str, dict[str, Any]] = {}
        for item in data.get("data", []) if isinstance(data, dict) else []:
            if not isinstance(item, dict) or not isinstance(item.get("id"), str):
                continue
            name = item["id"]
            parent = item.get("parent")
            if isinstance(parent, str) and parent and parent != name:
                adapters.add(name)
            else:
                models.add(name)
            card = _card_fields(item)
            if card:
                cards[name] = card
        old = w.models | w.adapters
        w.models = frozenset(models) | frozenset(w.config.models)
        w.adapters = frozenset(adapters) | frozenset(w.config.adapters)
        w.view.models = w.models
        w.view.adapters = w.adapters
        w.model_cards = cards
        w.discovered, w.models_at = True, self.clock()
        dropped = old - (w.models | w.adapters)
        if dropped:
            log.info("worker %s no longer lists %s", w.id, ", ".join(sorted(dropped)))
            self._remember_gone(dropped)
        self._rebuild()

    def model_card(self, name: str) -> dict[str, Any]:
        """The card fields the workers reported for ``name`` (``GET /v1/models``).

        ``root`` and ``parent`` as the first worker (by id) that reported them
        says; ``max_model_len`` the smallest any reported, so that a client
        sizing its context from it fits on every worker it may be routed to.
        """
        out: dict[str, Any] = {}
        for wid in sorted(self.workers):
            card = self.workers[wid].model_cards.get(name)
            if not card:
                continue
            for key, value in card.items():
                if key == "max_model_len" and "max_model_len" in out:
                    out[key] = min(out[key], value)
                else:
                    out.setdefault(key, value)
        return out

    async def _scrape(self, session: aiohttp.ClientSession, w: Worker) -> None:
        try:
            async with session.get(
                w.url + (w.config.metrics_path or "/metrics"),
                headers=w.headers,
                timeout=self._poll_timeout,
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
            stats = parse_engine_metrics(text, w.config.kind)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            w.last_error = f"metrics: {exception_text(exc)}"
            return
        if w.removed:
            return  # what is kept under its id may be another worker's by now
        stats.scraped_at = self.clock()
        if stats.restarted_since(w.engine):
            self._restarted(w)
        if w.feed is not None:
            w.feed_restarts = w.feed.stats.restarts
        w.engine = stats
        self._apply_stats(w, stats)

    def _apply_stats(self, w: Worker, stats: EngineStats) -> None:
        view, wc = w.view, w.config
        if wc.block_size is None and stats.block_size:
            view.block_size = stats.block_size
        if wc.kv_capacity_blocks is None and stats.num_blocks:
            view.kv_capacity_blocks = stats.num_blocks
        view.kv_used_blocks = round(stats.kv_usage * view.kv_capacity_blocks)
        ours = self.dispatch.load(w.id).in_flight
        w.foreign = max(0, round(stats.running + stats.waiting) - ours)
        self._align_token_blocks(view.block_size)
        self._mirror_capacity(w)

    def _align_token_blocks(self, engine_block_size: int) -> None:
        # Token mode without a configured block size follows the engines', so
        # the router's block boundaries are the engine's.
        r = self.config.routing
        if r.mode == "token" and r.block_size is None:
            self.dispatch.set_block_size(engine_block_size)

    def _mirror_capacity(self, w: Worker) -> None:
        """Mirror the KV room for cached prefixes in the index (once the KV size is known).

        The ledger's figures are filled in first, so the formula
        (:func:`~prefixrouter.core.dispatch.prefix_room_blocks`) sees the
        requests in flight as they are now, beside the engine's last poll.
        """
        if not w.kv_size_known:
            return  # capacity unknown: keep the index default
        self.dispatch.mirror_capacity((self.dispatch.fill(w.view, self.clock()),))


def _same_root(w: Worker) -> Iterator[frozenset[str]]:
    """The base-model names ``w`` listed, grouped by the ``root`` each reported
    (names without one are not grouped): one group per model it serves."""
    by_root: dict[str, set[str]] = {}
    for name in w.models - w.adapters:
        root = w.model_cards.get(name, {}).get("root")
        if isinstance(root, str) and root:
            by_root.setdefault(root, set()).add(name)
    return (frozenset(names) for names in by_root.values())


def alias_classes(name_sets: Iterable[frozenset[str]]) -> dict[str, str]:
    """Each name of the sets -> the first name (sorted) of its class, where names
    that share a set are one class and classes that share a name are joined
    (:meth:`WorkerRegistry.cache_model`)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for names in name_sets:
        first = None
        for name in names:
            parent.setdefault(name, name)
            if first is None:
                first = root(name)
                continue
            a, b = root(name), first
            if a != b:
                low, high = (a, b) if a < b else (b, a)
                parent[high] = low
                first = low
    return {name: root(name) for name in parent}
