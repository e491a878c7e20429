"""Probe a real vLLM CPU engine for the facts the router's vLLM adapter is built on.

What the KV-event adapter, the metrics scraper and token-mode routing assume
about vLLM must hold for the version users run, so this script asks the real
engine (``scripts/setup_vllm.sh`` installs it) rather than its documentation:

a. KV events: binds a ZMQ SUB socket, points one engine at it, sends a
   ~600-token chat request twice (streaming, ``include_usage``) and a
   completion; prints the decoded events (encoding, field names and types) and
   asks the replay socket for the buffered batches;
b. ``cache_salt``: what the events' ``extra_keys`` carry, and whether another
   tenant (another salt, or none) gets 0 cached tokens;
c. exactness: vLLM's ``prompt_tokens``, ``/tokenize`` and the events'
   ``token_ids`` against :mod:`prefixrouter.tokenization` (``encode_chat`` and
   ``encode``) for several chat shapes and a completion;
d. a small cache (64 blocks): distinct prompts force ``BlockRemoved``;
   ``POST /reset_prefix_cache`` sends ``AllBlocksCleared``; a restarted engine
   starts its sequence numbers again at 0;
e. ``/metrics``: ``vllm:cache_config_info`` labels, load and usage gauges;
f. startup time and memory (PSS, RSS) of one engine; two engines pinned to
   cores 0 and 1 started at once.

Run with the project's environment (it starts engines with
:mod:`prefixrouter.real_engines.vllm_fleet`; every engine is stopped on exit)::

    .venv/bin/python scripts/probe_vllm.py [--fixtures tests/real_engines/data] [--json out.json]

About 3 minutes on 2 cores. ``--fixtures DIR`` rewrites the captured frames
(``vllm_events.msgpack.jsonl``, base64 of each of the three ZMQ frames).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq

from prefixrouter.harness.engines import reset_prefix_caches
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.real_engines.vllm_fleet import (
    KvEventsOptions,
    VllmEngine,
    VllmFleet,
    VllmOptions,
    VllmSetup,
    ensure_vllm,
)
from prefixrouter.tokenization import load_tokenizer

BLOCK = 32
WORDS = [
    "cache",
    "prefix",
    "router",
    "engine",
    "token",
    "block",
    "latency",
    "request",
    "model",
    "prompt",
    "document",
    "question",
    "answer",
    "replica",
    "queue",
    "memory",
    "eviction",
    "hash",
    "chain",
    "tenant",
    "salt",
    "batch",
    "decode",
    "prefill",
    "throughput",
    "worker",
    "gateway",
    "metric",
    "event",
    "sequence",
    "replay",
]


def prose(seed: int, words: int) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


# ------------------------------------------------------------------ events


class Collector:
    """A bound SUB socket on a background thread; keeps every raw message."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.messages: list[tuple[float, list[bytes]]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                frames = self.sock.recv_multipart()
                with self._lock:
                    self.messages.append((time.time(), frames))

    def mark(self) -> int:
        with self._lock:
            return len(self.messages)

    def since(self, mark: int, settle_s: float = 0.7) -> list[list[bytes]]:
        """Messages after ``mark``, once none has arrived for ``settle_s``."""
        last = -1
        while True:
            time.sleep(settle_s)
            with self._lock:
                n = len(self.messages)
            if n == last:
                break
            last = n
        with self._lock:
            return [f for _, f in self.messages[mark:]]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def decode(frames: Sequence[bytes]) -> dict[str, Any]:
    topic, seq, payload = frames
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big"),
        "payload_kind": type(batch).__name__,
        "ts": batch[0],
        "events": batch[1],
        "dp_rank": batch[2] if len(batch) > 2 else None,
    }


def events_of(messages: Sequence[Sequence[bytes]]) -> list[dict[str, Any]]:
    return [ev for m in messages for ev in decode(m)["events"]]


def stored_parent_ok(first: list[dict[str, Any]], second: list[dict[str, Any]], n: int) -> bool:
    """Whether ``second``'s first event hangs off block ``n`` (1-based) of ``first``."""
    hashes = [h for e in first if e.get("type") == "BlockStored" for h in e["block_hashes"]]
    return len(hashes) >= n and second[0].get("parent_block_hash") == hashes[n - 1]


