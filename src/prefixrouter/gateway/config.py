"""Typed, validated configuration of the gateway (YAML in, errors that name the field).

Every option has a default, so an empty file (or no file) is a valid
configuration: a gateway on 127.0.0.1:8080 with the ``prefix_aware`` policy,
text-mode hashing and no workers (add them with ``--worker`` or the admin API).

Shape of the YAML file (all keys optional)::

    server:        {host, port, max_body_bytes, admin_api_key, expose_workers}
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
                    max_prompt_tokens, token_count, token_count_max_in_flight}
    tenants:       {NAME: {share_cache, cache_salt, priority, max_in_flight,
                           requests_per_s, burst}}
    default_tenant: {share_cache, cache_salt, priority, max_in_flight, requests_per_s, burst}
    api_keys:      {KEY: TENANT}
    require_api_key, trust_tenant_header, salt_secret
    health:        {timeout_s, backoff_initial_s, backoff_max_s, backoff_factor, unhealthy_after}
    outlier:       {enabled, consecutive_failures, base_ejection_s, max_ejection_s,
                    max_ejected_share}
    metrics_poll:  {interval_s, timeout_s, models_interval_s}
    proxy:         {max_attempts, retry_statuses, connect_timeout_s, request_timeout_s,
                    idle_connection_s, drain_timeout_s, retry_after_s,
                    first_byte_timeout_floor_s, first_byte_timeout_factor, stall_timeout_s}
    decision_log:  {path, ring_size, flush_interval_s}
    metrics:       {warm_fraction, lint_observe}
    kv_events:     {endpoint, max_blocks_per_worker}
    cluster:       {url, replica_id, name, stream, max_age_s, max_bytes, heartbeat_s,
                    peer_ttl_s, batch_window_s, max_batch_window_s}
    discovery:     {kind: static|kubernetes, namespace, pool, selector, service, port,
                    kubeconfig, scheme, resync_s, retry_max_s, kv_events_port,
                    kv_replay_port, worker}
    affinity:      {enabled, header, max_sessions, min_cached_share, max_wait_s}
    rollout:       {enabled, classes, share, baseline_policy, prefix_pool, baseline_pool, seed}
    drift:         {enabled, min_tokens, rel_tolerance, window, min_samples, fire_share,
                    clear_after}
    overload:      {max_in_flight, max_queue, max_wait_s, aging_s}
    access_log:    {path, flush_interval_s}

Errors: :func:`load_config` raises :class:`~prefixrouter.errors.ConfigError`
with one line per problem, ``FILE:LINE: dotted.field: what is wrong``. The line
comes from the YAML node marks (PyYAML's composer), so a typo deep in a worker
list points at its own line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefixrouter.addresses import address_problem
from prefixrouter.core.dispatch import RoutingMode
from prefixrouter.core.hashing import (
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_CHUNK_CHARS,
    DEFAULT_MAX_PROMPT_TOKENS,
)
from prefixrouter.errors import ConfigError, PrefixRouterError, unreadable
from prefixrouter.real_engines.kv_events import ZMQ_SCHEMES, endpoint_key

log = logging.getLogger("prefixrouter.gateway")

EngineKind = Literal["vllm", "sglang", "llamacpp", "openai"]
PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
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


class FieldAt(ValueError):
    """A validator's error about a field below the one it validates.

    A model-level validator's errors are located at the model itself, so a
    duplicate in a list would be reported at the document's first line; one
    that raises this names the field (``("workers", 2, "id")``, relative to
    the model) and :func:`config_from_dict` reports it at that field's line.
    """

    def __init__(self, message: str, loc: tuple[str | int, ...]) -> None:
        super().__init__(message)
        self.loc = loc


def engine_key(url: str) -> tuple[str, str, int, str]:
    """What identifies the engine a worker URL reaches: scheme, host, port, path.

    Case and an explicit default port do not matter: ``HTTP://Host`` and
    ``http://host:80`` are the same engine. ``url`` is a validated worker URL.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port, parts.path.rstrip("/")


OTHER_TENANTS = "_other"
"""The ``tenant`` label the metrics give every tenant past their limit: no tenant's name."""
RESERVED_WHY = "the metrics' label of the tenants past their limit"


def default_worker_id(url: str) -> str:
    """A worker's id when none is set: ``host:port`` of its validated URL."""
    return url.split("://", 1)[1].split("/", 1)[0]


