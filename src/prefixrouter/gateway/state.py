"""Everything one gateway process holds, built from a configuration.

One :class:`GatewayState` per application: the routing core (a
:class:`~prefixrouter.core.dispatch.Dispatcher` over the router and the
in-flight ledger, the only way the gateway changes routing state), the worker
registry, the metrics, the decision log, the
request builder, the tenancy rules, for a replica of a cluster, its
:class:`~prefixrouter.cluster.node.ClusterNode`, and with Kubernetes endpoint
discovery its :class:`~prefixrouter.gateway.discovery_link.DiscoveryLink`. Handlers reach it through
``app[STATE]``; nothing is global, so tests can run several gateways in one
process.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from prefixrouter.cluster.node import ClusterNode
from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.hashing import BlockHasher, TokenEstimator
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router, replica_salt
from prefixrouter.core.types import WorkerId
from prefixrouter.discovery.kubernetes import DiscoveryCollector
from prefixrouter.errors import ConfigError, unreadable
from prefixrouter.gateway.access_log import AccessLog, RequestNote
from prefixrouter.gateway.cluster_link import build_node, replica_id
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.gateway.controls import TenantControls
from prefixrouter.gateway.decision_log import DecisionLog
from prefixrouter.gateway.discovery_link import DiscoveryLink
from prefixrouter.gateway.fleet import FleetControls
from prefixrouter.gateway.metrics import GatewayMetrics
from prefixrouter.gateway.request_builder import ChatTokenizer, RequestBuilder
from prefixrouter.gateway.tenancy import Tenancy
from prefixrouter.gateway.token_count import TokenCounter
from prefixrouter.gateway.upstream import UpstreamClient
from prefixrouter.gateway.warm_up import WarmUpSender
from prefixrouter.gateway.workers import Worker, WorkerRegistry
from prefixrouter.prompt.lint import LintObserver
from prefixrouter.real_engines.kv_events import NamespaceSeed
from prefixrouter.real_engines.kv_subscriber import KvEventCollector, KvEventSubscriber
from prefixrouter.stats import nearest_rank

LAST_SERVED_MAX = 65_536

log = logging.getLogger("prefixrouter.gateway")


@dataclass(eq=False)
class GatewayState:
    """The live state of one gateway (see the module docstring)."""

    config: GatewayConfig
    dispatch: Dispatcher
    registry: WorkerRegistry
    metrics: GatewayMetrics
    decisions: DecisionLog
    builder: RequestBuilder
    tenancy: Tenancy
    fleet: FleetControls
    controls: TenantControls
    lint: LintObserver | None = None
    access: AccessLog | None = None
    events: KvEventSubscriber | None = None
    cluster: ClusterNode | None = None
    discovery: DiscoveryLink | None = None
    session: aiohttp.ClientSession | None = None
    upstream: UpstreamClient | None = None
    counter: TokenCounter | None = None
    warm_ups: WarmUpSender | None = None
    last_served: OrderedDict[tuple[WorkerId, str], float] = field(default_factory=OrderedDict)
    requests_seen: int = 0

    @staticmethod
    def clock() -> float:
        """The gateway's clock: ``time.monotonic`` (seconds).

        Not ``loop.time()``: uvloop's has a resolution of one millisecond and
        is cached per loop iteration, too coarse for time to first token.
        """
        return time.monotonic()

    def request_done(self, note: RequestNote) -> None:
        """A request ended: count it for its tenant, and log it (:mod:`.access_log`)."""
        if note.tenant is not None and note.status is not None:
            self.controls.finished(note.tenant, note.status, note.ttft_s)
        if self.access is not None:
            self.access.record(note)

    def note_served(self, worker: WorkerId, prefix_key: str, now: float) -> float | None:
        """Remember that ``worker`` served ``prefix_key`` now; return the previous time."""
        key = (worker, prefix_key)
        last = self.last_served.pop(key, None)
        self.last_served[key] = now
        if len(self.last_served) > LAST_SERVED_MAX:
            self.last_served.popitem(last=False)
        return last

    def process_stats(self) -> dict[str, float | int]:
        """The process's CPU time and request count (for overhead benchmarks)."""
        t = os.times()
        out: dict[str, float | int] = {
            "pid": os.getpid(),
            "cpu_user_s": t.user,
            "cpu_system_s": t.system,
            "requests": self.requests_seen,
        }
        node = self.cluster
        if node is not None:
            st = node.stats
            lags = sorted(st.lags)
            out.update(st.figures())
            out["cluster_lag_samples"] = len(lags)
            if lags:
                out["cluster_lag_p50_ms"] = nearest_rank(lags, 0.5) * 1000
                out["cluster_lag_p99_ms"] = nearest_rank(lags, 0.99) * 1000
        return out


def _load_tokenizer(config: GatewayConfig) -> ChatTokenizer | None:
    if config.routing.mode != "token":
        return None
    from prefixrouter.tokenization import load_tokenizer

    try:
        tok: ChatTokenizer = load_tokenizer(config.routing.tokenizer)
    except OSError as exc:  # a path that is not there (a placeholder copied from an example)
        where = str(exc.filename or config.routing.tokenizer)
        raise ConfigError(f"routing.tokenizer: {unreadable(where, exc)}") from None
    return tok