def shape(ev: Any) -> dict[str, Any]:
    """Field names with Python types (and lengths), for the report."""
    if not isinstance(ev, Mapping):
        return {"encoding": f"array of {len(ev)}", "first": ev[0]}
    out: dict[str, Any] = {"encoding": "map"}
    for k, v in ev.items():
        if isinstance(v, list):
            inner = sorted({type(x).__name__ for x in v})
            out[k] = f"list[{'|'.join(inner) or '-'}] len {len(v)}"
        else:
            out[k] = f"{type(v).__name__} {v!r}"[:80]
    return out


def replay(endpoint: str, start: int) -> list[int]:
    """Ask a replay socket for batches from ``start``; the sequence numbers returned."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    seqs: list[int] = []
    try:
        while sock.poll(3000):
            frames = sock.recv_multipart()
            _, _topic, seq, _payload = frames
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                break
            seqs.append(n)
    finally:
        sock.close(linger=0)
        ctx.term()
    return seqs


# ------------------------------------------------------------------ HTTP


def post(url: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


def stream(url: str, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def chat(engine: VllmEngine, messages: Any, **extra: Any) -> dict[str, Any]:
    """A streaming chat request; the usage of its last chunk."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": extra.pop("max_tokens", 8),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    usage: dict[str, Any] = {}
    for chunk in stream(engine.url + "/v1/chat/completions", body):
        if chunk.get("usage"):
            usage = chunk["usage"]
    return usage


