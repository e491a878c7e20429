"""`prefixrouter bench` end to end: real engine, gateway and peer processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prefixrouter.cli import app

EXE = str(Path(sys.executable).with_name("prefixrouter"))
# Small documents at the engines' own speed: a run of each router takes a few seconds.
TINY = ["--scenario", "doc-qa", "--requests", "24", "--rate", "8", "--scale", "0.1",
        "--time-scale", "1", "--warmup", "8", "--workers", "4"]  # fmt: skip


def _bench(args: list[str], tmp_path: Path, cache: str, timeout: int = 170) -> dict[str, Any]:
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "PREFIXROUTER_CACHE": cache}
    out = subprocess.run(
        [EXE, "bench", *args, "--json", str(out_json), "--plot", str(tmp_path / "bench.png")],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out_json.read_text())
    return {"doc": doc, "stdout": out.stdout, "stderr": out.stderr}


def _by_router(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["router"]: r for r in results}


@pytest.mark.timeout(180)
def test_our_routers_live_and_missing_peers_reported(tmp_path: Path, tokenizer_cache: str) -> None:
    no_peers = tmp_path / "no-peers"
    no_peers.mkdir()
    run = _bench(
        [*TINY, "--routers", "round_robin,prefix_aware,sglang-cache_aware,vllm-cache_aware",
         "--peers-dir", str(no_peers), "--overhead", "--overhead-seconds", "0.5"],
        tmp_path, tokenizer_cache,
    )  # fmt: skip
    scenario, overhead = run["doc"]
    assert scenario["scenario"] == "doc-qa" and overhead["scenario"] == "overhead"
    rows = _by_router(scenario["results"])
    for name in ("round_robin", "prefix_aware"):
        r = rows[name]
        assert r["ok"] == r["requests"] == 24
        assert set(r["ttft_ms"]) == set(r["e2e_ms"]) == {"mean", "p50", "p90", "p99"}
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
        assert r["throughput_rps"] > 0 and 0 <= r["cached_token_share"] <= 1
        assert len(r["per_worker_requests"]) == 4 and sum(r["per_worker_requests"]) == 24
    # Round robin copies every document to every engine; prefix_aware keeps them apart.
    assert rows["prefix_aware"]["cached_token_share"] > rows["round_robin"]["cached_token_share"]
    # Missing peers: reported as skipped with the command that installs them, not dropped.
    assert "pip install sglang-router==0.3.2" in rows["sglang-cache_aware"]["skipped"]
    assert "pip install vllm-router==0.1.17" in rows["vllm-cache_aware"]["skipped"]
    assert "skipping sglang-cache_aware" in run["stderr"]
    over = _by_router(overhead["results"])
    for name in ("round_robin", "prefix_aware"):
        o = over[name]
        assert o["errors"] == 0 and o["rps_max"] > 0 and o["cpu_ms_per_request"] > 0
        assert {"added_p50_ms", "added_p99_ms"} <= set(o)
    assert "skipped" in over["vllm-cache_aware"]
    assert "prefix_aware" in run["stdout"] and "overhead over a direct call" in run["stdout"]


def _first_sightings(logs: Path, router: str) -> list[tuple[bool, bool]]:
    """Per replica and prefix: (a peer routed it well before, any worker matched it here).

    The first decision a replica makes for a prefix, and whether another
    replica's log has that prefix at least 50 ms earlier (the propagation
    lag is about a millisecond here), and whether the deciding replica's
    index matched any of it on any worker.
    """
    decisions = {
        path.name: [json.loads(line) for line in path.read_text().splitlines() if line]
        for path in logs.glob(f"doc-qa-{router}-r*.decisions.jsonl")
    }
    assert len(decisions) == 2, sorted(decisions)
    out = []
    for name, records in decisions.items():
        peers = [r for other, rs in decisions.items() if other != name for r in rs]
        seen: set[str] = set()
        for rec in sorted(records, key=lambda r: r["ts"]):
            key = rec["prefix_key"]
            if key in seen:
                continue
            seen.add(key)
            before = any(p["prefix_key"] == key and p["ts"] < rec["ts"] - 0.05 for p in peers)
            matched = any(c["matched_tokens"] > 0 for c in rec["candidate_workers"])
            out.append((before, matched))
    return out


@pytest.mark.timeout(240)
def test_replicas_synced_and_not_side_by_side(tmp_path: Path, tokenizer_cache: str) -> None:
    """Two gateway replicas on a real nats-server, and two that share nothing.

    The client sends them the requests round robin. Synced, a replica that
    first meets a document its peer routed earlier already knows where it
    is; not synced, it never does.
    """
    logs = tmp_path / "logs"
    more = [*TINY[: TINY.index("--requests")], "--requests", "48", *TINY[TINY.index("--rate") :]]
    run = _bench(
        [*more, "--routers", "prefix_aware,prefix_aware@2,prefix_aware@2-nosync",
         "--no-overhead", "--log-dir", str(logs)],
        tmp_path, tokenizer_cache, timeout=230,
    )  # fmt: skip
    rows = _by_router(run["doc"]["results"])
    one, synced, alone = rows["prefix_aware"], rows["prefix_aware@2"], rows["prefix_aware@2-nosync"]
    for r in (one, synced, alone):
        assert r["ok"] == r["requests"] == 48, r.get("error") or r.get("first_error")
    for r in (synced, alone):
        assert r["replicas"] == 2 and r["per_replica_requests"] == [24, 24]
        assert all(c > 0 for c in r["cpu_ms_per_request"])
    assert synced["propagation_lag_ms"]["facts_messages"] > 0
    assert all(c > 0 for c in synced["sync_cpu_ms_per_request"])
    assert alone["propagation_lag_ms"]["facts_messages"] == 0
    assert alone["sync_cpu_ms_per_request"] == [0.0, 0.0]
    told = [matched for before, matched in _first_sightings(logs, "prefix_aware@2") if before]
    assert any(told)  # the peer's placement was known (a fact late by 50 ms would not be)
    untold = [m for before, m in _first_sightings(logs, "prefix_aware@2-nosync") if before]
    assert untold and not any(untold)  # each replica learns only from its own requests
    assert "lag p99" in run["stdout"]  # the replicas' columns are shown


@pytest.mark.timeout(240)
def test_rounds_interleave_the_routers_and_report_their_paired_ratio(
    tmp_path: Path, tokenizer_cache: str
) -> None:
    """--rounds 2: each router twice, interleaved, each run on reset caches and its own logs."""
    logs = tmp_path / "logs"
    run = _bench(
        [*TINY, "--routers", "round_robin,prefix_aware", "--rounds", "2", "--no-overhead",
         "--log-dir", str(logs), "--markdown", str(tmp_path / "bench.md")],
        tmp_path, tokenizer_cache, timeout=230,
    )  # fmt: skip
    doc = run["doc"]
    order = [(r["router"], r["round"]) for r in doc["results"]]
    assert order == [("round_robin", 1), ("prefix_aware", 1), ("round_robin", 2),
                     ("prefix_aware", 2)]  # fmt: skip
    for r in doc["results"]:
        assert r["ok"] == r["requests"] == 24, r.get("error") or r.get("first_error")
    means = {(r["router"], r["round"]): r["ttft_ms"]["mean"] for r in doc["results"]}
    rr, ours = doc["rounds"]
    assert rr["router"] == "round_robin" and rr["vs_first"] is None and rr["rounds"] == 2
    paired = [means["prefix_aware", k] / means["round_robin", k] for k in (1, 2)]
    assert ours["vs_first"]["mean"] == pytest.approx(sum(paired) / 2)
    assert ours["vs_first"]["min"] == pytest.approx(min(paired))
    assert ours["ttft_mean_ms"]["max"] == max(means["prefix_aware", k] for k in (1, 2))
    # Each round's gateway logged on its own, and met engines whose caches
    # were reset: its first question about a document found nothing cached.
    for k in (1, 2):
        path = logs / f"doc-qa-prefix_aware-round{k}.decisions.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        first = next(r for r in sorted(records, key=lambda r: r["ts"]) if r["prompt_tokens"] > 1000)
        assert first["actual_cached_tokens"] == 0
    assert "doc-qa · over 2 rounds" in run["stdout"]
    assert "prefix_aware · round 2" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope"], "unknown scenario 'nope'"),
        (["--scenario", "mooncake-conversation"], "unknown scenario"),
        (["--routers", "prefix_aware,nginx"], "unknown router 'nginx'"),
        (["--routers", ","], "comma-separated"),
        (["--routers", "prefix_aware@0"], "NAME@N"),
        (["--profile", "a100"], "unknown engine profile"),
        (["--scale", "2"], "scale"),
        (["--rate", "0"], "rate"),
        (["--no-live", "--no-overhead"], "nothing to run"),
        (["--scenario", "cache-pressure", "--workers", "1", "--no-overhead"], "at least 2 engines"),
        (["--kv-blocks", "0"], "kv-blocks"),
    ],
)
def test_bad_input_is_one_line_not_a_traceback(args: list[str], message: str) -> None:
    out = CliRunner().invoke(app, ["bench", *args])
    assert out.exit_code == 2
    assert message in out.output and "Traceback" not in out.output


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [
        ("--json", "outdir", "is a directory"),
        ("--markdown", "outdir", "is a directory"),
        ("--plot", "outdir", "is a directory"),
        ("--plot", "outdir/bench", "expected a file name ending in .png"),
        ("--plot", "out.txt", "expected a file name ending in .png"),
        ("--json", "afile/bench.json", "is not a folder"),
    ],
)
def test_output_paths_are_checked_before_any_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str, name: str, message: str
) -> None:
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_text("")

    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the bench ran with an output path it cannot write")

    monkeypatch.setattr("prefixrouter.bench.runner.run_bench", no_run)
    path = tmp_path / name
    out = CliRunner().invoke(app, ["bench", "--no-overhead", option, str(path)])
    assert out.exit_code == 2, (out.output, out.exception)
    assert out.output.startswith(f"error: {option} {path}: ") and message in out.output
    assert len(out.output.strip().splitlines()) == 1, out.output


def test_peers_dir_must_be_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    out = CliRunner().invoke(app, ["bench", "--peers-dir", str(f)])
    assert out.exit_code == 2 and "not a directory" in out.output


@pytest.mark.peers
@pytest.mark.timeout(300)
def test_real_peer_routers(tmp_path: Path, tokenizer_cache: str) -> None:
    """sglang-router and vllm-router from `scripts/install_peers.sh` (run with `pytest -m peers`).

    Fails, never skips, when the peers are not installed: the message says how.
    """
    run = _bench(
        [*TINY, "--routers", "sglang-cache_aware,sglang-round_robin,vllm-cache_aware",
         "--overhead", "--overhead-seconds", "0.5"],
        tmp_path, tokenizer_cache, timeout=280,
    )  # fmt: skip
    scenario, overhead = run["doc"]
    for r in scenario["results"]:
        assert "skipped" not in r, r["skipped"]
        assert r["ok"] == r["requests"] == 24, r
        assert r["cached_token_share"] > 0.3
    for o in overhead["results"]:
        assert "skipped" not in o and "error" not in o, o
        assert o["errors"] == 0 and o["rps_max"] > 0


@pytest.mark.parametrize(
    ("kv_blocks", "message"),
    [
        # Planned longer than the cache: the simulator's own test refuses it.
        ("1000", "doc-qa: --kv-blocks 1000: request 0 needs 20,207 tokens (20,119 prompt + 88 "
                 "output), more than an engine's KV cache holds (16,000: 1,000 blocks of 16)"),
        # Planned to fit (20,321 <= 20,480) but its text is longer, as the engines count it.
        ("1280", "doc-qa: --kv-blocks 1280: request 7 needs 20,495 tokens (20,347 prompt + 148 "
                 "output), more than an engine's KV cache holds (20,480: 1,280 blocks of 16)"),
    ],
)  # fmt: skip
def test_requests_too_long_for_the_kv_cache_are_refused_before_any_engine_starts(
    monkeypatch: pytest.MonkeyPatch, kv_blocks: str, message: str
) -> None:
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("engines started for requests every engine refuses")

    monkeypatch.setattr("prefixrouter.bench.runner.run_scenario", no_run)
    out = CliRunner().invoke(
        app,
        ["bench", "--scenario", "doc-qa", "--routers", "round_robin", "--requests", "10",
         "--warmup", "2", "--no-overhead", "--kv-blocks", kv_blocks],
    )  # fmt: skip
    assert out.exit_code == 2, (out.output, out.exception)
    assert out.output.strip().splitlines()[-1] == f"error: {message}"
