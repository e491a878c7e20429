"""Typed, validated configuration of the gateway (YAML in, errors that name the field).

Every option has a default, so an empty file (or no file) is a valid
configuration: a gateway on 127.0.0.1:8080 with the ``prefix_aware`` policy,
text-mode hashing and no workers (add them with ``--worker`` or the admin API).

Shape of the YAML file (all keys optional)::

    server:        {host, port, max_body_bytes, admin_api_key}
    limits:        {header_timeout_s, body_idle_timeout_s, body_timeout_s, keepalive_timeout_s,
                    max_connections, fd_reserve, max_request_line_bytes, max_header_bytes,
                    max_headers}
    workers:       [{url, id, kind, pool, models, adapters, tenants, api_key,
                     block_size, kv_capacity_blocks, max_slots, health_path, metrics_path,
                     kv_events_topic, kv_events_connect, kv_replay_endpoint}]
    policy:        {name, params}
    routing:       {mode: text|token, tokenizer, chunk_chars, block_size,
                    chars_per_token, template_version, tokenizer_revision,
                    prefix_key_tokens, default_max_tokens, document_chars,
                    max_prompt_tokens}
    tenants:       {NAME: {share_cache, cache_salt}}
    default_tenant: {share_cache, cache_salt}
    api_keys:      {KEY: TENANT}
    require_api_key, trust_tenant_header, salt_secret
    health:        {timeout_s, backoff_initial_s, backoff_max_s, backoff_factor, unhealthy_after}
    metrics_poll:  {interval_s, timeout_s}
    proxy:         {max_attempts, retry_statuses, connect_timeout_s, request_timeout_s,
                    idle_connection_s, drain_timeout_s, retry_after_s,
                    first_byte_timeout_floor_s, first_byte_timeout_factor, stall_timeout_s}
    decision_log:  {path, ring_size, flush_interval_s}
    metrics:       {warm_fraction, lint_observe}
    kv_events:     {endpoint, max_blocks_per_worker}
    cluster:       {url, replica_id, name, stream, max_age_s, max_bytes, heartbeat_s,
                    peer_ttl_s, batch_window_s, max_batch_window_s}

Errors: :func:`load_config` raises :class:`~prefixrouter.errors.ConfigError`
with one line per problem, ``FILE:LINE: dotted.field: what is wrong``. The line
comes from the YAML node marks (PyYAML's composer), so a typo deep in a worker
list points at its own line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefixrouter.core.hashing import (
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_CHUNK_CHARS,
    DEFAULT_MAX_PROMPT_TOKENS,
)
from prefixrouter.errors import ConfigError, PrefixRouterError
from prefixrouter.real_engines.kv_events import ZMQ_SCHEMES

log = logging.getLogger("prefixrouter.gateway")

EngineKind = Literal["vllm", "sglang", "llamacpp", "openai"]
PosInt = Annotated[int, Field(gt=0)]
PosFloat = Annotated[float, Field(gt=0)]

# Per engine kind: (health path, metrics path). "" = the engine has none.
ENGINE_PATHS: dict[str, tuple[str, str]] = {
    "vllm": ("/health", "/metrics"),
    "sglang": ("/health", "/metrics"),
    "llamacpp": ("/health", "/metrics"),
    "openai": ("/v1/models", ""),
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WorkerConfig(_Model):
    """One upstream engine.

    Attributes:
        url: Base URL (``http://host:port``), without ``/v1``.
        id: Stable worker id; default ``host:port`` of the URL.
        kind: Engine kind; decides metric names, health path and ``cache_salt`` support.
        pool: Pool name (a policy may keep a ``cold`` pool).
        models: Models it serves; empty = discover from ``GET /v1/models``.
        adapters: LoRA adapters it serves (requested by model name).
        tenants: Tenants allowed on it; None = every tenant.
        api_key: Sent upstream as ``Authorization: Bearer``.
        block_size: Engine KV block size; None = from ``vllm:cache_config_info``.
        kv_capacity_blocks: Engine KV size in blocks; None = from its metrics.
        max_slots: Concurrent sequences the engine runs (``max_num_seqs``).
        health_path: Health endpoint; None = the kind's default.
        metrics_path: Prometheus endpoint; None = the kind's default, "" = none.
        kv_events_topic: The topic of this engine's KV events (vLLM's
            ``--kv-events-config`` ``topic``); None = the worker id. Used only
            when KV events are on (``kv_events.endpoint`` or ``kv_events_connect``).
        kv_events_connect: The engine's own bound KV-event publisher
            (``tcp://HOST:5557``; the engine's ``--kv-events-config`` has
            ``"endpoint": "tcp://*:5557"``): the gateway connects to it, so
            every gateway replica hears this engine. None = the engine connects
            to the gateway's ``kv_events.endpoint`` (one gateway only).
        kv_replay_endpoint: The engine's KV-event replay socket (vLLM's
            ``replay_endpoint``), asked for missed batches after a gap.
    """

    url: str
    id: str = ""
    kind: EngineKind = "vllm"
    pool: str = "default"
    models: list[str] = Field(default_factory=list)
    adapters: list[str] = Field(default_factory=list)
    tenants: list[str] | None = None
    api_key: str | None = None
    block_size: PosInt | None = None
    kv_capacity_blocks: PosInt | None = None
    max_slots: PosInt = 256
    health_path: str | None = None
    metrics_path: str | None = None
    kv_events_topic: str | None = None
    kv_events_connect: str | None = None
    kv_replay_endpoint: str | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        value = value.rstrip("/")
        if value.endswith("/v1"):
            value = value[:-3]
        # A path prefix is allowed (an engine behind a reverse proxy); a host is not optional.
        if not value.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("has no host")
        return value

    @field_validator("kv_events_connect", "kv_replay_endpoint")
    @classmethod
    def _check_connect_address(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(ZMQ_SCHEMES):
            raise ValueError("must be a ZMQ address: tcp://HOST:PORT or ipc://PATH")
        if "*" in value:
            # The engine binds "tcp://*:P"; a subscriber must name a host to reach it.
            raise ValueError("must name the engine's host (tcp://HOST:PORT), not a wildcard")
        if value.startswith("tcp://"):
            host, _, port = value.removeprefix("tcp://").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("must be tcp://HOST:PORT with a port from 1 to 65535")
        return value

    @model_validator(mode="after")
    def _fill_defaults(self) -> WorkerConfig:
        if not self.id:
            object.__setattr__(self, "id", self.url.split("://", 1)[1].split("/", 1)[0])
        health, metrics = ENGINE_PATHS[self.kind]
        if self.health_path is None:
            object.__setattr__(self, "health_path", health)
        if self.metrics_path is None:
            object.__setattr__(self, "metrics_path", metrics)
        if self.kv_events_topic is None:
            object.__setattr__(self, "kv_events_topic", self.id)
        return self

    @property
    def supports_cache_salt(self) -> bool:
        """vLLM isolates prefix caches per ``cache_salt``; other engines ignore it."""
        return self.kind == "vllm"


class ServerConfig(_Model):
    """The gateway's own HTTP server.

    Attributes:
        host: Listen address.
        port: Listen port.
        max_body_bytes: Larger request bodies get 413.
        admin_api_key: The key every ``/admin/*`` call needs (``Authorization:
            Bearer KEY``, compared in constant time). None = the admin API is
            off: each ``/admin/*`` call gets 403 naming this setting (never an
            anonymous admin). ``prefixrouter serve --admin-api-key`` or the
            ``PREFIXROUTER_ADMIN_API_KEY`` environment variable also set it.
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    max_body_bytes: PosInt = 8 * 1024 * 1024
    admin_api_key: str | None = None

    @field_validator("admin_api_key")
    @classmethod
    def _check_admin_key(cls, value: str | None) -> str | None:
        # An empty key would be "set" yet match an empty bearer token.
        if value is not None and not value.strip():
            raise ValueError("must not be empty (omit it to turn the admin API off)")
        return value


class LimitsConfig(_Model):
    """What one client connection may cost the gateway (:mod:`prefixrouter.gateway.server`).

    A request's line and headers, then its body, must arrive in bounded time,
    an idle connection is closed, and connections past the cap are answered
    503 and closed, so slow or idle clients cannot hold the file descriptors
    the upstream connections and the pollers need.

    Attributes:
        header_timeout_s: A request's line and headers must all have arrived
            within this many seconds of its first byte (of the connection's
            opening, for its first request); else 408 and the connection closes.
        body_idle_timeout_s: A request body that makes no progress for this
            long is cut (408, connection closed).
        body_timeout_s: The whole body must arrive within this long of the end
            of the headers (stops a body trickled a byte at a time, which an
            idle timeout alone never cuts): 60 s lets 8 MiB through at 140 kB/s.
        keepalive_timeout_s: A keep-alive connection idle this long between
            requests is closed. Above the idle timeouts of common clients and
            load balancers (httpx 5 s, aiohttp 15 s, AWS ALB 60 s), so it is
            they who close first, never us under a request in flight.
        max_connections: Client connections served at once; past it a new one
            gets 503 and is closed. The gateway lowers it to what its
            file-descriptor limit allows (each client connection may need an
            upstream one too: ``(RLIMIT_NOFILE - fd_reserve) / 2``), and at
            startup raises its soft limit toward the hard one to fit it.
        fd_reserve: File descriptors kept out of the client connections' share
            for everything else: pollers, the KV-event socket, the decision
            log, the listening socket, the tokenizer files, and the refusals
            past the cap (32 at most at once, each closed within a second).
        max_request_line_bytes: Longer request lines get 414.
        max_header_bytes: A header (name and value) longer than this gets 431.
        max_headers: More headers than this get 431.
        gil_switch_interval_s: The interpreter's thread switch interval in the
            gateway process (``sys.setswitchinterval``; Python's default is
            5 ms). Large bodies are parsed on a thread, and the event loop,
            which gives the GIL up at every socket wait, waited up to a whole
            interval for it at every read: with eight 7.8 MB bodies arriving,
            /health's p99 while they were parsed was 585-760 ms at 5 ms and
            55-80 ms at 0.5 ms (``benchmarks/downstream_limits.py``).
    """

    header_timeout_s: PosFloat = 30.0
    body_idle_timeout_s: PosFloat = 15.0
    body_timeout_s: PosFloat = 60.0
    keepalive_timeout_s: PosFloat = 75.0
    max_connections: PosInt = 8192
    fd_reserve: Annotated[int, Field(ge=0)] = 256
    max_request_line_bytes: PosInt = 8190
    max_header_bytes: PosInt = 8190
    max_headers: PosInt = 128
    gil_switch_interval_s: PosFloat = 0.0005


class PolicyConfig(_Model):
    """The routing policy: a registered name and its raw parameters."""

    name: str = "prefix_aware"
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _resolve_alias(cls, name: str) -> str:
        # A deprecated name still works; the configuration holds the registered one.
        from prefixrouter.core.policy import alias_note, canonical_policy_name

        note = alias_note(name)
        if note is not None:
            log.warning("policy.name: %s", note)
        return canonical_policy_name(name)

    @model_validator(mode="after")
    def _check_policy(self) -> PolicyConfig:
        from prefixrouter.core.policy import create_policy

        try:
            create_policy(self.name, self.params)
        except PrefixRouterError as exc:
            raise ValueError(str(exc)) from None
        return self


class RoutingConfig(_Model):
    """How a request becomes a routing key.

    Attributes:
        mode: ``text`` (character chunks, no tokenizer) or ``token`` (the model's tokenizer).
        tokenizer: Tokenizer JSON file or folder (token mode); None = the project's own.
        chunk_chars: Characters per block in text mode.
        block_size: Tokens per block in token mode; None = the engines' (default 16).
        chars_per_token: Starting estimate in text mode, until the first answer
            (then learned from usage, globally and per prefix); it also fixes the
            text-mode prefix key's depth, ``prefix_key_tokens`` at this estimate.
        template_version: Part of the cache namespace: bump when the prompt template changes.
        tokenizer_revision: Part of the cache namespace.
        prefix_key_tokens: Depth of the prefix key in decisions and metrics.
        default_max_tokens: Expected output tokens when a request gives none.
        document_chars: A message this long makes the request's prefix class ``document``.
        max_prompt_tokens: Only a prompt's first this many tokens are hashed
            and indexed (text mode: their characters at the current estimate);
            its full length still counts in the cost model. Bounds one
            request's routing work, whatever its size: 131,072 is the longest
            context most served models take.
    """

    mode: Literal["text", "token"] = "text"
    tokenizer: Path | None = None
    chunk_chars: PosInt = DEFAULT_CHUNK_CHARS
    block_size: PosInt | None = None
    chars_per_token: PosFloat = DEFAULT_CHARS_PER_TOKEN
    template_version: str = ""
    tokenizer_revision: str = ""
    prefix_key_tokens: PosInt = 1024
    default_max_tokens: PosInt = 256
    document_chars: PosInt = 4000
    max_prompt_tokens: PosInt = DEFAULT_MAX_PROMPT_TOKENS


class TenantRule(_Model):
    """Cache sharing rule of one tenant.

    Attributes:
        share_cache: False: the tenant's requests get a namespace of their own
            (never a warm route shared with another tenant) and, on vLLM
            workers, a ``cache_salt`` so the engine keeps its blocks apart too.
        cache_salt: Explicit salt; default derived from the tenant and ``salt_secret``.
    """

    share_cache: bool = True
    cache_salt: str | None = None


class HealthConfig(_Model):
    """Health checks: failing workers are re-checked with exponential backoff.

    Attributes:
        timeout_s: Timeout of one check.
        backoff_initial_s: First re-check delay after a failure.
        backoff_max_s: Upper bound of the delay. It bounds how long a restarted
            engine waits for traffic after it answers again (at most this plus
            one check), so keep it short: a failed check costs one refused
            connect, or ``timeout_s`` for a frozen engine.
        backoff_factor: Delay multiplier per consecutive failure.
        unhealthy_after: Consecutive failed checks before a worker leaves routing.
            Leaving routing keeps the worker's index entries (demoted to
            speculative); only a detected engine restart clears them.
    """

    timeout_s: PosFloat = 2.0
    backoff_initial_s: PosFloat = 0.5
    backoff_max_s: PosFloat = 2.0
    backoff_factor: Annotated[float, Field(ge=1.0)] = 2.0
    unhealthy_after: PosInt = 1


class MetricsPollConfig(_Model):
    """Polling of each healthy worker's health and ``/metrics`` (queue, KV usage, KV size)."""

    interval_s: PosFloat = 2.0
    timeout_s: PosFloat = 2.0


class ProxyConfig(_Model):
    """Forwarding.

    Attributes:
        max_attempts: Workers tried per request (retries happen only before the
            first byte reaches the client).
        retry_statuses: Upstream statuses that count as a refusal (retry elsewhere).
        connect_timeout_s: TCP connect timeout per attempt.
        request_timeout_s: Total time allowed for one upstream request.
        idle_connection_s: A keep-alive connection to a worker idle longer than
            this is closed, not reused. Keep it below the engines' own
            keep-alive timeout (uvicorn, behind vLLM and SGLang: 5 s), or a
            request may go out on a connection the engine is closing.
        drain_timeout_s: Default wait for a removed worker's requests to finish.
        retry_after_s: ``Retry-After`` of a 503 when no worker is available.
        first_byte_timeout_floor_s: Least time an attempt waits for the
            worker's first body byte before it is abandoned, retried on another
            worker and its worker marked suspect (None: no first-byte timeout).
        first_byte_timeout_factor: The first-byte timeout is this many times the
            predicted wait (a stream: the predicted TTFT; a non-streamed
            request, whose answer comes whole: TTFT plus the decode of
            ``max_tokens``), never below the floor. A non-streamed request
            without a prediction or without ``max_tokens`` has no first-byte
            timeout. Either timeout cuts a request only once its worker has
            been silent on every connection and its health checks for the
            timeout (at least ``metrics_poll.interval_s + health.timeout_s``):
            a request queued on a live engine waits.
        stall_timeout_s: Longest silence of a stream after its first byte; then
            the client gets an SSE ``error`` event and the engine request is
            aborted (None: no stall timeout). An engine sends a token per
            step (tens of ms; a few hundred under a heavy chunked prefill), so
            5 s is far past any healthy gap; raise it where engines preempt
            requests under KV pressure (a preempted stream waits to be
            re-admitted).
    """

    max_attempts: PosInt = 3
    retry_statuses: list[int] = Field(default_factory=lambda: [429, 502, 503, 504])
    connect_timeout_s: PosFloat = 3.0
    request_timeout_s: PosFloat = 600.0
    idle_connection_s: PosFloat = 4.0
    drain_timeout_s: Annotated[float, Field(ge=0)] = 60.0
    retry_after_s: PosInt = 1
    first_byte_timeout_floor_s: PosFloat | None = 2.0
    first_byte_timeout_factor: Annotated[float, Field(ge=1.0)] = 3.0
    stall_timeout_s: PosFloat | None = 5.0


class DecisionLogConfig(_Model):
    """The decision log: JSON lines in a file (optional) and a ring for ``/admin/decisions``."""

    path: Path | None = None
    ring_size: PosInt = 1000
    flush_interval_s: PosFloat = 1.0


class MetricsConfig(_Model):
    """Prometheus metrics settings.

    Attributes:
        warm_fraction: A request whose engine reused at least this share of the
            prompt counts as ``hit="warm"``; more than zero but less, ``partial``.
        lint_observe: Run the prompt linter on every request in observe mode:
            findings are counted per prefix class in
            ``prefixrouter_lint_findings_total`` and the request is never
            changed (costs about 0.3-0.5 ms of CPU per long request).
    """

    warm_fraction: Annotated[float, Field(gt=0, le=1)] = 0.75
    lint_observe: bool = False


class KvEventsConfig(_Model):
    """The engines' KV-event feed (vLLM's ZMQ publisher).

    KV events are on when ``endpoint`` is set or a worker has
    ``kv_events_connect`` (both may be used at once, per worker); otherwise
    the index learns from routing and completions only.

    Attributes:
        endpoint: Where the gateway binds its SUB socket (``tcp://127.0.0.1:5557``);
            each vLLM engine *connects* its publisher there (``--kv-events-config
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
            "tcp://127.0.0.1:5557", "topic": "<worker's kv_events_topic>"}'``).
            One gateway only: with several replicas, let each engine bind
            (``"endpoint": "tcp://*:5557"``) and give each worker
            ``kv_events_connect``. None = bind nothing.
        max_blocks_per_worker: Bound on each worker's engine-hash -> router-hash map.
    """

    endpoint: str | None = None
    max_blocks_per_worker: PosInt = 1 << 20

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(ZMQ_SCHEMES):
            raise ValueError("must be a ZMQ address: tcp://HOST:PORT or ipc://PATH")
        return value


class ClusterConfig(_Model):
    """Active-active replicas sharing routing facts over NATS JetStream (:mod:`.cluster`).

    Attributes:
        url: The NATS server (``nats://HOST:PORT``, JetStream on); None = this
            gateway is alone and behaves as without this section.
        replica_id: This replica's id, stable across its restarts (a pod's
            name); "" = ``HOSTNAME:PORT``. Two live replicas must not share one.
        name: The cluster's name: subjects ``prefixrouter.NAME.*``; replicas
            of one name share facts.
        stream: The JetStream stream's name; "" = ``PREFIXROUTER_NAME``.
        max_age_s: Facts older than this leave the stream (a starting replica
            replays at most this much). Keep it at least as long as prefixes
            stay in the engines' caches.
        max_bytes: The stream's size bound (oldest facts dropped first).
        heartbeat_s: Heartbeat interval.
        peer_ttl_s: A peer silent this long is gone: its in-flight counts expire.
        batch_window_s: Facts are published in one message per window; a
            fact after a quiet spell waits this long.
        max_batch_window_s: While facts keep coming, each window doubles up
            to this (fewer messages per request; a fact waits at most this).
        apply_within_s: Peers' facts heard live are applied just before this
            replica next routes or reads its routing state (no decision misses
            one), or at most this long after the first was heard; 0 = each
            message as it arrives (one cold wakeup per message).
    """

    url: str | None = None
    replica_id: str = ""
    name: str = "default"
    stream: str = ""
    max_age_s: PosFloat = 600.0
    max_bytes: PosInt = 256 * 1024 * 1024
    heartbeat_s: PosFloat = 1.0
    peer_ttl_s: PosFloat = 5.0
    batch_window_s: Annotated[float, Field(gt=0, le=1.0)] = 0.002
    max_batch_window_s: Annotated[float, Field(gt=0, le=1.0)] = 0.004
    apply_within_s: Annotated[float, Field(ge=0, le=10.0)] = 0.5

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("nats://", "tls://")):
            raise ValueError("must be a NATS address: nats://HOST:PORT")
        return value

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "_-" for c in value):
            raise ValueError("must be letters, digits, '_' or '-' (it names NATS subjects)")
        return value

    @model_validator(mode="after")
    def _ttl_above_heartbeat(self) -> ClusterConfig:
        if self.peer_ttl_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"peer_ttl_s ({self.peer_ttl_s:g}) must be more than twice heartbeat_s "
                f"({self.heartbeat_s:g}), or one late heartbeat ends a live peer"
            )
        return self


class GatewayConfig(_Model):
    """The whole gateway configuration; every field has a default.

    Tenancy (see :mod:`prefixrouter.gateway.tenancy`):

    Attributes:
        api_keys: Client API key -> tenant. Once any key is configured, an
            unknown key is a 401.
        require_api_key: A request without a known key is a 401.
        trust_tenant_header: Take the tenant of a request without a key from
            its ``X-Tenant`` header. Only for a gateway behind an
            authenticating proxy that sets (and strips clients') ``X-Tenant``:
            otherwise any client can claim any tenant. Even then the header
            never selects a tenant that has API keys or ``share_cache: false``
            (403).
        tenant_header: Removed (it trusted ``X-Tenant`` by default). ``false``
            is accepted and means nothing; ``true`` is an error that names
            ``trust_tenant_header``.
        salt_secret: Secret of the derived ``cache_salt`` values.
    """

    server: ServerConfig = Field(default_factory=ServerConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    tenants: dict[str, TenantRule] = Field(default_factory=dict)
    default_tenant: TenantRule = Field(default_factory=TenantRule)
    api_keys: dict[str, str] = Field(default_factory=dict)
    require_api_key: bool = False
    trust_tenant_header: bool = False
    tenant_header: bool | None = None
    salt_secret: str = ""
    health: HealthConfig = Field(default_factory=HealthConfig)
    metrics_poll: MetricsPollConfig = Field(default_factory=MetricsPollConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    decision_log: DecisionLogConfig = Field(default_factory=DecisionLogConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @field_validator("tenant_header")
    @classmethod
    def _removed_tenant_header(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(
                "removed: X-Tenant is no longer trusted by default; set "
                "trust_tenant_header: true only behind an authenticating proxy that sets "
                "X-Tenant (tenants with API keys or share_cache: false still need their key)"
            )
        return value

    @model_validator(mode="after")
    def _unique_worker_ids(self) -> GatewayConfig:
        seen: set[str] = set()
        for w in self.workers:
            if w.id in seen:
                raise ValueError(f"workers: duplicate worker id {w.id!r}")
            seen.add(w.id)
        topics: set[str | None] = set()
        for w in self.workers:
            if w.kv_events_topic in topics:
                raise ValueError(f"workers: duplicate kv_events_topic {w.kv_events_topic!r}")
            topics.add(w.kv_events_topic)
        publishers: set[str] = set()
        for w in self.workers:
            if w.kv_events_connect is None:
                continue
            if w.kv_events_connect in publishers:
                # Two connections to one PUB socket would deliver each message twice.
                raise ValueError(f"workers: duplicate kv_events_connect {w.kv_events_connect!r}")
            publishers.add(w.kv_events_connect)
        return self

    @property
    def kv_events_on(self) -> bool:
        """The gateway subscribes to KV events: it binds, or some worker's engine is connected."""
        return self.kv_events.endpoint is not None or any(
            w.kv_events_connect is not None for w in self.workers
        )

    def tenant_rule(self, tenant: str) -> TenantRule:
        """The sharing rule of ``tenant`` (the default rule if it has none)."""
        return self.tenants.get(tenant, self.default_tenant)


def config_from_dict(
    data: Any, source: str = "<config>", node: yaml.Node | None = None
) -> GatewayConfig:
    """Validate a parsed configuration.

    Args:
        data: The parsed mapping (None = all defaults).
        source: Name used in error messages (a file path).
        node: The YAML node tree the data came from, to name lines in errors.

    Raises:
        ConfigError: One line per invalid field.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the configuration must be a mapping, got {type(data).__name__}"
        )
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc) or "(top level)"
            line = _line_of(node, loc)
            where = f"{source}:{line}" if line else source
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {field}: {msg}")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: Path | str) -> GatewayConfig:
    """Read and validate a YAML configuration file.

    Raises:
        ConfigError: Unreadable file, invalid YAML or invalid fields; the message
            names the file, the line and the field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    return config_from_dict(data, str(path), node)


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the deepest YAML node on ``loc`` (a pydantic error location)."""
    if node is None:
        return None
    line: int = node.start_mark.line + 1
    for part in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    child = value
                    line = key.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(part, int)
            and 0 <= part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line