def known_profile(name: str) -> str:
    """``name`` if it is a built-in engine profile (``prefixrouter profiles``), else ValueError."""
    from prefixrouter.sim.profiles import get_profile

    try:
        get_profile(name)
    except KeyError as exc:  # its message names the known profiles
        raise ValueError(exc.args[0]) from None
    return name


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
        profile: The engine speed profile the cost model predicts this
            worker's times with (``prefixrouter profiles`` lists them); None =
            ``policy.profile``.
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
    profile: str | None = None
    health_path: str | None = None
    metrics_path: str | None = None
    kv_events_topic: str | None = None
    kv_events_connect: str | None = None
    kv_replay_endpoint: str | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        # Everything upstream.Endpoint.from_url reads is checked here: a URL
        # that passes cannot fail later, at startup or in the admin API, with
        # a traceback or an error that names another field.
        # Everything upstream.Endpoint.from_url reads is checked here (module
        # addresses); a path prefix is allowed (an engine behind a reverse proxy).
        scheme, sep, rest = value.partition("://")
        value = scheme + sep + rest.rstrip("/")  # "http://" stays itself: it has no host
        if value.endswith("/v1"):
            value = value[:-3]
        why = address_problem(value, ("http", "https"))
        if why is not None:
            raise ValueError(why)
        if "@" in urlsplit(value).netloc:
            raise ValueError("must not hold user:password@ (set the worker's api_key)")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: str | None) -> str | None:
        # Sent in a header block encoded as latin-1: anything else would fail
        # at the first request, and a CR or LF would end the header early.
        if value is not None and not (value.isascii() and value.isprintable()):
            raise ValueError("must be printable ASCII (it is sent in a header)")
        return value

    @field_validator("profile")
    @classmethod
    def _check_profile(cls, value: str | None) -> str | None:
        return value if value is None else known_profile(value)

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
            object.__setattr__(self, "id", default_worker_id(self.url))
        health, metrics = ENGINE_PATHS[self.kind]
        if self.health_path is None:
            object.__setattr__(self, "health_path", health)
        if self.metrics_path is None:
            object.__setattr__(self, "metrics_path", metrics)
        if self.kv_events_topic is None:
            object.__setattr__(self, "kv_events_topic", self.id)
        return self

    @property
    def usage_by_default(self) -> bool:
        """vLLM streams a usage chunk for ``stream_options`` without
        ``include_usage`` (its default is True); SGLang, llama.cpp and
        OpenAI's API send none unless asked."""
        return self.kind == "vllm"

    @property
    def supports_cache_salt(self) -> bool:
        """vLLM isolates prefix caches per ``cache_salt``; other engines ignore it."""
        return self.kind == "vllm"


class ServerConfig(_Model):
    """The gateway's own HTTP server.

    Attributes:
        host: Listen address.
        port: Listen port.
        max_body_bytes: Larger request bodies get 413 (its message names this
            setting). 64 MiB by default (it was 8 MiB): vLLM sets no limit, and
            a request that works against an engine should work through the
            gateway. A 128k-token prompt is about 0.5 MB of text (1 MB as
            token ids), but images travel inline as base64 (4/3 of their
            size): a few photos or scanned pages pass 8 MiB, and OpenAI
            accepts up to 50 MB of images per request (67 MB as base64 is
            past even this default: raise it for such traffic). The limit
            bounds one request, not the gateway's memory: a body is held
            while its request runs (once parsed as well), so the number of
            requests at once (``overload.max_in_flight``,
            ``limits.max_connections``) is what bounds the total; lower it on
            a gateway whose clients send text only.
        admin_api_key: The key every ``/admin/*`` call needs (``Authorization:
            Bearer KEY``, compared in constant time). None = the admin API is
            off: each ``/admin/*`` call gets 403 naming this setting (never an
            anonymous admin). ``prefixrouter serve --admin-api-key`` or the
            ``PREFIXROUTER_ADMIN_API_KEY`` environment variable also set it.
            Surrounding whitespace (a secret file's trailing newline) is
            removed: a bearer token cannot carry it. It must differ from
            every key in ``api_keys``.
        expose_workers: Clients see which worker served them (the
            ``X-Prefixrouter-Worker`` response header) and which workers
            failed or were filtered out in a 502/503/403 error's message.
            Worker ids default to ``host:port``: set false on a gateway that
            untrusted clients reach, and they learn no address or health of
            the fleet (errors then count the workers by reason; the decision
            and access logs keep every name).
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    max_body_bytes: PosInt = 64 * 1024 * 1024
    admin_api_key: str | None = None
    expose_workers: bool = True

    @field_validator("admin_api_key")
    @classmethod
    def _check_admin_key(cls, value: str | None) -> str | None:
        # An empty key would be "set" yet match an empty bearer token.
        if value is not None and not value.strip():
            raise ValueError("must not be empty (omit it to turn the admin API off)")
        return value.strip() if value is not None else None


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
            idle timeout alone never cuts): 60 s lets 8 MiB through at 140 kB/s,
            and a body of the default ``server.max_body_bytes`` (64 MiB) at 1.1 MB/s.
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
    """The routing policy: a registered name and its raw parameters.

    Attributes:
        name: A registered policy (``prefixrouter policies`` lists them);
            ``prefixrouter`` is the deprecated alias of ``prefix_aware``.
        params: The policy's parameters, overriding its defaults key by key
            (nested sections such as ``short`` too); an unknown key or a value
            of the wrong type is an error that names it.
        profile: The engine speed profile (``prefixrouter profiles``) the cost
            model predicts every worker's times with, unless the worker names
            its own; "" = a generic one. Each worker's calibration factor
            corrects the level of its predictions online, not their shape: a
            profile unlike the engine mispredicts long prompts against short
            ones (live, simulated H100 engines: a 20,000-token cold prefill
            took 2.0 times its prediction and 750-token prompts 1.06 times
            theirs with the generic profile; 1.78 and 1.27 with their own).
    """

    name: str = "prefix_aware"
    params: dict[str, Any] = Field(default_factory=dict)
    profile: str = ""

    @field_validator("profile")
    @classmethod
    def _check_profile(cls, value: str) -> str:
        return value and known_profile(value)

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
        from prefixrouter.core.policy import ParamError, create_policy

        try:
            create_policy(self.name, self.params)
        except ParamError as exc:  # named at its own key: policy.params.short.bogus
            raise FieldAt(exc.problem, ("params", *exc.path)) from None
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
        default_max_tokens: The ``max_tokens`` taken when a request gives none.
            0 (the default): none, as the engine sees it (vLLM then decodes up
            to the context); the output expected of such requests is the mean
            their earlier answers decoded, per prefix and overall. N: taken as
            the request's cap, its fill learned as for any cap (an answer
            longer than N is then read as N).
        document_chars: A message this long makes the request's prefix class ``document``.
        max_prompt_tokens: Only a prompt's first this many tokens are hashed
            and indexed (text mode: their characters at the current estimate);
            its full length still counts in the cost model. Bounds one
            request's routing work, whatever its size: 131,072 is the longest
            context most served models take.
        token_count: Text mode: when a prompt's prefix has no
            characters-per-token estimate of its own yet, ask the chosen
            ``vllm`` worker's ``POST /tokenize`` for its count beside the
            request, so the document's next requests are predicted at its own
            ratio before its first answer (:mod:`.token_count`).
        token_count_max_in_flight: Token counts out at once.
    """

    mode: RoutingMode = "text"
    tokenizer: Path | None = None
    chunk_chars: PosInt = DEFAULT_CHUNK_CHARS
    block_size: PosInt | None = None
    chars_per_token: PosFloat = DEFAULT_CHARS_PER_TOKEN
    template_version: str = ""
    tokenizer_revision: str = ""
    prefix_key_tokens: PosInt = 1024
    default_max_tokens: NonNegInt = 0
    document_chars: PosInt = 4000
    max_prompt_tokens: PosInt = DEFAULT_MAX_PROMPT_TOKENS
    token_count: bool = True
    token_count_max_in_flight: PosInt = 8


