"""``prefixrouter epp``: run the endpoint picker (``python -m prefixrouter.epp`` too).

The configuration is the gateway's (``--config`` file, ``--worker URL``,
``--policy``, tenants, KV events, cluster: the options are ``serve``'s own,
shared from :mod:`prefixrouter.gateway.cli`). ``--port`` is the ext_proc gRPC
port Envoy connects to (the extension's default, 9002), ``--http-port`` the
port of ``/metrics``, ``/admin/*`` and ``/health`` (``server.port``).
``--fallbacks N`` names up to N more endpoints after the pick, in the
``envoy.lb`` metadata only (for data planes that retry down the list, such
as Envoy's ``override_host`` load-balancing policy); the destination header
holds the pick alone, as Envoy's ``ORIGINAL_DST`` cluster (the shipped
bootstrap's) needs: it cannot use fallbacks. Worker URLs should name IP
addresses: Envoy connects to the picked ``IP:PORT`` as given.

SIGTERM (or SIGINT) drains (:meth:`~prefixrouter.epp.server.Running.drain`):
not ready at once, new requests refused with a 503, open streams given
``--shutdown-grace-s`` (default :data:`DEFAULT_SHUTDOWN_GRACE_S`) to finish;
the Deployment's ``terminationGracePeriodSeconds`` must exceed it.

The first lines printed are ``prefixrouter epp listening on grpc://HOST:PORT``
and ``prefixrouter epp http on http://HOST:PORT``. Errors the user can fix
print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import sys
from pathlib import Path
from typing import Annotated

import typer

from prefixrouter.errors import PrefixRouterError, unreadable
from prefixrouter.gateway.cli import (
    DEFAULT_HOST,
    DEFAULT_POLICY,
    AdminKeyOption,
    ClusterOption,
    ConfigOption,
    DecisionLogOption,
    DiscoverOption,
    HostOption,
    LogLevel,
    LogLevelOption,
    PolicyOption,
    ProfileOption,
    ReplicaIdOption,
    WorkerOption,
    build_config,
    start_logging,
    stop_on_signals,
    warn_about,
)
from prefixrouter.gateway.config import GatewayConfig
from prefixrouter.terminal import fail

DEFAULT_GRPC_PORT = 9002
DEFAULT_HTTP_PORT = 9090
DEFAULT_SHUTDOWN_GRACE_S = 30.0
"""Long enough for most completions to finish; a longer stream is cut off (its client retries)."""


async def run_picker(
    config: GatewayConfig,
    grpc_host: str,
    grpc_port: int,
    fallbacks: int,
    tls: tuple[bytes, bytes] | None = None,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
) -> None:
    """Serve until SIGINT or SIGTERM, then drain (``tls``: certificate chain and key, PEM)."""
    from prefixrouter.epp.server import start_picker

    running = await start_picker(config, grpc_host, grpc_port, fallbacks, tls)
    gc.collect()
    gc.freeze()  # what lives as long as the process stays out of full collections
    stop = stop_on_signals("endpoint picker")  # before the lines a supervisor may act on
    scheme = "grpcs" if tls is not None else "grpc"
    print(f"prefixrouter epp listening on {scheme}://{grpc_host}:{running.grpc_port}", flush=True)
    print(f"prefixrouter epp http on http://{config.server.host}:{running.http_port}", flush=True)
    try:
        await stop.wait()
    except BaseException:  # cancelled: no drain
        await running.stop()
        raise
    await running.drain(shutdown_grace_s)


def _pem(path: Path, kind: str) -> bytes:
    """The PEM file at ``path``, which must hold a ``kind`` block; else one line and exit 2.

    grpcio reads a bad certificate or key only when the port is bound, and
    says no more than "Failed to add port": the file is checked here.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise fail(unreadable(path, exc)) from None
    if b"-----BEGIN " not in data or kind.encode() not in data:
        raise fail(f"{path}: not a PEM file holding a {kind.lower()}")
    return data


def _not_ip(config: GatewayConfig) -> list[str]:
    out = []
    for w in config.workers:
        host = w.url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            out.append(w.url)
    return out


def epp(
    config: ConfigOption = None,
    worker: WorkerOption = None,
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="ext_proc gRPC port (0: any free port).")
    ] = DEFAULT_GRPC_PORT,
    http_port: Annotated[
        int,
        typer.Option(min=0, max=65535, help="Port of /metrics, /admin/*, /health (0: any)."),
    ] = DEFAULT_HTTP_PORT,
    host: HostOption = DEFAULT_HOST,
    decision_log: DecisionLogOption = None,
    policy: PolicyOption = DEFAULT_POLICY,
    admin_api_key: AdminKeyOption = None,
    cluster: ClusterOption = None,
    replica_id: ReplicaIdOption = None,
    discover: DiscoverOption = None,
    fallbacks: Annotated[
        int,
        typer.Option(
            min=0,
            max=8,
            help="More endpoints after the pick, in the envoy.lb metadata (not the header): "
            "for data planes that retry down the list (not ORIGINAL_DST).",
        ),
    ] = 0,
    profile: ProfileOption = None,
    log_level: LogLevelOption = LogLevel.info,
    tls_cert_file: Annotated[
        Path | None,
        typer.Option(
            help="Serve the gRPC port with TLS: this PEM certificate chain (with "
            "--tls-key-file). Without both, plaintext HTTP/2 (h2c).",
        ),
    ] = None,
    tls_key_file: Annotated[
        Path | None, typer.Option(help="The private key (PEM) of --tls-cert-file.")
    ] = None,
    shutdown_grace_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="On SIGTERM: seconds the open requests get to finish (new ones get 503).",
        ),
    ] = DEFAULT_SHUTDOWN_GRACE_S,
) -> None:
    """Run the endpoint picker: Envoy's ext_proc server, routing as the gateway does."""
    start_logging(log_level)
    if (tls_cert_file is None) != (tls_key_file is None):
        raise fail("--tls-cert-file and --tls-key-file go together")
    tls: tuple[bytes, bytes] | None = None
    if tls_cert_file is not None and tls_key_file is not None:
        tls = (_pem(tls_cert_file, "CERTIFICATE"), _pem(tls_key_file, "PRIVATE KEY"))
    try:
        cfg = build_config(
            config,
            worker,
            http_port,
            host,
            decision_log,
            policy,
            admin_api_key,
            cluster,
            replica_id,
            discover,
            profile=profile,
            port_default=DEFAULT_HTTP_PORT,
        )
    except PrefixRouterError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    warn_about(cfg)
    for url in _not_ip(cfg):
        typer.echo(f"warning: worker {url} is not an IP address: Envoy needs IP:PORT", err=True)
    try:
        # asyncio's own loop: grpcio's asyncio server supports no other.
        asyncio.run(run_picker(cfg, host, port, fallbacks, tls, shutdown_grace_s))
    except (PrefixRouterError, RuntimeError) as exc:  # ListenError, a gRPC port in use
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


def main(argv: list[str] | None = None) -> None:
    """``python -m prefixrouter.epp``: the ``epp`` command on its own."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(epp)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="prefixrouter-epp")
