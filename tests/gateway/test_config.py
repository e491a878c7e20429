"""Configuration: defaults, errors that name file, line and field, CLI overrides, examples."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from prefixrouter.core import SpeedProfile
from prefixrouter.errors import ConfigError
from prefixrouter.gateway.cli import build_config
from prefixrouter.gateway.config import GatewayConfig, config_from_dict, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_every_option_has_a_default(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == GatewayConfig()
    cfg = GatewayConfig()
    assert cfg.server.port == 8080 and cfg.policy.name == "prefix_aware"
    assert cfg.routing.mode == "text" and cfg.decision_log.path is None


def test_the_deprecated_policy_name_is_the_same_policy_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("policy: {name: prefixrouter, params: {min_match_tokens: 32}}\n")
    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        cfg = build_config(path, None, 8080, "127.0.0.1", None, "prefix_aware")
    assert cfg.policy.name == "prefix_aware" and cfg.policy.params == {"min_match_tokens": 32}
    assert "policy.name: policy name 'prefixrouter' is deprecated" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        # --policy with the old name names the file's policy: its parameters stay
        cfg = build_config(path, None, 8080, "127.0.0.1", None, "prefixrouter")
        assert cfg.policy.name == "prefix_aware" and cfg.policy.params == {"min_match_tokens": 32}
        assert "--policy: policy name 'prefixrouter' is deprecated" in caplog.text
        cfg = build_config(None, None, 8080, "127.0.0.1", None, "prefixrouter")
        assert cfg.policy.name == "prefix_aware"


def test_errors_name_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "server:\n"
        "  port: 9000\n"
        "workers:\n"
        "  - url: http://127.0.0.1:8001\n"
        "  - url: ftp://nope\n"
        "  - url: http://127.0.0.1:8003\n"
        "    max_slots: -1\n"
        "tenants:\n"
        "  acme: {share_cache: false, bogus: 1}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert f"{path}:5: workers.1.url: must start with http:// or https://" in lines
    assert any(line.startswith(f"{path}:7: workers.2.max_slots:") for line in lines)
    assert any(line.startswith(f"{path}:9: tenants.acme.bogus:") for line in lines)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"policy": {"name": "nope"}}, "policy: unknown policy 'nope'"),
        ({"policy": {"params": {"bogus": 1}}}, "unknown field 'bogus'"),
        ({"routing": {"mode": "chars"}}, "routing.mode"),
        ({"workers": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "duplicate worker id"),
        ({"proxy": {"max_attempts": 0}}, "proxy.max_attempts"),
        ({"workers": [{"url": "http://a:1", "kind": "tgi"}]}, "workers.0.kind"),
        ({"server": {"max_body_bytes": "big"}}, "server.max_body_bytes"),
        (
            {"workers": [{"url": "http://a:1", "kv_events_connect": "tcp://*:5557"}]},
            "workers.0.kv_events_connect: must name the engine's host",
        ),
        (
            {"workers": [{"url": "http://a:1", "kv_events_connect": "tcp://a"}]},
            "workers.0.kv_events_connect: must be tcp://HOST:PORT",
        ),
        (
            {"workers": [{"url": "http://a:1", "kv_replay_endpoint": "a:5558"}]},
            "workers.0.kv_replay_endpoint: must be a ZMQ address",
        ),
        (
            {
                "workers": [
                    {"url": "http://a:1", "kv_events_connect": "tcp://e:5557"},
                    {"url": "http://b:1", "kv_events_connect": "tcp://e:5557"},
                ]
            },
            "duplicate kv_events_connect 'tcp://e:5557'",
        ),
    ],
)
def test_invalid_fields_are_named(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        config_from_dict(data, "cfg.yaml")
    assert needle in str(info.value)


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("server:\n  port: 1\n workers: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:3: invalid YAML"):
        load_config(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/prefixrouter.yaml")


def test_worker_defaults_follow_the_engine_kind() -> None:
    cfg = config_from_dict(
        {"workers": [{"url": "http://h:1/v1/"}, {"url": "https://api.x.com", "kind": "openai"}]}
    )
    vllm, openai = cfg.workers
    assert (vllm.url, vllm.id, vllm.health_path, vllm.metrics_path) == (
        "http://h:1",
        "h:1",
        "/health",
        "/metrics",
    )
    assert vllm.supports_cache_salt and not openai.supports_cache_salt
    assert (openai.health_path, openai.metrics_path) == ("/v1/models", "")


@pytest.mark.parametrize(
    "name",
    [
        "vllm.yaml",
        "vllm-kv-events.yaml",
        "vllm-kv-events-replicas.yaml",
        "sglang.yaml",
        "openai.yaml",
        "cluster.yaml",
    ],
)
def test_examples_are_valid(name: str) -> None:
    cfg = load_config(EXAMPLES / name)
    assert cfg.workers
    if name == "vllm-kv-events-replicas.yaml":
        assert cfg.kv_events_on and cfg.kv_events.endpoint is None
        assert all(w.kv_events_connect for w in cfg.workers)


def test_cli_options_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "server: {port: 9000}\n"
        "workers: [{url: 'http://127.0.0.1:8001'}]\n"
        "policy: {name: prefix_aware, params: {}}\n"
    )
    cfg = build_config(path, ["http://127.0.0.1:8002"], 8080, "127.0.0.1", None, "prefix_aware")
    assert [w.id for w in cfg.workers] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    assert cfg.server.port == 9000  # default CLI value leaves the file's
    cfg = build_config(path, None, 7000, "127.0.0.1", tmp_path / "d.jsonl", "round_robin")
    assert cfg.server.port == 7000 and cfg.policy.name == "round_robin"
    assert cfg.decision_log.path == tmp_path / "d.jsonl"
    with pytest.raises(ConfigError, match=r"workers\.0\.url"):
        build_config(None, ["localhost:1"], 8080, "127.0.0.1", None, "prefix_aware")


def test_kv_events_are_on_when_the_gateway_binds_or_connects() -> None:
    assert not config_from_dict({"workers": [{"url": "http://a:1"}]}).kv_events_on
    binds = config_from_dict({"kv_events": {"endpoint": "tcp://127.0.0.1:5557"}})
    assert binds.kv_events_on
    connects = config_from_dict(
        {
            "workers": [
                {"url": "http://a:1"},
                {"url": "http://b:1", "kv_events_connect": "tcp://b:5557"},
            ]
        }
    )
    assert connects.kv_events_on and connects.kv_events.endpoint is None
    assert connects.workers[1].kv_events_connect == "tcp://b:5557"


def test_a_speed_profile_for_every_worker_or_one_of_its_own() -> None:
    """policy.profile for all, workers[].profile for one; the cost model predicts with it."""
    from prefixrouter.core import CacheNamespace, RequestId, RoutingRequest
    from prefixrouter.gateway.state import build_state
    from prefixrouter.sim.profiles import get_profile

    cfg = config_from_dict(
        {
            "policy": {"profile": "llama3-8b-h100"},
            "workers": [
                {"url": "http://127.0.0.1:9", "id": "big"},
                {"url": "http://127.0.0.1:10", "id": "small", "profile": "tiny-cpu"},
                {"url": "http://127.0.0.1:11", "id": "generic"},
            ],
        }
    )
    st = build_state(cfg)
    views = {str(v.worker_id): v for v in st.registry.views()}
    assert views["big"].profile == get_profile("llama3-8b-h100").speed
    assert views["small"].profile == get_profile("tiny-cpu").speed
    # The profile sets the predicted cold prefill of a 20,000-token prompt.
    doc = RoutingRequest(RequestId("r"), CacheNamespace("m"), text="word " * 16_000)
    adm = st.dispatch.admit(doc, st.registry.views(), 0.0)
    predicted = {str(c.worker_id): c.terms.prefill_s for c in adm.decision.candidates if c.terms}
    n = adm.decision.prompt_tokens
    assert n > 15_000
    assert predicted["big"] == pytest.approx(get_profile("llama3-8b-h100").speed.prefill_time(n))
    assert predicted["small"] == pytest.approx(get_profile("tiny-cpu").speed.prefill_time(n))
    assert predicted["generic"] == pytest.approx(
        get_profile("llama3-8b-h100").speed.prefill_time(n)
    )
    generic = build_state(config_from_dict({"workers": [{"url": "http://127.0.0.1:9"}]}))
    assert generic.registry.views()[0].profile == SpeedProfile()


def test_an_unknown_speed_profile_is_an_error_naming_the_field_and_the_known_ones() -> None:
    known = r"policy\.profile.*unknown engine profile 'h100'.*tiny-cpu"
    with pytest.raises(ConfigError, match=known):
        config_from_dict({"policy": {"profile": "h100"}})
    worker = {"url": "http://127.0.0.1:9", "profile": "a100"}
    with pytest.raises(ConfigError, match=r"workers\.0\.profile.*unknown engine profile 'a100'"):
        config_from_dict({"workers": [worker]})
    cfg = build_config(None, ["http://127.0.0.1:9"], 8080, "127.0.0.1", None, "prefix_aware",
                       profile="tiny-cpu")  # fmt: skip
    assert cfg.policy.profile == "tiny-cpu"
    with pytest.raises(ConfigError, match="unknown engine profile"):
        build_config(None, None, 8080, "127.0.0.1", None, "prefix_aware", profile="nope")


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://", "has no host"),
        ("https:///", "has no host"),
        ("http://host:notaport", "is not a valid URL"),
        ("http://127.0.0.1:99999", "is not a valid URL"),
        ("http://[::1", "is not a valid URL"),
        ("http:// spaces here", "without spaces"),
        ("http://a:0", "port 0"),
    ],
)
def test_a_bad_worker_url_is_one_line_naming_its_field(
    tmp_path: Path, url: str, needle: str
) -> None:
    path = tmp_path / "u.yaml"
    path.write_text(f'server: {{port: 0}}\nworkers:\n  - url: "{url}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:3: workers.0.url: {str(info.value).split(': ', 2)[2]}"
    assert needle in str(info.value)
    with pytest.raises(ConfigError, match=rf"command line: workers\.0\.url: .*{needle}"):
        build_config(None, [url], 8080, "127.0.0.1", None, "prefix_aware")


def test_config_errors_name_the_line_and_field_of_the_problem(tmp_path: Path) -> None:
    def error(name: str, text: str | bytes) -> str:
        path = tmp_path / name
        if isinstance(text, str):
            path.write_text(text, encoding="utf-8")
        else:
            path.write_bytes(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        message = str(info.value)
        assert "\n" not in message and "Traceback" not in message
        return message.removeprefix(f"{path}")

    dup = "workers:\n  - {url: 'http://a:1', id: a}\n  - {url: 'http://b:1', id: b}\n"
    dup += "  - url: http://c:1\n\n\n    id: a\n"
    assert error("dup.yaml", dup) == ":7: workers.2.id: duplicate worker id 'a' (also workers.0.id)"
    proxied = "workers:\n  - url: http://p:1/engine1\n  - url: http://p:1/engine2\n"
    assert error("proxied.yaml", proxied) == (
        ":3: workers.1.id: duplicate worker id 'p:1' (also workers.0.id): engines at one "
        "host:port need an id each (set `id`)"
    )
    nested = "policy:\n  name: prefix_aware\n  params:\n    short:\n\n      bogus: 1\n"
    assert error("nested.yaml", nested).startswith(
        ":6: policy.params.short.bogus: unknown field 'bogus'"
    )
    assert error("binary.yaml", b"server: {}\n\xff\xfe bad") == ":2: not UTF-8 text (byte 11)"
    for key in ("ключ", "abc\\r\\nX-Injected: 1"):
        text = f'workers:\n  - url: http://a:1\n    api_key: "{key}"\n'
        assert error("key.yaml", text).startswith(":3: workers.0.api_key: must be printable ASCII")
    twice = "workers: []\nserver: {port: 1}\nworkers:\n  - url: http://a:1\n"
    assert error("twice.yaml", twice).startswith(":3: workers: duplicate key (also on line 1")
    inner = "server:\n  port: 1\n  host: 0.0.0.0\n  port: 2\n"
    assert error("inner.yaml", inner).startswith(":4: server.port: duplicate key")
    same = "workers:\n  - {url: 'http://a:1', id: x}\n  - {url: 'http://A:1/v1/', id: y}\n"
    message = error("same.yaml", same)
    assert message.startswith(":3: workers.1.url: ") and "'x'" in message and "'y'" in message


def test_keys_lose_surrounding_whitespace_and_the_admin_key_is_no_tenants(
    tmp_path: Path,
) -> None:
    """A secret file's newline never locks a key out; a tenant's key never opens /admin."""
    cfg = config_from_dict({"server": {"admin_api_key": "adm\n"}, "api_keys": {" k1\n": "a"}})
    assert cfg.server.admin_api_key == "adm" and cfg.api_keys == {"k1": "a"}
    path = tmp_path / "clash.yaml"
    path.write_text("api_keys: {k1: alpha}\nserver:\n  port: 1\n  admin_api_key: k1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:4: server.admin_api_key: equals the API key of")
    assert "'alpha'" in str(info.value)
    with pytest.raises(ConfigError, match="differ only in surrounding whitespace"):
        config_from_dict({"api_keys": {"k1": "a", "k1 ": "b"}})


def test_epp_http_port_gives_way_to_the_files_only_when_left_at_its_own_default(
    tmp_path: Path,
) -> None:
    """``epp --http-port`` defaults to 9090: left there, a file's server.port wins."""
    with_port = tmp_path / "p.yaml"
    with_port.write_text("server: {port: 9191}\n")
    without = tmp_path / "n.yaml"
    without.write_text("server: {host: 127.0.0.1}\n")

    def port(path: Path | None, given: int) -> int:
        cfg = build_config(path, None, given, "127.0.0.1", None, "prefix_aware", port_default=9090)
        return cfg.server.port

    assert port(with_port, 9090) == 9191  # was 9090: the file's port was always replaced
    assert port(with_port, 8080) == 8080  # was 9191: an explicit 8080 read as "not given"
    assert port(without, 9090) == 9090 and port(None, 9090) == 9090
    serve = build_config(without, None, 8080, "127.0.0.1", None, "prefix_aware")
    assert serve.server.port == 8080


