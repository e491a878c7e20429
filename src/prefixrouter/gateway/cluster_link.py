"""The gateway's side of the cluster: its configuration fingerprint and its node.

:func:`fingerprint_fields` lists, as canonical text, every setting that
decides what a request's block hashes are (see
:mod:`prefixrouter.cluster.fingerprint`): replicas that differ in one of
them would name different prefixes by the same hash, so a starting replica
that differs from a live peer is refused with the field named, and running
replicas drop the facts of one that differs. Settings that only change *how*
a replica routes (the policy, timeouts, the workers it has) may differ: facts
for workers a replica does not have are dropped one by one.

Left out, because a difference never gives one request two meanings:

* the models the workers list: a request's namespace takes the model the
  *request* names; only whether a name is a LoRA adapter enters it
  (``workers.adapters``, the configured ones);
* ``api_keys`` and ``trust_tenant_header``: they decide *which* tenant a
  request is, and each replica hashes it in that tenant's namespace with
  that tenant's rule (``tenants``, ``default_tenant``: those are in). A key
  two replicas map to different tenants gets a namespace on each that the
  other never predicts warm: sharing lost for that key, isolation kept. So
  a rolling update may add a client's key.

Secrets (tenants' salts, ``salt_secret``) enter only as digests.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Callable

import orjson

from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.node import ClusterNode, NodeOptions
from prefixrouter.cluster.transport import LinkOptions
from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.types import WorkerId
from prefixrouter.errors import ConfigError, unreadable
from prefixrouter.gateway.config import GatewayConfig


def _text(value: object) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str).decode()


def fingerprint_fields(config: GatewayConfig, tokenizer_revision: str) -> dict[str, str]:
    """Field name -> canonical text of what must agree across replicas (module doc).

    Args:
        config: The gateway's configuration.
        tokenizer_revision: The namespace's tokenizer revision as the request
            builder uses it (the configured one, else the loaded tokenizer's).
    """
    r = config.routing
    adapters = sorted({a for w in config.workers for a in w.adapters})
    tenants = {
        name: {"share_cache": rule.share_cache, "cache_salt": rule.cache_salt}
        for name, rule in config.tenants.items()
    }
    default = config.default_tenant
    return {
        "routing.mode": r.mode,
        "routing.chunk_chars": str(r.chunk_chars) if r.mode == "text" else "",
        "routing.block_size": str(r.block_size) if r.mode == "token" else "",
        # In the namespace in both modes (text mode hashes characters under it too).
        "routing.tokenizer": tokenizer_revision,
        "routing.template_version": r.template_version,
        "routing.prefix_key_tokens": str(r.prefix_key_tokens),
        "routing.max_prompt_tokens": str(r.max_prompt_tokens),
        "workers.adapters": _text(adapters),
        "tenants": _text(tenants),
        "default_tenant": _text({"share_cache": default.share_cache, "salt": default.cache_salt}),
        "salt_secret": config.salt_secret,
    }


def replica_id(config: GatewayConfig) -> str:
    """The configured replica id, else ``HOSTNAME:PORT`` (``HOSTNAME:pidPID`` on port 0:
    the port is chosen at bind time, and two such gateways on one host must differ)."""
    if config.cluster.replica_id:
        return config.cluster.replica_id
    port = config.server.port
    return f"{socket.gethostname()}:{port if port else f'pid{os.getpid()}'}"


def tls_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The TLS context ``cluster.tls_*`` ask for (None: none set).

    Raises:
        ConfigError: A file cannot be read or holds no usable certificate or key.
    """
    c = config.cluster
    if c.tls_ca_file is None and c.tls_cert_file is None:
        return None
    field, path = "cluster.tls_ca_file", c.tls_ca_file
    try:
        ctx = ssl.create_default_context(cafile=str(path) if path is not None else None)
        if c.tls_cert_file is not None:
            field, path = "cluster.tls_cert_file", c.tls_cert_file
            key = str(c.tls_key_file) if c.tls_key_file is not None else None
            ctx.load_cert_chain(str(c.tls_cert_file), key)
    except OSError as exc:  # ssl.SSLError is one: a file that is not PEM, a key that does not fit
        raise ConfigError(f"{field}: {unreadable(path, exc) if path else exc}") from None
    return ctx


def build_node(
    config: GatewayConfig,
    dispatch: Dispatcher,
    has_worker: Callable[[WorkerId], bool],
    tokenizer_revision: str,
    clock: Callable[[], float],
    observe_lag: Callable[[float], None],
) -> ClusterNode:
    """The cluster node of a gateway whose ``cluster.url`` is set."""
    c = config.cluster
    if c.url is None:
        raise ValueError("cluster.url is not set")
    link = LinkOptions(
        url=c.url,
        cluster=c.name,
        stream=c.stream,
        max_age_s=c.max_age_s,
        max_bytes=c.max_bytes,
        tls=tls_context(config),
    )
    options = NodeOptions(
        link=link,
        replica_id=replica_id(config),
        heartbeat_s=c.heartbeat_s,
        peer_ttl_s=c.peer_ttl_s,
        batch_window_s=c.batch_window_s,
        max_batch_window_s=max(c.batch_window_s, c.max_batch_window_s),
        apply_within_s=c.apply_within_s,
        ready_without_nats_s=c.ready_without_nats_s,
        # No request is in flight at its origin longer than its request timeout.
        max_open_s=config.proxy.request_timeout_s + c.peer_ttl_s,
    )
    fp = Fingerprint.of(fingerprint_fields(config, tokenizer_revision))
    return ClusterNode(options, dispatch, has_worker, fp, clock, observe_lag)
