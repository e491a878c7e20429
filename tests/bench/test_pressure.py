"""The cache-pressure scenario's sizing and the oracle's pinning (fast: no live run)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from prefixrouter.bench import pressure
from prefixrouter.bench.oracle import (
    PIN_FILL,
    DocumentKeys,
    OracleProxy,
    document_key,
    oracle_pins,
    pin_documents,
)
from prefixrouter.bench.ratios import ttft_ratios
from prefixrouter.bench.workload import build_bench_workload, live_scenarios
from prefixrouter.errors import ConfigError
from prefixrouter.harness.replay import ReplayRequest
from prefixrouter.sim.profiles import get_profile
from prefixrouter.tokenization import load_tokenizer
from tests.gateway.fakes import FakeEngine, make_app

PROFILE = get_profile("llama3-8b-h100")


@pytest.mark.parametrize(
    ("engines", "kv_blocks", "block_size"),
    [(2, 640, 32), (4, 1500, 16), (3, 20_000, 16), (8, 3000, 16), (2, 8192, 32)],
)
def test_sizing_exceeds_one_engine_and_fits_the_fleet_when_pinned(
    engines: int, kv_blocks: int, block_size: int
) -> None:
    s = pressure.size_pressure(engines, kv_blocks, block_size, requests=160, seed=3)
    cap = kv_blocks * block_size
    assert len(s.doc_tokens) == pressure.DOCS_PER_ENGINE * engines
    assert sum(s.doc_tokens) > cap  # no single engine can keep them all
    assert sum(s.doc_tokens) <= PIN_FILL * engines * cap  # the fleet can
    assert max(s.per_engine_tokens) <= PIN_FILL * cap  # and the oracle's pinning does
    assert sum(s.questions) == 160 and min(s.questions) >= 1
    # Documents differ in size and popularity, so balancing them is a real choice.
    assert len(set(s.doc_tokens)) > 1 and len(set(s.questions)) > 1


def test_sizing_is_seeded_and_refuses_what_cannot_pressure() -> None:
    a = pressure.size_pressure(4, 1500, 16, 160, seed=1)
    assert a == pressure.size_pressure(4, 1500, 16, 160, seed=1)
    assert a != pressure.size_pressure(4, 1500, 16, 160, seed=2)
    with pytest.raises(ConfigError, match="at least 2 engines"):
        pressure.size_pressure(1, 1500, 16, 160)
    with pytest.raises(ConfigError, match="at least 8 requests"):
        pressure.size_pressure(4, 1500, 16, 7)


def _ours() -> Any:
    tok = load_tokenizer()
    w = build_bench_workload(
        "cache-pressure", requests=96, rate=8.0, scale=0.5, workers=4, profile=PROFILE,
        tokenizer=tok, kv_blocks=1000,
    )  # fmt: skip
    return w, tok


def test_the_text_workload_keeps_the_pressure_the_sizing_promised() -> None:
    assert "cache-pressure" in live_scenarios()
    w, tok = _ours()
    assert w.kv_blocks == 1000 and w.block_size == PROFILE.block_size
    cap = w.kv_blocks * w.block_size
    keys, pins = oracle_pins(w.requests, 4, lambda t: len(tok.encode(t)), int(PIN_FILL * cap))
    # What the engines will tokenize, measured: more than one engine holds,
    # within each engine's KV as the oracle pins it.
    measured = {g: len(tok.encode(d)) for g, d in keys.documents.items()}
    assert sum(measured.values()) > 1.5 * cap
    per = Counter[int]()
    for g, n in measured.items():
        per[pins[g]] += n
    assert len(per) == 4 and max(per.values()) <= PIN_FILL * cap
    # Questions interleaved: every document is asked about in each half of the run.
    half = len(w.requests) // 2
    assert {r.group for r in w.requests[:half]} == {r.group for r in w.requests[half:]}
    assert len(keys.documents) == 8 and w.load == pytest.approx(0.8)


def test_oracle_pinning_is_deterministic_and_balanced() -> None:
    rng = random.Random(7)
    weights = {f"d{i}": (rng.randint(5_000, 12_000), rng.randint(5, 40)) for i in range(10)}
    pins = pin_documents(weights, 4)
    shuffled = dict(sorted(weights.items(), key=lambda _: rng.random()))
    assert pin_documents(shuffled, 4) == pins  # input order does not matter
    load = Counter[int]()
    for d, (tokens, questions) in weights.items():
        load[pins[d]] += tokens * questions
    # LPT's bound: the heaviest engine within 4/3 of the best possible.
    lower = max(sum(load.values()) / 4, max(t * q for t, q in weights.values()))
    assert len(load) == 4 and max(load.values()) <= 4 / 3 * lower
    # A capacity keeps each engine's documents within its KV even against balance.
    capped = pin_documents({"a": (900, 100), "b": (900, 1), "c": (200, 1)}, 2, 1000)
    assert capped["a"] != capped["b"]
    with pytest.raises(ConfigError):
        pin_documents(weights, 0)


def test_every_request_goes_to_its_documents_engine() -> None:
    w, tok = _ours()
    keys, pins = oracle_pins(w.requests, 4, lambda t: len(tok.encode(t)))
    assert keys == DocumentKeys.of(w.requests)  # the same workload, the same keys
    table = {k: pins[g] for k, g in keys.groups.items()}
    proxy = OracleProxy([f"http://e{i}" for i in range(4)], keys.chars, table)
    for r in w.requests:
        assert proxy.engine(r.body) == f"http://e{pins[r.group]}"
        assert keys.groups[document_key(r.body, keys.chars)] == r.group
    # Anything else (warm-up, probes) goes round robin.
    other = {"messages": [{"role": "user", "content": "hello"}]}
    assert {proxy.engine(other) for _ in range(4)} == {f"http://e{i}" for i in range(4)}


def test_groups_that_start_alike_are_refused() -> None:
    body = {"messages": [{"role": "user", "content": "same text"}]}
    same = [ReplayRequest(0.0, "x", g, body) for g in ("a", "b")]
    with pytest.raises(ConfigError, match="cannot tell"):
        DocumentKeys.of(same)


def test_the_proxy_streams_the_engines_answer_through() -> None:
    async def run() -> tuple[int, list[bytes], int]:
        engines = [FakeEngine(), FakeEngine()]
        servers = [TestServer(make_app(e)) for e in engines]
        for s in servers:
            await s.start_server()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "doc " * 50}],
                "max_tokens": 4, "stream": True}  # fmt: skip
        key = document_key(body, 40)
        proxy = OracleProxy([str(s.make_url("")) for s in servers], 40, {key: 1})
        async with TestClient(TestServer(proxy.app())) as client:
            resp = await client.post("/v1/chat/completions", data=orjson.dumps(body))
            lines = [line async for line in resp.content if line.startswith(b"data:")]
            health = (await client.get("/health")).status
        for s in servers:
            await s.close()
        return resp.status, lines, health

    status, lines, health = asyncio.run(run())
    assert status == 200 and health == 200
    assert lines[-1].strip() == b"data: [DONE]" and len(lines) >= 3


def test_ratios_against_the_oracle_and_the_best_peer() -> None:
    def row(name: str, mean: float) -> dict[str, Any]:
        return {"router": name, "ok": 10, "ttft_ms": {"mean": mean}}

    results = [
        row("oracle", 100.0), row("prefix_aware", 120.0), row("prefix_aware-token", 140.0),
        row("sglang-cache_aware", 300.0), row("vllm-cache_aware", 250.0),
        {"router": "round_robin", "error": "boom"},
    ]  # fmt: skip
    got = {r["router"]: r for r in ttft_ratios(results)}
    assert set(got) == {"prefix_aware", "prefix_aware-token"}
    assert got["prefix_aware"]["vs_oracle"] == pytest.approx(1.2)
    assert got["prefix_aware"]["vs_best_peer"] == pytest.approx(0.48)
    assert got["prefix_aware-token"]["best_peer"] == "vllm-cache_aware"
    assert ttft_ratios([row("prefix_aware", 1.0)])[0]["vs_oracle"] is None