def cached(usage: Mapping[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def metrics(engine: VllmEngine) -> str:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def memory(pid: int) -> dict[str, int]:
    """PSS and RSS (MB) summed over the process group led by ``pid``."""
    pss = rss = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            pgrp = int(stat.rsplit(")", 1)[1].split()[2])
            if pgrp != pid:
                continue
            for line in Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return {"pss_mb": pss // 1024, "rss_mb": rss // 1024}


# ------------------------------------------------------------------ probes


def probe_events_and_exactness(
    fleet: VllmFleet, col: Collector, report: dict[str, Any], fixtures: list[dict[str, Any]]
) -> None:
    tok = load_tokenizer(fleet.setup.model)
    engine = fleet.engines[0]
    messages = [
        {"role": "system", "content": "You answer questions about the document."},
        {"role": "user", "content": prose(1, 300) + "\n\nWhat is this about?"},
    ]
    ours = tok.encode_chat(messages)
    full = len(ours) // BLOCK * BLOCK

    # a. the same chat twice, then a completion
    m0 = col.mark()
    u1 = chat(engine, messages, max_tokens=40)
    ev1 = col.since(m0)
    m1 = col.mark()
    u2 = chat(engine, messages, max_tokens=40)
    ev2 = col.since(m1)
    prompt = prose(2, 300)
    m2 = col.mark()
    comp = post(
        engine.url + "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True},
    )
    ev3 = col.since(m2)
    fixtures += [
        {"what": "chat request 1 (600-token prompt, 40 output tokens): BlockStored", "m": m}
        for m in ev1
    ]
    fixtures += [
        {"what": "completion (text prompt, 8 output tokens): BlockStored", "m": m} for m in ev3
    ]
    e1, e2, e3 = events_of(ev1), events_of(ev2), events_of(ev3)
    stored1 = [e for e in e1 if e.get("type") == "BlockStored"]
    ev_tokens = [t for e in stored1 for t in e["token_ids"]]
    report["a_events"] = {
        "frames_per_message": [len(m) for m in ev1][:3],
        "decoded_messages_chat1": [
            {k: v for k, v in decode(m).items() if k != "events"} for m in ev1
        ],
        "event_shapes_chat1": [shape(e) for e in e1],
        "chat1_usage": u1,
        "chat2_usage": u2,
        "chat2_event_count": len(e2),
        "chat2_event_shapes": [shape(e) for e in e2],
        "chat2_parent_is_last_prompt_block": bool(e2 and stored_parent_ok(e1, e2, full // BLOCK)),
        "completion_usage": comp["usage"],
        "completion_event_shapes": [shape(e) for e in e3],
        "prompt_tokens_ours": len(ours),
        "full_prompt_blocks": full // BLOCK,
        "event_tokens_total": len(ev_tokens),
        "event_tokens_equal_ours_prefix": ev_tokens[:full] == ours[:full],
        "event_tokens_beyond_prompt": len(ev_tokens) - full,
        "parent_chain_ok": all(
            stored1[i]["parent_block_hash"] == stored1[i - 1]["block_hashes"][-1]
            for i in range(1, len(stored1))
        ),
        "first_parent": stored1[0]["parent_block_hash"] if stored1 else None,
    }
    if fleet.engines[0].replay_endpoint:
        seqs = [decode(m)["seq"] for m in ev1]
        report["a_events"]["replay_from_first_seq"] = replay(
            fleet.engines[0].replay_endpoint, seqs[0] if seqs else 0
        )
        report["a_events"]["live_seqs"] = [decode(m)["seq"] for m in col.since(0, 0.1)]

    # c. exactness for several message shapes
    shapes: dict[str, dict[str, Any]] = {
        "plain": {"messages": messages},
        "multi_turn": {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me about caches  \n\n  with  spaces\t."},
            ]
        },
        "content_parts": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "part one"},
                        {"type": "text", "text": "two"},
                    ],
                }
            ]
        },
        "unicode": {"messages": [{"role": "user", "content": "Größe ✓ 日本語 😀 <|im_end|> x"}]},
        "empty_content": {"messages": [{"role": "user", "content": ""}]},
        "tools": {
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather of a city",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                }
            ],
            # vLLM rejects tools with tool_choice "auto" unless started with a tool
            # parser; with "none" it still renders them.
            "tool_choice": "none",
        },
        "tools_with_system": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "weather?"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}},
                {
                    "type": "function",
                    "function": {"name": "g", "description": "é", "parameters": {}, "strict": True},
                },
            ],
            "tool_choice": "none",
        },
        "developer_role": {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "developer", "content": "D"},
                {"role": "user", "content": "x"},
            ]
        },
        "tool_calls_compact_args": {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": "calling",
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"z":1,"a":{"y":2,"b":"é"}}'},
                        },
                        {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "done"},
            ]
        },
        "tool_calls": {
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        },
    }
    exact: dict[str, Any] = {}
    for name, req in shapes.items():
        ours_ids = tok.encode_chat(req["messages"], req.get("tools"))
        row: dict[str, Any] = {"ours": len(ours_ids)}
        try:
            t = post(engine.url + "/tokenize", {"model": "tiny", **req})
            row["tokenize"] = t["count"]
            row["tokenize_equal"] = t["tokens"] == ours_ids
            u = chat(
                engine,
                req["messages"],
                max_tokens=1,
                **{k: v for k, v in req.items() if k != "messages"},
            )
            row["prompt_tokens"] = u.get("prompt_tokens")
            row["equal"] = row["tokenize_equal"] and u.get("prompt_tokens") == len(ours_ids)
            if not row["tokenize_equal"]:
                row["vllm_text"] = tok.decode(t["tokens"])
                row["our_text"] = tok.decode(ours_ids)
        except Exception as err:  # a shape vLLM rejects is a finding too
            row["error"] = repr(err)[:300]
        exact[name] = row
    comp_ids = tok.encode(prompt)
    t = post(engine.url + "/tokenize", {"model": "tiny", "prompt": prompt})
    stored3 = [x for e in e3 if e.get("type") == "BlockStored" for x in e["token_ids"]]
    cfull = len(comp_ids) // BLOCK * BLOCK
    exact["completion"] = {
        "ours": len(comp_ids),
        "prompt_tokens": comp["usage"]["prompt_tokens"],
        "tokenize_equal": t["tokens"] == comp_ids,
        "event_tokens_equal_ours_prefix": stored3[:cfull] == comp_ids[:cfull],
        "equal": comp["usage"]["prompt_tokens"] == len(comp_ids) and t["tokens"] == comp_ids,
    }
    report["c_exactness"] = exact

    # b. cache_salt
    salted = [
        {"role": "system", "content": "Tenant probe."},
        {"role": "user", "content": prose(3, 200)},
    ]
    m = col.mark()
    ua = chat(fleet.engines[0], salted, cache_salt="abc")
    eva = col.since(m)
    fixtures += [{"what": "chat with cache_salt 'abc': BlockStored", "m": x} for x in eva]
    ua2 = chat(engine, salted, cache_salt="abc")
    m = col.mark()
    ub = chat(engine, salted, cache_salt="def")
    evb = col.since(m)
    un = chat(engine, salted)
    salted_stored = [e for e in events_of(eva) if e.get("type") == "BlockStored"]
    report["b_cache_salt"] = {
        "abc_first_cached": cached(ua),
        "abc_again_cached": cached(ua2),
        "def_cached": cached(ub),
        "no_salt_cached": cached(un),
        "abc_extra_keys": [e.get("extra_keys") for e in salted_stored],
        "abc_parent": [e.get("parent_block_hash") for e in salted_stored],
        "def_extra_keys_first": [
            (e.get("extra_keys") or [None])[:2]
            for e in events_of(evb)
            if e.get("type") == "BlockStored"
        ],
    }
    try:
        post(
            engine.url + "/v1/chat/completions",
            {"model": "tiny", "messages": salted, "cache_salt": "a/b", "max_tokens": 1},
        )
        report["b_cache_salt"]["slash_salt"] = "accepted"
    except urllib.error.HTTPError as err:
        report["b_cache_salt"]["slash_salt"] = f"{err.code} {err.read().decode()[:200]}"

    # e. metrics
    text = metrics(engine)
    wanted = (
        "vllm:cache_config_info",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    )
    report["e_metrics"] = [
        line
        for line in text.splitlines()
        if line.startswith(wanted) or line.startswith(tuple(f"# TYPE {w}" for w in wanted))
    ]