class TenantRule(_Model):
    """Cache sharing rule of one tenant.

    Attributes:
        share_cache: False: the tenant's requests get a namespace of their own
            (never a warm route shared with another tenant) and, on vLLM
            workers, a ``cache_salt`` so the engine keeps its blocks apart too.
        cache_salt: Explicit salt; default derived from the tenant and ``salt_secret``.
        priority: Under overload, higher goes first (:mod:`.limits`); a request's
            ``X-Priority`` header may lower its own, never raise it above this.
        max_in_flight: Requests of the tenant in flight at once; past it 429.
        requests_per_s: Sustained requests per second (a token bucket); past it 429.
        burst: Requests above the rate taken at once (None: ``ceil(requests_per_s)``).

    ``default_tenant``'s limits apply to each tenant without a rule of its own,
    separately (each has its own count and bucket), anonymous requests included.
    """

    share_cache: bool = True
    cache_salt: str | None = None
    priority: Annotated[int, Field(ge=-100, le=100)] = 0
    max_in_flight: PosInt | None = None
    requests_per_s: PosFloat | None = None
    burst: PosInt | None = None


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


class OutlierConfig(_Model):
    """Passive outlier ejection (:mod:`prefixrouter.core.outlier`, Envoy's ``consecutive_5xx``).

    A worker whose answers fail ``consecutive_failures`` times in a row (a
    5xx other than a timeout's 504, a refused or broken connection, a
    malformed or cut answer) leaves routing for ``base_ejection_s`` times its
    ejection count, at most ``max_ejection_s``, even though its health checks
    pass; it returns on probation (one more failure ejects it again).

    Attributes:
        enabled: Eject failing workers.
        consecutive_failures: Failures in a row that eject a worker.
        base_ejection_s: The first ejection's length (the n-th: n times it).
        max_ejection_s: The longest ejection.
        max_ejected_share: Most of the fleet ejected at once (at least one
            worker, never the last routable one).
    """

    enabled: bool = True
    consecutive_failures: PosInt = 5
    base_ejection_s: PosFloat = 5.0
    max_ejection_s: PosFloat = 120.0
    max_ejected_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5

    @model_validator(mode="after")
    def _ordered(self) -> OutlierConfig:
        if self.base_ejection_s > self.max_ejection_s:
            raise ValueError("base_ejection_s must not exceed max_ejection_s")
        return self


