"""The gateway's side of the cluster: its configuration fingerprint and its node.

:func:`fingerprint_fields` lists, as canonical text, every setting that
decides what a request's block hashes are (see
:mod:`prefixrouter.cluster.fingerprint`): replicas that differ in one of
them would name different prefixes by the same hash, so a starting replica
that differs from a live peer is refused with the field named, and running
replicas drop the facts of one that differs. Settings that only change *how*
a replica routes (the policy, timeouts, the workers it has) may differ: facts
for workers a replica does not have are dropped one by one.

Secrets (tenants' salts, ``salt_secret``, API keys) enter only as digests.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import orjson

from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.cluster.node import ClusterNode, NodeOptions
from prefixrouter.cluster.transport import LinkOptions
from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.types import WorkerId
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
    models = sorted({m for w in config.workers for m in (*w.models, *w.adapters)})
    tenants = {
        name: {"share_cache": rule.share_cache, "cache_salt": rule.cache_salt}
        for name, rule in config.tenants.items()
    }
    default = config.default_tenant
    return {
        "routing.mode": r.mode,
        "routing.chunk_chars": str(r.chunk_chars) if r.mode == "text" else "",
        "routing.block_size": str(r.block_size) if r.mode == "token" else "",
        "routing.tokenizer": tokenizer_revision if r.mode == "token" else "",
        "routing.template_version": r.template_version,
        "routing.prefix_key_tokens": str(r.prefix_key_tokens),
        "routing.max_prompt_tokens": str(r.max_prompt_tokens),
        "workers.models": _text(models),
        "tenants": _text(tenants),
        "default_tenant": _text({"share_cache": default.share_cache, "salt": default.cache_salt}),
        "salt_secret": config.salt_secret,
        "api_keys": _text(config.api_keys),
        "trust_tenant_header": str(config.trust_tenant_header),
    }


def replica_id(config: GatewayConfig) -> str:
    """The configured replica id, else ``HOSTNAME:PORT``."""
    return config.cluster.replica_id or f"{socket.gethostname()}:{config.server.port}"


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
        url=c.url, cluster=c.name, stream=c.stream, max_age_s=c.max_age_s, max_bytes=c.max_bytes
    )
    options = NodeOptions(
        link=link,
        replica_id=replica_id(config),
        heartbeat_s=c.heartbeat_s,
        peer_ttl_s=c.peer_ttl_s,
        batch_window_s=c.batch_window_s,
        max_batch_window_s=max(c.batch_window_s, c.max_batch_window_s),
        apply_within_s=c.apply_within_s,
        # No request is in flight at its origin longer than its request timeout.
        max_open_s=config.proxy.request_timeout_s + c.peer_ttl_s,
    )
    fp = Fingerprint.of(fingerprint_fields(config, tokenizer_revision))
    return ClusterNode(options, dispatch, has_worker, fp, clock, observe_lag)