def probe_small_cache(
    fleet: VllmFleet, col: Collector, report: dict[str, Any], fixtures: list[dict[str, Any]]
) -> None:
    engine = fleet.engines[0]
    out: dict[str, Any] = {}
    m = col.mark()
    usages = []
    for i in range(5):  # 5 x ~30 blocks into 64
        usages.append(
            post(
                engine.url + "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": prose(100 + i, 500),
                    "max_tokens": 4,
                    "ignore_eos": True,
                },
            )["usage"]
        )
    msgs = col.since(m)
    evs = events_of(msgs)
    removed = [e for e in evs if e.get("type") == "BlockRemoved"]
    out["prompt_tokens"] = [u["prompt_tokens"] for u in usages]
    out["event_types"] = [e.get("type") for e in evs]
    out["removed_shapes"] = [shape(e) for e in removed[:2]]
    out["removed_total_blocks"] = sum(len(e["block_hashes"]) for e in removed)
    stored_hashes = {h for e in evs if e.get("type") == "BlockStored" for h in e["block_hashes"]}
    out["removed_all_previously_stored"] = all(
        h in stored_hashes for e in removed for h in e["block_hashes"]
    )
    # Eviction order: position of each removed block in its chain (0 = first
    # block), and whether what survives of every chain is still a prefix.
    position: dict[int, tuple[int, int]] = {}  # hash -> (chain, index)
    chains: list[list[int]] = []
    for e in evs:
        if e.get("type") != "BlockStored":
            continue
        parent = e["parent_block_hash"]
        if parent is None or parent not in position:
            chains.append([])
            chain = len(chains) - 1
        else:
            chain = position[parent][0]
        for h in e["block_hashes"]:
            position[h] = (chain, len(chains[chain]))
            chains[chain].append(h)
    gone = {h for e in removed for h in e["block_hashes"]}
    out["removed_positions_first_batch"] = [
        position[h] for e in removed[:40] for h in e["block_hashes"] if h in position
    ]
    out["survivors_are_prefixes"] = all(
        all(h not in gone for h in c[: sum(h not in gone for h in c)]) for c in chains
    )
    fixtures += [
        {"what": "small cache (64 blocks): a batch with BlockRemoved", "m": x}
        for x in msgs
        if any(e.get("type") == "BlockRemoved" for e in decode(x)["events"])
    ][:2]
    m = col.mark()
    # No announcing request: this probe records what the reset alone sends.
    asyncio.run(reset_prefix_caches([engine.url], announce=False))
    msgs = col.since(m)
    out["after_reset_idle"] = [decode(x) for x in msgs]
    # Events leave at the end of an engine step: an idle engine sends them with
    # the next request's.
    m = col.mark()
    post(
        engine.url + "/v1/completions",
        {"model": "tiny", "prompt": prose(6, 100), "max_tokens": 2, "ignore_eos": True},
    )
    msgs = col.since(m)
    out["after_reset_next_request"] = [
        {**d, "events": [shape(e) for e in d["events"]]} for d in map(decode, msgs)
    ]
    fixtures += [
        {"what": "POST /reset_prefix_cache, then a completion: AllBlocksCleared first", "m": x}
        for x in msgs
    ]
    # restart: sequence numbers start again at 0
    seq_before = decode(col.since(0, 0.1)[-1])["seq"]
    t0 = time.monotonic()
    new = fleet.restart(engine)
    out["restart_s"] = round(time.monotonic() - t0, 1)
    m = col.mark()
    post(new.url + "/v1/completions", {"model": "tiny", "prompt": prose(7, 200), "max_tokens": 2})
    after = [decode(x) for x in col.since(m)]
    out["seq_before_restart"] = seq_before
    out["seqs_after_restart"] = [a["seq"] for a in after]
    out["topics_after_restart"] = sorted({a["topic"] for a in after})
    report["d_small_cache"] = out