class MetricsPollConfig(_Model):
    """Polling of each healthy worker's health and ``/metrics`` (queue, KV usage, KV size).

    Attributes:
        interval_s: How often each worker is checked and its metrics scraped.
        timeout_s: Time allowed for one scrape of a worker's ``/metrics``.
        models_interval_s: How often each healthy worker's model list
            (``GET /v1/models``) is read again, for the adapters an engine
            loads or unloads at runtime (vLLM's ``/v1/load_lora_adapter``).
            A worker that restarted (its ``/metrics`` show a new process) or
            comes back after being down is listed again at once, and so is
            one that answers 404 for a model it listed. A model a worker
            stops listing is no longer routed to it. Workers whose
            ``models`` are configured are never listed.
    """

    interval_s: PosFloat = 2.0
    timeout_s: PosFloat = 2.0
    models_interval_s: PosFloat = 30.0


class ProxyConfig(_Model):
    """Forwarding.

    Attributes:
        max_attempts: Workers tried per request (retries happen only before the
            first byte reaches the client).
        retry_statuses: Upstream statuses that count as a refusal (retry elsewhere).
        connect_timeout_s: TCP connect timeout per attempt.
        request_timeout_s: Total time allowed for one upstream request. Past
            it the client gets 504 ``upstream_timeout`` (an SSE error event
            with code 504 once a stream has begun); the request is not sent
            to another worker, which would run it twice.
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


class OverloadConfig(_Model):
    """What the gateway does when it holds as many requests as it can serve (:mod:`.limits`).

    Attributes:
        max_in_flight: The gateway's capacity: requests past it wait in a
            priority queue. An integer, ``"slots"`` (the sum of the routable
            workers' ``max_slots``: more would only queue inside the engines,
            where no priority applies) or None (no gateway queue; every request
            goes to routing at once, as without this section).
        max_queue: Most requests waiting; past it the lowest priority's newest is shed (503).
        max_wait_s: A request waiting longer than this is shed (503).
        aging_s: Seconds of waiting one priority level is worth: the starvation
            bound (a lower priority is served before a higher one's newcomers
            that arrive this long per level after it).
    """

    max_in_flight: PosInt | Literal["slots"] | None = None
    max_queue: Annotated[int, Field(ge=0)] = 1024
    max_wait_s: PosFloat = 30.0
    aging_s: PosFloat = 1.0


class AccessLogConfig(_Model):
    """The access log (:mod:`.access_log`): one JSON line per request.

    Attributes:
        path: File to append to (None: no access log).
        flush_interval_s: How often buffered lines are written (on a thread).
    """

    path: Path | None = None
    flush_interval_s: PosFloat = 1.0


class DecisionLogConfig(_Model):
    """The decision log: JSON lines in a file (optional) and a ring for ``/admin/decisions``.

    Attributes:
        path: JSON-lines file every decision is appended to (candidates, each
            cost term, tier, reason, predicted and actual cached tokens);
            None = no file (``prefixrouter serve --decision-log PATH`` sets it).
        ring_size: Most recent decisions kept in memory for ``GET /admin/decisions``.
        flush_interval_s: How often pending records are written to the file
            (off the request path).
    """

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
        batch_window_s: After a quiet spell (50 ms without a publish) a fact
            is published at once, with the others of its event-loop tick; in
            a busy spell it waits this long for the facts that follow it.
        max_batch_window_s: While facts keep coming, the window doubles up
            to this (fewer messages per request; a fact waits at most this).
        apply_within_s: Peers' facts heard live are applied just before this
            replica next routes or reads its routing state (no decision misses
            one), or at most this long after the first was heard; 0 = each
            message as it arrives (one cold wakeup per message).
        ready_without_nats_s: A replica that could not replay the stream this
            long after it started (NATS unreachable, JetStream off) answers
            ``/ready`` 200 with status ``standalone`` and routes on its own
            view, so replicas restarted during a NATS outage still take
            traffic; it replays and joins when NATS answers. None = 503 until
            it has replayed, however long that takes.
        tls_ca_file: PEM file of the CA that signed the NATS server's
            certificate; set (or with a client certificate), the connection
            must be TLS: a server that does not offer it is refused. None =
            TLS only where the server requires it, verified against the
            system's CA certificates.
        tls_cert_file: This replica's client certificate (PEM), for a server
            that verifies clients (``nats-server --tlsverify``).
        tls_key_file: Its private key (PEM); None = in ``tls_cert_file``.
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
    ready_without_nats_s: Annotated[float, Field(ge=0)] | None = 30.0
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value.startswith("tls://"):  # nats-py would connect in plain text to a plain server
            raise ValueError(
                "tls:// is not supported: use nats://HOST:PORT (the connection is TLS when "
                "the server requires it; cluster.tls_ca_file makes TLS required)"
            )
        why = address_problem(value, ("nats",), path=False)
        if why is not None:
            raise ValueError(f"must be a NATS address, nats://HOST:PORT: it {why}")
        return value

    @field_validator("stream")
    @classmethod
    def _check_stream(cls, value: str) -> str:
        # NATS refuses these in a stream name (it is a subject token and a directory).
        if value and (any(c in value for c in ".*> /\\") or not value.isprintable()):
            raise ValueError("must not hold '.', '*', '>', spaces, slashes or control characters")
        return value

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "_-" for c in value):
            raise ValueError("must be letters, digits, '_' or '-' (it names NATS subjects)")
        return value

    @model_validator(mode="after")
    def _tls_files(self) -> ClusterConfig:
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_key_file needs tls_cert_file (the certificate it is the key of)")
        return self

    @model_validator(mode="after")
    def _ttl_above_heartbeat(self) -> ClusterConfig:
        if self.peer_ttl_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"peer_ttl_s ({self.peer_ttl_s:g}) must be more than twice heartbeat_s "
                f"({self.heartbeat_s:g}), or one late heartbeat ends a live peer"
            )
        return self


DISCOVERY_SPEC_FORMS = (
    "k8s:NAMESPACE/LABEL_SELECTOR[:PORT]",
    "k8s-pool:NAMESPACE/INFERENCEPOOL[:PORT]",
    "k8s-service:NAMESPACE/SERVICE[:PORT]",
)
# Fields of a discovered worker that discovery itself fills in.
DISCOVERED_FIELDS = ("url", "id", "kv_events_topic", "kv_events_connect", "kv_replay_endpoint")


class DiscoveryConfig(_Model):
    """Workers found in a Kubernetes cluster, beside ``workers:`` (:mod:`prefixrouter.discovery`).

    ``kind: static`` (the default) uses only ``workers:`` and the admin API.
    ``kind: kubernetes`` lists and watches one source in ``namespace``
    (exactly one of ``pool``, ``selector``, ``service``) and keeps one worker
    per pod: added when it appears, out of routing while not ready, drained
    and removed when it goes. The worker's id (and KV-event topic) is the
    pod's name, its URL ``SCHEME://POD_IP:PORT``.

    Attributes:
        kind: ``static`` or ``kubernetes``.
        namespace: The engines' namespace.
        pool: An ``InferencePool`` (``inference.networking.k8s.io/v1``): its
            ``selector.matchLabels`` pick the pods, its ``targetPorts`` the port.
        selector: A label selector of the engines' pods (``app=vllm``).
        service: A Service: its EndpointSlices name the engines.
        port: The engines' port; None = the pool's, or the slices' only port
            (required with ``selector``).
        kubeconfig: A kubeconfig file; None = the pod's service account in a
            cluster, else ``$KUBECONFIG`` or ``~/.kube/config``.
        scheme: ``http`` or ``https`` for the workers' URLs.
        resync_s: A watch lasts this long, then everything is listed again.
        retry_max_s: Longest wait between retries when the API server fails.
        pool_check_s: How often an InferencePool is read again: an edit of its
            selector or target port takes effect within this long (a deleted
            pool keeps its last pods, with a warning, until it is back).
        kv_events_port: Each pod's own bound KV-event publisher port (vLLM
            ``--kv-events-config`` ``"endpoint": "tcp://*:PORT"``, ``"topic"``
            the pod's name): the gateway connects to it (``kv_events_connect``),
            so every replica hears every engine. None = no KV events from
            discovered engines.
        kv_replay_port: Each pod's KV-event replay port (vLLM ``replay_endpoint``).
        worker: Settings of every discovered worker, as a ``workers:`` entry
            without ``url``, ``id`` and the ``kv_*`` addresses (``kind``,
            ``models``, ``max_slots``, ...).
    """

    kind: Literal["static", "kubernetes"] = "static"
    namespace: str = "default"
    pool: str | None = None
    selector: str | None = None
    service: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    kubeconfig: Path | None = None
    scheme: Literal["http", "https"] = "http"
    resync_s: PosFloat = 300.0
    retry_max_s: PosFloat = 30.0
    pool_check_s: PosFloat = 10.0
    kv_events_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    kv_replay_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    worker: dict[str, Any] = Field(default_factory=dict)

    @field_validator("worker")
    @classmethod
    def _check_worker(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = [k for k in DISCOVERED_FIELDS if k in value]
        if taken:
            raise ValueError(f"{', '.join(taken)}: filled in by discovery, not configurable")
        try:
            WorkerConfig.model_validate({**value, "url": "http://discovered:1"})
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{field}: {err['msg'].removeprefix('Value error, ')}") from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryConfig:
        sources = [n for n in ("pool", "selector", "service") if getattr(self, n) is not None]
        if self.kind == "static":
            if sources:
                raise ValueError(f"{sources[0]} is set: it needs kind: kubernetes")
            return self
        if len(sources) != 1:
            found = ", ".join(sources) or "none"
            raise ValueError(f"kind kubernetes needs one of pool, selector, service ({found})")
        if self.selector is not None and self.port is None:
            raise ValueError("selector needs port (the engines' port in the pods)")
        return self


def discovery_spec(spec: str) -> dict[str, Any]:
    """The ``discovery:`` fields a ``--discover`` value sets (forms: ``DISCOVERY_SPEC_FORMS``).

    ``k8s:llm/app=vllm:8000`` watches the pods ``app=vllm`` of namespace
    ``llm`` (port 8000); ``k8s-pool:llm/vllm-pool`` the pods of that
    InferencePool; ``k8s-service:llm/vllm`` the Service's EndpointSlices.
    ``static`` turns discovery off. A label selector never holds ``:``, so a
    trailing ``:PORT`` is unambiguous.

    Raises:
        ValueError: Not one of the forms (the message lists them).
    """
    if spec == "static":
        return {"kind": "static", "pool": None, "selector": None, "service": None}
    forms = ", ".join(DISCOVERY_SPEC_FORMS)
    scheme, sep, rest = spec.partition(":")
    field = {"k8s": "selector", "k8s-pool": "pool", "k8s-service": "service"}.get(scheme)
    namespace, slash, target = rest.partition("/")
    if not sep or field is None or not slash or not namespace or not target:
        raise ValueError(f"{spec!r} is not one of {forms}, static")
    port: int | None = None
    head, colon, tail = target.rpartition(":")
    if colon:
        if not tail.isdigit() or not 0 < int(tail) < 65536 or not head:
            raise ValueError(f"{spec!r}: the port after ':' must be a number from 1 to 65535")
        target, port = head, int(tail)
    data: dict[str, Any] = {"kind": "kubernetes", "namespace": namespace}
    data.update({"pool": None, "selector": None, "service": None, field: target})
    if port is not None:
        data["port"] = port
    return data


class AffinityConfig(_Model):
    """Session affinity (:mod:`prefixrouter.core.affinity`): a conversation stays on its worker.

    A request that names its session in ``header`` goes to the worker that
    served the session's last turn while that worker is routable, the index
    says it still holds at least ``min_cached_share`` of the last turn's
    prompt, and its predicted queue wait is at most ``max_wait_s``; otherwise
    the normal decision runs and the pin moves to where the turn is served.
    Decisions carry ``affinity`` (``hit`` or why the pin broke) and tier
    ``affinity`` when it held; ``prefixrouter_affinity_total{result}`` counts
    them. With a rollout, only the ``prefix`` group is pinned.

    Attributes:
        enabled: Read the header (off: it is ignored).
        header: The request header that names the session (scoped per tenant).
        max_sessions: Pins kept; the least recently used session goes first.
        min_cached_share: Share of the session's last prompt the worker must
            still hold (per the index) for the pin to hold.
        max_wait_s: Longest predicted queue wait on the pinned worker; past
            it the policy decides (it weighs the wait against a copy's prefill).
    """

    enabled: bool = True
    header: str = "X-Session-ID"
    max_sessions: PosInt = 100_000
    min_cached_share: Annotated[float, Field(ge=0, le=1)] = 0.5
    max_wait_s: Annotated[float, Field(ge=0)] = 4.0

    @field_validator("header")
    @classmethod
    def _check_header(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError("must be a header name (letters, digits, '-', '_')")
        return value


class RolloutConfig(_Model):
    """One-class rollout (:mod:`prefixrouter.core.rollout`): prefix routing for a part of traffic.

    With ``enabled``, a request is routed by the configured policy (group
    ``prefix``) when its prefix class (``X-Prefix-Class``, else inferred) is
    in ``classes`` or, else, when its session id or prefix key hashes into
    ``share``; every other request is routed by ``baseline_policy`` (group
    ``baseline``). The same document or session always lands in the same
    group. Metrics set the groups side by side:
    ``prefixrouter_rollout_requests_total{group,prefix_class}``,
    ``prefixrouter_rollout_ttft_seconds{group}`` and
    ``prefixrouter_rollout_input_tokens_total{group,kind}`` (cached / uncached).

    Attributes:
        enabled: Split the traffic (off: every request is routed by prefix).
        classes: Prefix classes routed by prefix (``system``, ``document``,
            ``session``, ``rag``, ``unknown``).
        share: Share (0-1) of the other requests routed by prefix.
        baseline_policy: The other requests' policy (``round_robin``,
            ``least_loaded`` or any registered cache-blind one).
        prefix_pool: Worker pool the ``prefix`` group may use (None: any).
        baseline_pool: Worker pool the ``baseline`` group may use (None: any).
        seed: Salt of the share's hash: another seed draws another share.
    """

    enabled: bool = False
    classes: list[str] = Field(default_factory=list)
    share: Annotated[float, Field(ge=0, le=1)] = 0.0
    baseline_policy: str = "round_robin"
    prefix_pool: str | None = None
    baseline_pool: str | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] = 0

    @field_validator("classes")
    @classmethod
    def _check_classes(cls, value: list[str]) -> list[str]:
        from prefixrouter.core.types import PrefixClass

        known = {c.value for c in PrefixClass}
        bad = [c for c in value if c not in known]
        if bad:
            raise ValueError(f"unknown prefix class {bad[0]!r}; known: {', '.join(sorted(known))}")
        return value

    @field_validator("baseline_policy")
    @classmethod
    def _check_policy(cls, name: str) -> str:
        from prefixrouter.core.policy import canonical_policy_name, create_policy

        try:
            create_policy(name)
        except PrefixRouterError as exc:
            raise ValueError(str(exc)) from None
        return canonical_policy_name(name)


class DriftConfig(_Model):
    """The drift alarm (:mod:`prefixrouter.core.drift`), fed by every completed request.

    Per prefix class, a request the router predicted at least ``min_tokens``
    cached tokens for is *divergent* when the engine reused less than the
    prediction by more than ``max(min_tokens, rel_tolerance * predicted)``.
    The alarm fires when at least ``fire_share`` of the class's last
    ``window`` such requests (at least ``min_samples``) are divergent, and
    clears after ``clear_after`` agreeing ones in a row.
    ``prefixrouter_drift_alarm{prefix_class}`` is 1 while it fires;
    ``prefixrouter_drift_alarms_total{prefix_class}`` counts firings; each
    firing logs one warning naming the class, the template version and the
    first divergent position.

    Attributes:
        enabled: Watch predictions (off: no alarm and no series).
        min_tokens: Predictions below this are not compared.
        rel_tolerance: Shortfall share of the prediction that is divergent.
        window: Requests per class the rule looks at.
        min_samples: Requests needed before the alarm can fire.
        fire_share: Divergent share of the window that fires it.
        clear_after: Agreeing requests in a row that clear it.
    """

    enabled: bool = True
    min_tokens: PosInt = 64
    rel_tolerance: Annotated[float, Field(ge=0, lt=1)] = 0.5
    window: PosInt = 10
    min_samples: PosInt = 4
    fire_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    clear_after: PosInt = 4

    @model_validator(mode="after")
    def _samples_fit(self) -> DriftConfig:
        if self.min_samples > self.window:
            raise ValueError(f"min_samples ({self.min_samples}) exceeds window ({self.window})")
        return self


class GatewayConfig(_Model):
    """The whole gateway configuration; every field has a default.

    Tenancy (see :mod:`prefixrouter.gateway.tenancy`):

    Attributes:
        api_keys: Client API key -> tenant. Once any key is configured, an
            unknown key is a 401. Surrounding whitespace of a key is removed,
            as clients' bearer tokens are read without it.
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
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    metrics_poll: MetricsPollConfig = Field(default_factory=MetricsPollConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    decision_log: DecisionLogConfig = Field(default_factory=DecisionLogConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    drift: DriftConfig = Field(default_factory=DriftConfig)
    overload: OverloadConfig = Field(default_factory=OverloadConfig)
    access_log: AccessLogConfig = Field(default_factory=AccessLogConfig)

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

    @field_validator("tenants")
    @classmethod
    def _no_reserved_tenant(cls, value: dict[str, TenantRule]) -> dict[str, TenantRule]:
        if OTHER_TENANTS in value:
            raise ValueError(f"{OTHER_TENANTS!r} is reserved: {RESERVED_WHY}")
        return value

    @field_validator("api_keys")
    @classmethod
    def _strip_api_keys(cls, value: dict[str, str]) -> dict[str, str]:
        # A key pasted with a newline would never match a client's bearer
        # token, which is read without surrounding whitespace.
        out: dict[str, str] = {}
        for key, tenant in value.items():
            bare = key.strip()
            if not bare:
                raise ValueError(f"an empty key (tenant {tenant!r})")
            if bare in out:
                raise ValueError(f"two keys differ only in surrounding whitespace ({tenant!r}'s)")
            if tenant == OTHER_TENANTS:
                raise ValueError(f"tenant {OTHER_TENANTS!r} is reserved: {RESERVED_WHY}")
            out[bare] = tenant
        return out

    @model_validator(mode="after")
    def _admin_key_is_no_tenants_key(self) -> GatewayConfig:
        # Else that tenant's clients could add and remove workers and read
        # every tenant's decisions.
        tenant = self.api_keys.get(self.server.admin_api_key or "")
        if tenant is not None:
            raise FieldAt(
                f"equals the API key of tenant {tenant!r}: a tenant's key must never open "
                "the admin API",
                ("server", "admin_api_key"),
            )
        return self

    @model_validator(mode="after")
    def _unique_worker_ids(self) -> GatewayConfig:
        # Each error names the second worker's own field (FieldAt), so the
        # message points at the line of the duplicate, not at the document.
        ids: dict[str, int] = {}
        for i, w in enumerate(self.workers):
            if (first := ids.setdefault(w.id, i)) != i:
                # Two engines behind one reverse proxy share the default id
                # (host:port): the fix is an id of their own.
                defaults = {default_worker_id(self.workers[j].url) for j in (first, i)}
                hint = ": engines at one host:port need an id each (set `id`)"
                hint = hint if defaults == {w.id} and self.workers[first].url != w.url else ""
                raise FieldAt(
                    f"duplicate worker id {w.id!r} (also workers.{first}.id){hint}",
                    ("workers", i, "id"),
                )
        topics: dict[str | None, int] = {}
        for i, w in enumerate(self.workers):
            if (first := topics.setdefault(w.kv_events_topic, i)) != i:
                raise FieldAt(
                    f"duplicate kv_events_topic {w.kv_events_topic!r} (also worker "
                    f"{self.workers[first].id!r}'s)",
                    ("workers", i, "kv_events_topic"),
                )
        publishers: dict[str, int] = {}
        for i, w in enumerate(self.workers):
            if w.kv_events_connect is None:
                continue
            # Two spellings of one socket (ipc://d/./e.ipc, tcp://localhost:P) are one publisher.
            if (first := publishers.setdefault(endpoint_key(w.kv_events_connect), i)) != i:
                # Two connections to one PUB socket would deliver each message twice.
                raise FieldAt(
                    f"duplicate kv_events_connect {w.kv_events_connect!r} (also worker "
                    f"{self.workers[first].id!r}'s)",
                    ("workers", i, "kv_events_connect"),
                )
        engines: dict[tuple[str, str, int, str], int] = {}
        for i, w in enumerate(self.workers):
            if (first := engines.setdefault(engine_key(w.url), i)) != i:
                # One engine counted as two workers: twice its capacity, its cache index split.
                raise FieldAt(
                    f"workers {self.workers[first].id!r} and {w.id!r} have the same engine "
                    f"({w.url}): one engine must be one worker",
                    ("workers", i, "url"),
                )
        return self

    @property
    def kv_events_on(self) -> bool:
        """The gateway subscribes to KV events: it binds, or some worker's engine is connected.

        (A discovered worker's engine too, with ``discovery.kv_events_port``.)
        """
        d = self.discovery
        return (
            self.kv_events.endpoint is not None
            or any(w.kv_events_connect is not None for w in self.workers)
            or (d.kind == "kubernetes" and d.kv_events_port is not None)
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
            cause = err.get("ctx", {}).get("error")
            if isinstance(cause, FieldAt):
                loc += cause.loc
            field = ".".join(str(p) for p in loc) or "(top level)"
            line = _line_of(node, loc)
            where = f"{source}:{line}" if line else source
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {field}: {msg}")
        raise ConfigError("\n".join(lines)) from None


def load_config(
    path: Path | str, overlay: Callable[[dict[str, Any]], None] | None = None
) -> GatewayConfig:
    """Read and validate a YAML configuration file.

    ``overlay`` changes the file's mapping before it is validated: a
    command-line option that completes a section the file leaves unfinished
    (``--discover`` giving the source of ``discovery: {kind: kubernetes}``).

    Raises:
        ConfigError: Unreadable file, invalid YAML or invalid fields; the message
            names the file, the line and the field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(unreadable(path, exc)) from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    duplicate = _duplicate_key(node)
    if duplicate is not None:
        line, field, first = duplicate
        raise ConfigError(
            f"{path}:{line}: {field}: duplicate key (also on line {first}; "
            "YAML would silently keep only the last)"
        )
    if overlay is not None and isinstance(data, dict):
        overlay(data)
    return config_from_dict(data, str(path), node)


def _duplicate_key(
    node: yaml.Node | None, path: tuple[str, ...] = (), seen: set[int] | None = None
) -> tuple[int, str, int] | None:
    """The first key a YAML mapping repeats: (its line, its dotted field, the first one's line).

    PyYAML keeps a repeated key's last value without a word, so a second
    ``workers:`` section would quietly replace the first.
    """
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:  # an alias reuses a node: walk it once
        return None
    seen.add(id(node))
    children: list[tuple[yaml.Node, tuple[str, ...]]] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.value == "<<":  # a merge key
                continue
            line = key.start_mark.line + 1
            if key.value in lines:
                return line, ".".join((*path, key.value)), lines[key.value]
            lines[key.value] = line
            children.append((value, (*path, key.value)))
    elif isinstance(node, yaml.SequenceNode):
        children = [(item, (*path, str(i))) for i, item in enumerate(node.value)]
    for child, child_path in children:
        found = _duplicate_key(child, child_path, seen)
        if found is not None:
            return found
    return None


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