def build_state(config: GatewayConfig, tokenizer: ChatTokenizer | None = None) -> GatewayState:
    """Build a gateway's state (no I/O besides loading a tokenizer in token mode)."""
    r = config.routing
    hasher = BlockHasher(
        block_size=r.block_size or 16,
        chunk_chars=r.chunk_chars,
        estimator=TokenEstimator(r.chars_per_token),
        max_prompt_tokens=r.max_prompt_tokens,
    )
    policy = create_policy(config.policy.name, config.policy.params)
    clustered = config.cluster.url is not None
    if not clustered and config.cluster.replica_id:
        log.warning("cluster.replica_id (--replica-id) is set but cluster.url (--cluster) is "
                    "not: this gateway runs alone")  # fmt: skip
    # A replica breaks near-ties by its own salt (see Router's replica_salt): the id it
    # goes by, so replicas left to the default id (HOSTNAME:PORT) draw apart too.
    salt = replica_salt(replica_id(config)) if clustered else 0
    router = Router(policy, hasher, prefix_key_tokens=r.prefix_key_tokens, replica_salt=salt)
    # A replica records what its peers must mirror; a lone gateway keeps no outbox.
    dispatch = Dispatcher(router, r.mode, record_facts=clustered)
    registry = WorkerRegistry(config, dispatch, time.monotonic)
    metrics = GatewayMetrics(config.metrics.warm_fraction)
    metrics.attach_live(registry.gauges, lambda: dispatch.evicted_entries)
    dl = config.decision_log
    decisions = DecisionLog(dl.path, dl.ring_size, dl.flush_interval_s)
    tok = tokenizer if tokenizer is not None else _load_tokenizer(config)
    builder = RequestBuilder(config, registry.adapters, tok, registry.cache_model)
    tenancy = Tenancy(config)
    fleet = FleetControls(config, dispatch)  # affinity, rollout, drift alarm
    metrics.registry.register(fleet.collector())
    controls = TenantControls(config, lambda: _routable_slots(registry), time.monotonic)
    metrics.registry.register(controls.metrics)
    al = config.access_log
    access = AccessLog(al.path, al.flush_interval_s) if al.path is not None else None
    events = None
    if config.kv_events_on:
        events = KvEventSubscriber(config.kv_events.endpoint, dispatch, time.monotonic)
        registry.attach_events(events, lambda w: _event_namespace(w, builder, tenancy))
        metrics.registry.register(KvEventCollector(events))
    node = None
    if clustered:
        node = build_node(
            config,
            dispatch,
            registry.workers.__contains__,
            builder.tokenizer_revision,
            time.monotonic,
            metrics.cluster_lag_observed,
        )
        metrics.attach_cluster(node)
    discovery = None
    if config.discovery.kind == "kubernetes":
        discovery = DiscoveryLink(config, registry)
        metrics.registry.register(DiscoveryCollector(discovery.watcher))
    counter = None
    if r.mode == "text" and r.token_count:
        counter = TokenCounter(dispatch, metrics, r.token_count_max_in_flight)
    warm_ups = None
    if getattr(policy.params, "proactive_copy", False):
        warm_ups = WarmUpSender(dispatch, metrics, GatewayState.clock)
    return GatewayState(
        counter=counter,
        warm_ups=warm_ups,
        discovery=discovery,
        cluster=node,
        config=config,
        dispatch=dispatch,
        registry=registry,
        metrics=metrics,
        decisions=decisions,
        builder=builder,
        tenancy=tenancy,
        fleet=fleet,
        controls=controls,
        access=access,
        lint=LintObserver() if config.metrics.lint_observe else None,
        events=events,
    )


def _routable_slots(registry: WorkerRegistry) -> int:
    """The ``max_slots`` of the workers that can take requests now, summed."""
    return sum(w.view.max_slots for w in registry.workers.values() if w.healthy and not w.draining)


def _event_namespace(worker: Worker, builder: RequestBuilder, tenancy: Tenancy) -> NamespaceSeed:
    """How a worker's event chains find their namespace: the one its requests hash in.

    A request names the model it wants; an event names only the adapter and
    carries the salt. So a base-model chain is put in the namespace of the
    engine's model (the first it lists: a vLLM engine serves one base model),
    an adapter chain in the adapter's, and the salt gives the tenant back.
    """

    def seed(lora: str | None, salt: str | None) -> int | None:
        tenant_ns = tenancy.namespace_of_salt(salt)
        if lora:
            return builder.namespace(lora, lora, tenant_ns).seed
        models = sorted(worker.models - worker.adapters)
        if not models:
            return None
        return builder.namespace(builder.cache_model(models[0]), "", tenant_ns).seed

    return seed


STATE = web.AppKey("prefixrouter_state", GatewayState)
"""Where the application keeps its :class:`GatewayState`."""