def run_one_engine(
    setup: VllmSetup, col: Collector, report: dict[str, Any], fixtures: list[dict[str, Any]]
) -> None:
    """a, b, c, e and f on one engine: full cache, events with a replay socket."""
    events = KvEventsOptions(col.endpoint, topic="kv@{port}", replay=True)
    with VllmFleet(1, VllmOptions(max_model_len=8192, kv_events=events), setup=setup) as fleet:
        t0 = time.monotonic()
        fleet.start()
        engine = fleet.engines[0]
        report["f_startup_one_s"] = round(time.monotonic() - t0, 1)
        with urllib.request.urlopen(engine.url + "/version", timeout=5) as resp:
            report["vllm_version"] = json.loads(resp.read())["version"]
        report["command"] = engine.command
        report["f_memory_idle"] = memory(engine.pid)
        probe_events_and_exactness(fleet, col, report, fixtures)
        report["f_memory_after_requests"] = memory(engine.pid)


def run_small_cache(
    setup: VllmSetup, col: Collector, report: dict[str, Any], fixtures: list[dict[str, Any]]
) -> None:
    """d on one engine with 64 blocks."""
    events = KvEventsOptions(col.endpoint, topic="kv@{port}")
    small = VllmOptions(max_model_len=2016, num_gpu_blocks_override=64, kv_events=events)
    with VllmFleet(1, small, setup=setup) as fleet:
        fleet.start()
        info = [x for x in metrics(fleet.engines[0]).splitlines() if "cache_config_info{" in x]
        report["d_cache_config_info"] = info
        probe_small_cache(fleet, col, report, fixtures)


def run_pair(setup: VllmSetup, report: dict[str, Any]) -> None:
    """f: two engines pinned to cores 0 and 1, started at once; concurrent prefill."""
    with VllmFleet(2, VllmOptions(max_model_len=8192), setup=setup, cores=[0, 1]) as fleet:
        t0 = time.monotonic()
        engines = [fleet.launch(0), fleet.launch(1)]
        ready: dict[int, float] = {}
        for e in engines:
            fleet.wait_healthy([e])
            ready[e.index] = round(time.monotonic() - t0, 1)
        out: dict[str, Any] = {
            "healthy_after_s": ready,
            "memory": [memory(e.pid) for e in engines],
            "cores": [e.core for e in engines],
        }
        body = {"model": "tiny", "prompt": prose(9, 3000), "max_tokens": 1}
        t1 = time.monotonic()
        post(engines[0].url + "/v1/completions", body)
        out["prefill_5700_tokens_alone_s"] = round(time.monotonic() - t1, 2)
        done: list[float] = []

        def one(e: VllmEngine, seed: int) -> None:
            s = time.monotonic()
            post(e.url + "/v1/completions", {**body, "prompt": prose(seed, 3000)})
            done.append(round(time.monotonic() - s, 2))

        threads = [threading.Thread(target=one, args=(e, 20 + e.index)) for e in engines]
        t1 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["prefill_5700_tokens_both_at_once_s"] = done
        out["both_wall_s"] = round(time.monotonic() - t1, 2)
        report["f_two_engines"] = out


def write_fixtures(directory: Path, fixtures: Sequence[Mapping[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for f in fixtures:
        d = decode(f["m"])
        frames = [base64.b64encode(x).decode() for x in f["m"]]
        row = {"what": f["what"], "topic": d["topic"], "seq": d["seq"], "frames": frames}
        lines.append(json.dumps(row))
    path = directory / "vllm_events.msgpack.jsonl"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} messages to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=None, help="write captured frames here")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--parts",
        default="events,small,pair",
        help="comma-separated: events (a b c e f), small (d), pair (f: two engines)",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    setup = ensure_vllm()
    report: dict[str, Any] = {}
    fixtures: list[dict[str, Any]] = []
    col = Collector(f"tcp://{HOST}:{free_port()}")
    try:
        if "events" in parts:
            run_one_engine(setup, col, report, fixtures)
        if "small" in parts:
            run_small_cache(setup, col, report, fixtures)
        if "pair" in parts:
            run_pair(setup, report)
    finally:
        col.close()
        print(json.dumps(report, indent=1, default=repr))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=repr) + "\n")
    if args.fixtures:
        write_fixtures(args.fixtures, fixtures)


if __name__ == "__main__":
    main()
