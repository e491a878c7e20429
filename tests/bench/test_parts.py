"""The benchmark's parts on their own: router registry, peer discovery, counters, framing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

import pytest
from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.bench.engine_metrics import EngineCounters, cached_share, parse_counters
from prefixrouter.bench.instant import create_app
from prefixrouter.bench.loadgen import Latencies, _Conn
from prefixrouter.bench.report import plot
from prefixrouter.bench.routers import (
    PEERS_ENV,
    ROUTERS,
    default_peers_dir,
    parse_routers,
    router_command,
    skip_reason,
)
from prefixrouter.bench.runner import BenchOptions, BenchResult, OutputError
from prefixrouter.errors import ConfigError
from prefixrouter.sim.profiles import get_profile


def test_parse_routers() -> None:
    assert [r.name for r in parse_routers("all")] == list(ROUTERS)
    assert [r.name for r in parse_routers("prefix_aware, round_robin")] == [
        "prefix_aware",
        "round_robin",
    ]
    with pytest.raises(ConfigError, match="known: all, round_robin"):
        parse_routers("prefix_aware,nginx")
    with pytest.raises(ConfigError):
        parse_routers(" , ")


def test_any_registered_policy_runs_in_our_gateway() -> None:
    affinity, replicas, old = parse_routers(
        "gateway:ray_prefix_affinity,gateway:llmd_weighted@2,gateway:prefixrouter"
    )
    assert (affinity.name, affinity.kind, affinity.policy) == (
        "gateway:ray_prefix_affinity", "gateway", "ray_prefix_affinity",
    )  # fmt: skip
    assert affinity.label == "gateway ray_prefix_affinity" and affinity.ours
    assert (replicas.name, replicas.replicas, replicas.policy) == (
        "gateway:llmd_weighted@2", 2, "llmd_weighted",
    )  # fmt: skip
    assert old.policy == "prefix_aware"  # the deprecated alias, resolved
    cmd = router_command(
        affinity, port=9000, workers=["http://127.0.0.1:1"], peers_dir=Path("."),
        prometheus_port=0, tokenizer_dir=None,
    )  # fmt: skip
    assert cmd[cmd.index("--policy") + 1] == "ray_prefix_affinity"
    with pytest.raises(ConfigError, match="unknown policy 'nginx'; registered: prefix_aware"):
        parse_routers("gateway:nginx")


def test_our_routers_as_replicas() -> None:
    one, synced, alone = parse_routers("prefix_aware,prefix_aware@4,prefix_aware@4-nosync")
    assert (one.replicas, synced.replicas, synced.sync, alone.sync) == (1, 4, True, False)
    assert synced.clustered and not alone.clustered and not one.clustered
    assert (synced.name, alone.name) == ("prefix_aware@4", "prefix_aware@4-nosync")
    assert synced.label == "gateway prefix_aware x4 synced"
    assert ROUTERS["prefix_aware"].replicated(2, sync=False).name == "prefix_aware@2-nosync"
    for bad in ("prefix_aware@0", "prefix_aware@x", "prefix_aware@2-fast", "nginx@2"):
        with pytest.raises(ConfigError):
            parse_routers(bad)
    with pytest.raises(ConfigError, match="only our gateway"):
        ROUTERS["vllm-cache_aware"].replicated(2)


def test_missing_peer_is_skipped_with_its_install_command(tmp_path: Path) -> None:
    sglang, vllm = ROUTERS["sglang-cache_aware"], ROUTERS["vllm-cache_aware"]
    assert skip_reason(ROUTERS["prefix_aware"], tmp_path) is None
    why = skip_reason(sglang, tmp_path)
    assert why is not None and "pip install sglang-router==0.3.2" in why
    assert "scripts/install_peers.sh" in why
    why = skip_reason(vllm, tmp_path)
    assert why is not None and "pip install vllm-router==0.1.17" in why
    # A venv with the package's console script counts as installed.
    script = tmp_path / "sglang-router" / "bin" / "sglang-router"
    script.parent.mkdir(parents=True)
    script.write_text("")
    assert skip_reason(sglang, tmp_path) is None


def test_peers_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEERS_ENV, str(tmp_path))
    assert default_peers_dir() == tmp_path


class _CommandArgs(TypedDict):
    """``router_command``'s arguments shared by every router in the test."""

    port: int
    workers: Sequence[str]
    peers_dir: Path
    prometheus_port: int
    tokenizer_dir: Path | None


