"""The gateway's side: the ``cluster:`` section, ``--cluster``/``--replica-id``, ``/ready``,
the fingerprint's fields. In-process gateways in front of fake engines; no NATS needed
(a replica whose NATS is unreachable keeps routing and is not ready)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from prefixrouter.cluster.fingerprint import Fingerprint
from prefixrouter.errors import ConfigError
from prefixrouter.gateway.cli import build_config
from prefixrouter.gateway.cluster_link import fingerprint_fields, replica_id, tls_context
from prefixrouter.gateway.config import config_from_dict
from prefixrouter.gateway.state import STATE
from prefixrouter.harness.ports import free_port
from tests.gateway.helpers import gateway_env, run

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 2}


def test_the_cluster_section_is_validated_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.url: must be a NATS address"):
        config_from_dict({"cluster": {"url": "http://x:4222"}})
    with pytest.raises(ConfigError, match=r"cluster: .*peer_ttl_s \(1\) must be more than twice"):
        config_from_dict({"cluster": {"heartbeat_s": 1.0, "peer_ttl_s": 1.0}})
    with pytest.raises(ConfigError, match=r"cluster\.name"):
        config_from_dict({"cluster": {"name": "a.b"}})
    # Malformed addresses are configuration errors, not an outage to retry for ever.
    for url, why in (
        ("nats://127.0.0.1:abc", r"not a valid URL: .*'abc'"),
        ("nats://127.0.0.1:99999", r"not a valid URL: Port out of range"),
        ("nats://", r"has no host"),
        ("nats://h:4222/x", r"must not have a path"),
        ("tls://127.0.0.1:4222", r"tls:// is not supported: use nats://"),
    ):
        with pytest.raises(ConfigError, match=rf"cluster\.url: .*{why}"):
            config_from_dict({"cluster": {"url": url}})
    assert config_from_dict({"cluster": {"url": "nats://u:p@nats.ns.svc:4222"}}).cluster.url
    for name in ("facts.v1", "a b", "x>", "a/b"):  # NATS refuses these as stream names
        with pytest.raises(ConfigError, match=r"cluster\.stream: must not hold"):
            config_from_dict({"cluster": {"stream": name}})
    cfg = config_from_dict({})
    assert cfg.cluster.url is None  # alone unless configured


def test_tls_files_that_cannot_be_used_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster: .*tls_key_file needs tls_cert_file"):
        config_from_dict({"cluster": {"tls_key_file": "k.pem"}})
    assert tls_context(config_from_dict({})) is None
    missing = config_from_dict({"cluster": {"tls_ca_file": str(tmp_path / "none.pem")}})
    with pytest.raises(ConfigError, match=r"^cluster\.tls_ca_file: .*none\.pem: cannot read"):
        tls_context(missing)
    (tmp_path / "junk.pem").write_text("not a certificate")
    junk = config_from_dict({"cluster": {"tls_cert_file": str(tmp_path / "junk.pem")}})
    with pytest.raises(ConfigError, match=r"^cluster\.tls_cert_file: "):
        tls_context(junk)


def test_the_command_line_options_set_the_cluster_section() -> None:
    cfg = build_config(None, None, 9000, "127.0.0.1", None, "prefix_aware", None,
                       "nats://127.0.0.1:4222", "r7")  # fmt: skip
    assert cfg.cluster.url == "nats://127.0.0.1:4222" and cfg.cluster.replica_id == "r7"
    assert replica_id(cfg) == "r7"
    unnamed = build_config(None, None, 9000, "127.0.0.1", None, "prefix_aware", None,
                           "nats://127.0.0.1:4222")  # fmt: skip
    assert replica_id(unnamed).endswith(":9000")
    # On port 0 the port is chosen at bind time: two such gateways on one host differ.
    any_port = build_config(None, None, 0, "127.0.0.1", None, "prefix_aware", None,
                            "nats://127.0.0.1:4222")  # fmt: skip
    assert replica_id(any_port).endswith(f":pid{os.getpid()}")


def test_the_fingerprint_covers_hashing_and_namespaces_and_hides_secrets() -> None:
    base = config_from_dict({"salt_secret": "topsecret", "tenants": {"t": {"cache_salt": "s1"}}})
    fp = Fingerprint.of(fingerprint_fields(base, ""))
    changes: dict[str, dict[str, Any]] = {
        "routing.chunk_chars": {"routing": {"chunk_chars": 128}},
        "routing.template_version": {"routing": {"template_version": "v2"}},
        "salt_secret": {"salt_secret": "other"},
        "tenants": {"tenants": {"t": {"cache_salt": "s2"}}},
        "workers.adapters": {"workers": [{"url": "http://e:1", "adapters": ["sql-lora"]}]},
    }
    for field, change in changes.items():
        other = config_from_dict({"salt_secret": "topsecret", **change})
        if field != "tenants":
            other = config_from_dict(
                {"salt_secret": "topsecret", "tenants": {"t": {"cache_salt": "s1"}}, **change}
            )
        assert fp.differing(Fingerprint.of(fingerprint_fields(other, "")).fields) == [field]
    # The tokenizer revision enters the namespace in text mode too.
    assert fp.differing(Fingerprint.of(fingerprint_fields(base, "v2")).fields) == [
        "routing.tokenizer"
    ]
    # What only changes how a replica routes, or which tenant a request is (each
    # replica then hashes it in that tenant's namespace), may differ: a rolling
    # update can add a client's key or list the models a worker serves.
    for may_differ in (
        {"proxy": {"max_attempts": 1}},
        {"api_keys": {"k": "t"}, "trust_tenant_header": True},
        {"workers": [{"url": "http://e:1", "models": ["tiny"]}]},
    ):
        other = config_from_dict(
            {"salt_secret": "topsecret", "tenants": {"t": {"cache_salt": "s1"}}, **may_differ}
        )
        assert Fingerprint.of(fingerprint_fields(other, "")).value == fp.value, may_differ
    assert not any("topsecret" in v or "s1" in v for v in fp.fields.values())


def test_a_lone_gateway_is_ready_at_once_and_records_no_facts() -> None:
    async def body() -> None:
        async with gateway_env(n=1) as env:
            r = await env.client.get("/ready")
            assert r.status == 200 and (await r.json())["status"] == "ready"
            st = env.client.app[STATE]
            assert st.cluster is None
            assert (await env.client.post("/v1/chat/completions", json=CHAT)).status == 200
            assert st.dispatch.drain_facts() == []  # no outbox

    run(body)


def test_a_replica_without_nats_routes_on_its_own_view_but_is_not_ready() -> None:
    async def body() -> None:
        dead = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
        async with gateway_env(n=1, overrides={"cluster": {"url": dead, "replica_id": "x"}}) as env:
            r = await env.client.get("/ready")
            data = await r.json()
            assert r.status == 503 and data["connected"] is False and data["replayed"] is False
            assert (await env.client.get("/health")).status == 200  # liveness unchanged
            assert (await env.client.post("/v1/chat/completions", json=CHAT)).status == 200
            text = await (await env.client.get("/metrics")).text()
            assert "prefixrouter_cluster_connected 0.0" in text
            assert "prefixrouter_cluster_ready 0.0" in text

    run(body)