def test_discover_completes_a_discovery_section_the_file_leaves_unfinished(
    tmp_path: Path,
) -> None:
    """``kind: kubernetes`` alone in the file, the source from ``--discover``."""
    path = tmp_path / "kind.yaml"
    path.write_text("discovery:\n  kind: kubernetes\n  namespace: llm\n")
    cfg = build_config(
        path, None, 8080, "127.0.0.1", None, "prefix_aware", discover="k8s:llm/app=vllm:8000"
    )
    assert (cfg.discovery.kind, cfg.discovery.selector, cfg.discovery.port) == (
        "kubernetes",
        "app=vllm",
        8000,
    )
    with pytest.raises(ConfigError, match=r"kind\.yaml:1: discovery: kind kubernetes needs"):
        build_config(path, None, 8080, "127.0.0.1", None, "prefix_aware")


def test_one_publisher_under_two_spellings_is_refused() -> None:
    """``tcp://localhost:P`` and ``tcp://127.0.0.1:P`` are one socket: each message twice."""
    workers = [
        {"url": "http://127.0.0.1:1", "kv_events_connect": "tcp://localhost:5557"},
        {"url": "http://127.0.0.1:2", "kv_events_connect": "tcp://127.0.0.1:5557"},
    ]
    with pytest.raises(ConfigError, match=r"workers\.1\.kv_events_connect: duplicate"):
        config_from_dict({"workers": workers, "routing": {"mode": "token"}})