def test_router_commands(tmp_path: Path) -> None:
    workers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    kw: _CommandArgs = {"port": 9, "workers": workers, "peers_dir": tmp_path, "prometheus_port": 7,
                        "tokenizer_dir": tmp_path / "tok"}  # fmt: skip
    ours = router_command(ROUTERS["prefix_aware"], **kw)
    assert ours[1:3] == ["-m", "prefixrouter.gateway"] and ours.count("--worker") == 2
    assert "--cluster" not in ours
    replica = router_command(
        ROUTERS["prefix_aware"].replicated(2), **kw, cluster=("nats://127.0.0.1:4", "r1")
    )
    assert replica[replica.index("--cluster") + 1] == "nats://127.0.0.1:4"
    assert replica[replica.index("--replica-id") + 1] == "r1"
    sg = router_command(ROUTERS["sglang-round_robin"], **kw)
    assert sg[0] == str(tmp_path / "sglang-router" / "bin" / "python")
    assert sg[sg.index("--policy") + 1] == "round_robin"
    assert sg[sg.index("--prometheus-port") + 1] == "7"
    assert sg[sg.index("--model-path") + 1] == str(tmp_path / "tok")
    vr = router_command(ROUTERS["vllm-cache_aware"], **kw)
    assert vr[0].endswith("vllm-router/bin/vllm-router")
    assert vr[vr.index("--worker-urls") + 1 : vr.index("--worker-urls") + 3] == workers


def test_counters_and_share() -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 750.0\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0\n'
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 3.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0\n'
    )
    c = parse_counters(text)
    assert c == EngineCounters(750.0, 1000.0, 5.0)
    assert c - EngineCounters(250.0, 500.0, 1.0) == EngineCounters(500.0, 500.0, 4.0)
    assert cached_share([c, EngineCounters(0.0, 1000.0, 1.0)]) == pytest.approx(0.375)
    assert cached_share([]) == 0.0


@pytest.mark.parametrize(
    ("chunks", "status"),
    [
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", b"lo"], 200),
        ([b"HTTP/1.1 503 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", b"0\r\n\r\n"], 503),
    ],
)
def test_loadgen_reads_length_and_chunked_responses(chunks: list[bytes], status: int) -> None:
    conn = _Conn()
    conn.waiter = None
    for i, chunk in enumerate(chunks):
        conn.buf += chunk
        assert (conn._complete() >= 0) == (i == len(chunks) - 1)
    assert conn.status == status
    assert conn._complete() == len(conn.buf)


def test_loadgen_percentiles_are_the_projects_nearest_rank() -> None:
    lat = Latencies([0.004, 0.001, 0.003, 0.002])
    summary = lat.summary()
    assert (summary["p50_ms"], summary["p99_ms"]) == (2.0, 4.0)  # the lower middle, the top
    assert Latencies().summary()["p50_ms"] == 0.0


def test_sglang_needs_a_tokenizer_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        router_command(
            ROUTERS["sglang-cache_aware"], port=1, workers=["http://127.0.0.1:2"],
            peers_dir=tmp_path, prometheus_port=3, tokenizer_dir=None,
        )  # fmt: skip


async def test_instant_engines_answer_what_peers_call() -> None:
    async with TestClient(TestServer(create_app("tiny", "/tok"))) as client:
        info = await (await client.get("/server_info")).json()
        assert info["model_path"] == "/tok" and info["served_model_name"] == "tiny"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "abcdefgh"}]}
        render = await (await client.post("/v1/chat/completions/render", json=body)).json()
        assert render["token_ids"] == list(b"ae")
        tok = await (await client.post("/tokenize", json=body)).json()
        assert tok["count"] == 2
        out = await (await client.post("/v1/chat/completions", json=body)).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert (await stream.text()).endswith("data: [DONE]\n\n")
        assert "vllm:num_requests_running" in await (await client.get("/metrics")).text()


def test_a_result_file_that_cannot_be_written_is_one_line_naming_the_option(
    tmp_path: Path,
) -> None:
    (tmp_path / "afile").write_text("")
    base = BenchOptions(
        scenarios=[], routers=[], profile=get_profile("tiny-cpu"), peers_dir=tmp_path
    )
    path = tmp_path / "afile" / "bench.out"
    for option, opts in (
        ("--json", replace(base, json_out=path)),
        ("--markdown", replace(base, markdown_out=path)),
    ):
        with pytest.raises(OutputError) as caught:
            BenchResult(overhead=[]).save(opts)
        # One line that names the option and the path (the reason is the OS's).
        message = str(caught.value)
        assert message.startswith(f"{option} {path}: cannot write: ") and "\n" not in message


def test_the_plot_is_written_to_the_path_named_whatever_its_extension(tmp_path: Path) -> None:
    row = {"router": "prefix_aware", "added_p50_ms": 0.4, "added_p99_ms": 1.2,
           "cpu_ms_per_request": 0.3, "rps_max": 900.0}  # fmt: skip
    path = tmp_path / "figure"  # no extension: matplotlib alone would write figure.png
    plot([], [row], path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure"]
