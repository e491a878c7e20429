"""``prefixrouter serve``: run the gateway (uvloop, one process).

Configuration comes from a YAML file (``--config``, see
:mod:`prefixrouter.gateway.config`); command-line options override it when they
differ from their defaults: ``--worker URL`` (repeatable) adds workers,
``--port``/``--host`` set the listen address, ``--decision-log`` the JSON-lines
file, ``--access-log`` the access log's (:mod:`prefixrouter.gateway.access_log`),
``--policy`` the routing policy (its parameters then come from the file only
if the names match), ``--profile`` the engine speed profile the cost model
starts every worker from (``policy.profile``), ``--admin-api-key`` (or the environment variable
``PREFIXROUTER_ADMIN_API_KEY``; prefer it, a command line is visible to every
local user) the key of ``/admin/*``, which are off without one, and
``--cluster nats://HOST:PORT`` with ``--replica-id NAME`` make this gateway
one of several active-active replicas (the ``cluster:`` section; see
:mod:`prefixrouter.cluster`), and ``--discover k8s:NAMESPACE/SELECTOR``
(or ``k8s-pool:``, ``k8s-service:``) finds the workers in a Kubernetes
cluster (the ``discovery:`` section; see :mod:`prefixrouter.discovery`;
:data:`DiscoverOption` is the option, for other commands). Port 0 picks
a free port; the first line printed on stdout is ``prefixrouter gateway
listening on http://HOST:PORT``, so scripts can read the port.

Errors the user can fix (a bad file, a bad worker URL, a port in use) print
one line on stderr and exit with status 2.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from prefixrouter.core.policy import alias_note, canonical_policy_name
from prefixrouter.errors import ConfigError, PrefixRouterError
from prefixrouter.gateway.config import (
    DISCOVERY_SPEC_FORMS,
    GatewayConfig,
    WorkerConfig,
    config_from_dict,
    discovery_spec,
    load_config,
)

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"
DEFAULT_POLICY = "prefix_aware"
ADMIN_KEY_ENV = "PREFIXROUTER_ADMIN_API_KEY"

log = logging.getLogger("prefixrouter.gateway")


DiscoverOption = Annotated[
    str | None,
    typer.Option(
        "--discover",
        help="Find the workers in Kubernetes and follow them: "
        + ", ".join(DISCOVERY_SPEC_FORMS)
        + " (pods of a label selector, of an InferencePool, or a Service's EndpointSlices), "
        "or static. Overrides the discovery: section's kind, namespace and source.",
    ),
]
"""The ``--discover`` option (``serve`` and the endpoint picker share it)."""


def apply_discover(data: dict[str, Any], discover: str | None) -> None:
    """Put a ``--discover`` value into a configuration's ``discovery`` mapping.

    Raises:
        ConfigError: Not one of the forms, naming ``--discover``.
    """
    if discover is None:
        return
    section = data.get("discovery")
    if section is not None and not isinstance(section, dict):
        return  # not a mapping: its validation names it
    try:
        data["discovery"] = {**(section or {}), **discovery_spec(discover)}
    except ValueError as exc:
        raise ConfigError(f"--discover: {exc}") from None


class ClusterRefused(PrefixRouterError):
    """The replica's configuration differs from a live peer's (the message names the field)."""


def build_config(
    config: Path | None,
    worker: list[str] | None,
    port: int,
    host: str,
    decision_log: Path | None,
    policy: str,
    admin_api_key: str | None = None,
    cluster: str | None = None,
    replica_id: str | None = None,
    discover: str | None = None,
    access_log: Path | None = None,
    profile: str | None = None,
    port_default: int = DEFAULT_PORT,
) -> GatewayConfig:
    """The configuration the options describe (file first, options over it).

    ``port_default`` is the command's own default port: an option left at its
    default gives way to a port the file sets (``epp``'s HTTP port is 9090).

    Raises:
        ConfigError: Invalid file or option, naming the field.
    """
    if config is not None:
        # --discover completes the file's discovery section before it is validated.
        cfg = load_config(config, lambda raw: apply_discover(raw, discover))
    else:
        cfg = GatewayConfig()
    data = cfg.model_dump(mode="python", exclude_unset=False)
    if worker:
        data["workers"] = [*data["workers"], *({"url": u} for u in worker)]
    if port != port_default or "port" not in cfg.server.model_fields_set:
        data["server"]["port"] = port
    if host != DEFAULT_HOST or config is None:
        data["server"]["host"] = host
    if decision_log is not None:
        data["decision_log"]["path"] = decision_log
    name = canonical_policy_name(policy)  # a deprecated alias names the same policy
    if name != data["policy"]["name"] and (policy != DEFAULT_POLICY or config is None):
        data["policy"] = {"name": name, "params": {}}
    note = alias_note(policy)
    if note is not None:
        log.warning("--policy: %s", note)
    if profile is not None:
        data["policy"]["profile"] = profile
    if admin_api_key:
        data["server"]["admin_api_key"] = admin_api_key
    if cluster is not None:
        data["cluster"]["url"] = cluster
    if replica_id is not None:
        data["cluster"]["replica_id"] = replica_id
    apply_discover(data, discover)
    if access_log is not None:
        data["access_log"]["path"] = access_log
    source = str(config) if config is not None else "command line"
    return config_from_dict(data, source)


def stop_on_signals(process: str) -> asyncio.Event:
    """An event set by SIGINT or SIGTERM; SIGHUP is logged and ignored.

    SIGHUP is the usual "reload your configuration" signal, and by default it
    ends a process at once, without the drain SIGTERM gets. There is no
    reload: the configuration is read at start, so the signal says so and
    the process keeps serving. Call it from the running event loop.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(
        signal.SIGHUP,
        log.warning,
        "SIGHUP ignored: the %s does not reload its configuration; restart it to apply "
        "changes (SIGTERM stops it after its requests finish)",
        process,
    )
    return stop


async def run_gateway(config: GatewayConfig, announce: bool = True) -> None:
    """Serve until SIGINT or SIGTERM (with ``limits``: :mod:`prefixrouter.gateway.server`).

    Args:
        config: The configuration.
        announce: Print the listening line on stdout.

    Raises:
        ListenError: The address cannot be bound (in use, say).
    """
    from prefixrouter.gateway.app import create_app
    from prefixrouter.gateway.server import start_server
    from prefixrouter.gateway.state import STATE

    app = create_app(config)
    state = app[STATE]
    srv = config.server
    listening = await start_server(app, srv.host, srv.port, config.limits)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(config.limits.gil_switch_interval_s)
    runner = listening.runner
    # Everything allocated so far (modules, config, the app) lives as long as
    # the process: keep it out of the cyclic collector's full scans.
    gc.collect()
    gc.freeze()
    stop = stop_on_signals("gateway")  # before the line a supervisor may act on
    if announce:
        print(f"prefixrouter gateway listening on http://{srv.host}:{listening.port}", flush=True)
    loop = asyncio.get_running_loop()
    waits = [loop.create_task(stop.wait())]
    node = state.cluster
    if node is not None:  # a replica that may not join exits (ClusterRefused)
        waits.append(loop.create_task(node.failed.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await runner.cleanup()
        sys.setswitchinterval(switch_interval)
    if node is not None and node.error is not None:
        raise ClusterRefused(node.error)


def _run(coro_config: GatewayConfig) -> None:
    try:
        import uvloop

        uvloop.run(run_gateway(coro_config))
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        asyncio.run(run_gateway(coro_config))


# The options ``serve`` shares with ``prefixrouter epp`` (one definition each).
ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML configuration file.")
]
WorkerOption = Annotated[
    list[str] | None,
    typer.Option(
        "--worker", "-w", help="Worker base URL (repeatable), e.g. http://127.0.0.1:8001."
    ),
]
HostOption = Annotated[str, typer.Option(help="Listen address.")]
DecisionLogOption = Annotated[
    Path | None, typer.Option(help="Append the decision log (JSON lines) to this file.")
]
AccessLogOption = Annotated[
    Path | None,
    typer.Option(help="Append the access log (one JSON line per request) to this file."),
]
PolicyOption = Annotated[str, typer.Option(help="Routing policy (see `prefixrouter policies`).")]
ProfileOption = Annotated[
    str | None,
    typer.Option(
        help="Engine speed profile the cost model predicts the workers with (see "
        "`prefixrouter profiles`; default: a generic one). Overrides policy.profile.",
    ),
]
AdminKeyOption = Annotated[
    str | None,
    typer.Option(
        envvar=ADMIN_KEY_ENV,
        show_envvar=True,
        help="Key of the /admin/* endpoints (Authorization: Bearer KEY); "
        "without one they answer 403. Overrides server.admin_api_key.",
    ),
]
ClusterOption = Annotated[
    str | None,
    typer.Option(
        help="NATS server of the replicas (nats://HOST:PORT, JetStream on): share "
        "routing facts with the other gateways. Overrides cluster.url.",
    ),
]


class LogLevel(StrEnum):
    """How much the log on stderr says."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


LogLevelOption = Annotated[
    LogLevel,
    typer.Option(
        envvar="PREFIXROUTER_LOG_LEVEL",
        show_envvar=True,
        case_sensitive=False,
        help="What the log on stderr says: info tells workers added, removed, down and "
        "back, discovery and cluster changes (never one line a request).",
    ),
]
ReplicaIdOption = Annotated[
    str | None,
    typer.Option(
        help="This replica's id, stable across restarts (default HOSTNAME:PORT). "
        "Overrides cluster.replica_id.",
    ),
]


def start_logging(level: LogLevel) -> None:
    """Log to stderr, one timestamped line an event: this package at ``level``, others
    (aiohttp, nats-py, grpcio) at warning.

    Without it Python prints only warnings and errors, bare, and every info line
    (a worker back from an outage, a pod added by discovery) is lost.
    """
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("prefixrouter").setLevel(level.value.upper())


def serve(
    config: ConfigOption = None,
    worker: WorkerOption = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Listen port (0: any free port).")] = (
        DEFAULT_PORT
    ),
    host: HostOption = DEFAULT_HOST,
    decision_log: DecisionLogOption = None,
    access_log: AccessLogOption = None,
    policy: PolicyOption = DEFAULT_POLICY,
    admin_api_key: AdminKeyOption = None,
    cluster: ClusterOption = None,
    replica_id: ReplicaIdOption = None,
    discover: DiscoverOption = None,
    profile: ProfileOption = None,
    log_level: LogLevelOption = LogLevel.info,
) -> None:
    """Run the OpenAI-compatible gateway in front of the workers."""
    start_logging(log_level)
    try:
        cfg = build_config(
            config,
            worker,
            port,
            host,
            decision_log,
            policy,
            admin_api_key,
            cluster,
            replica_id,
            discover,
            access_log,
            profile,
        )
    except PrefixRouterError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    warn_about(cfg)
    try:
        _run(cfg)
    except PrefixRouterError as exc:  # ListenError, ClusterRefused: one line
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


def warn_about(cfg: GatewayConfig) -> None:
    """Warnings of a configuration that runs but is likely not what was meant (stderr)."""
    isolated = not cfg.default_tenant.share_cache or any(
        not rule.share_cache and rule.cache_salt is None for rule in cfg.tenants.values()
    )
    if isolated and not cfg.salt_secret:
        typer.echo(
            "warning: salt_secret is empty: the cache_salt of a tenant that does not share "
            "its cache can be derived from its name by anyone who reaches the engines "
            "directly; set salt_secret (the same on every gateway in front of them)",
            err=True,
        )
    if cfg.kv_events_on and cfg.routing.mode != "token":
        # Events name token blocks; text mode's prefixes are character chunks, so
        # none can match, and they take the index's room from the router's own.
        typer.echo(
            "warning: KV events with routing.mode: text: their token blocks never match "
            "text mode's prefixes and take the index's room from the router's own entries "
            "(routing gets worse); set routing.mode: token with the engines' tokenizer, or "
            "drop the KV-event settings",
            err=True,
        )
    if not cfg.workers and cfg.discovery.kind == "static":
        hint = "" if cfg.server.admin_api_key else f" (after setting {ADMIN_KEY_ENV})"
        typer.echo(f"warning: no workers yet; add them with POST /admin/workers{hint}", err=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m prefixrouter.gateway``: the ``serve`` command on its own."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="prefixrouter-gateway")


__all__ = [
    "DiscoverOption",
    "WorkerConfig",
    "apply_discover",
    "build_config",
    "main",
    "run_gateway",
    "serve",
]
