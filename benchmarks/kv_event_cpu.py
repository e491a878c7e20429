"""CPU per KV event of a gateway replica, through real ZMQ sockets on loopback.

What one gateway process spends to hear an engine's KV events and apply them
to its index, with one replica and with several (issue 14: in connect mode
every replica hears every engine, so each replica pays this for every
engine's events).

Setup, per run: this process plays the engine, a PUB socket bound on
loopback as vLLM's publisher is with ``"endpoint": "tcp://*:P"``; it sends
``--events`` messages in vLLM's framing (``[topic, seq (8-byte big-endian),
msgpack [ts, [event], 0]]``), each one ``BlockStored`` of ``B`` blocks of 16
tokens (a new chain each, so every block is translated and indexed), paced at
``--rate`` messages per second (vLLM publishes one batch per engine step; an
unpaced burst is cheaper per message, ZMQ hands queued messages over without
waking the loop). Each subscriber is its own process, as a replica is: a
:class:`~prefixrouter.real_engines.kv_subscriber.KvEventSubscriber` in
connect mode feeding a :class:`~prefixrouter.core.dispatch.Dispatcher` (token
mode, the ``prefix_aware`` policy) on a uvloop event loop, as the gateway runs. It measures its own
CPU time (``time.process_time``: every thread, ZMQ's I/O thread included;
``resource.getrusage`` user and system split) from the moment it first hears
the publisher until it has applied the last message, and reports it.

It also times ``KvEventSubscriber.handle`` alone, in this process, on the same
frames: decoding, translation and the index, without sockets or the loop.

Usage::

    python benchmarks/kv_event_cpu.py [--events 10000] [--blocks 1,16] [--subscribers 1,2]
        [--rate 5000] [--json]

Reported per run: CPU microseconds per event and per block of each
subscriber process, and of ``handle`` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import uvloop
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prefixrouter.core.dispatch import Dispatcher
from prefixrouter.core.hashing import BlockHasher
from prefixrouter.core.policy import create_policy
from prefixrouter.core.router import Router
from prefixrouter.core.types import WorkerId
from prefixrouter.harness.ports import free_port
from prefixrouter.real_engines.kv_subscriber import KvEventSubscriber

BLOCK_SIZE = 16
SEED = 1234
TOPIC = "kv@bench"
WORKER = WorkerId("bench")
READY_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 300.0


def message(seq: int, blocks: int) -> list[bytes]:
    """Message ``seq``: one ``BlockStored`` of a new chain of ``blocks`` blocks."""
    tokens = [seq * blocks * BLOCK_SIZE + i for i in range(blocks * BLOCK_SIZE)]  # distinct
    hashes = [seq * blocks + i + 1 for i in range(blocks)]
    event = ["BlockStored", hashes, None, tokens, BLOCK_SIZE, None, None]
    payload = msgpack.packb([time.time(), [event], 0])
    return [TOPIC.encode(), seq.to_bytes(8, "big"), payload]


def new_subscriber(publisher: str | None) -> tuple[KvEventSubscriber, Router]:
    router = Router(create_policy("prefix_aware"), BlockHasher(block_size=BLOCK_SIZE))
    sub = KvEventSubscriber(None, Dispatcher(router, "token"), time.monotonic)
    sub.add_worker(WORKER, TOPIC, lambda lora, salt: SEED, publisher=publisher)
    return sub, router


# ------------------------------------------------------------------ subscriber process


async def serve_subscriber(publisher: str, expect: int) -> dict[str, Any]:
    """Hear ``expect`` messages from ``publisher``; CPU from the first probe to the last one."""
    sub, router = new_subscriber(publisher)
    feed = sub.feed(WORKER)
    assert feed is not None
    stats = feed.stats
    heard, done = asyncio.Event(), asyncio.Event()
    handle = sub.handle

    def counting(frames: list[bytes]) -> None:
        # Wakes the waiter without polling (a poll would add its own CPU).
        handle(frames)
        if sub.unknown_topics:
            heard.set()
        if stats.messages >= expect:
            done.set()

    sub.handle = counting  # type: ignore[method-assign]
    await sub.start()
    try:
        await asyncio.wait_for(heard.wait(), READY_TIMEOUT_S)
        cpu0, ru0, wall0 = (
            time.process_time(),
            resource.getrusage(resource.RUSAGE_SELF),
            time.time(),
        )
        print("ready", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), RUN_TIMEOUT_S)
        cpu1, ru1, wall1 = (
            time.process_time(),
            resource.getrusage(resource.RUSAGE_SELF),
            time.time(),
        )
        return {
            "cpu_s": cpu1 - cpu0,
            "user_s": ru1.ru_utime - ru0.ru_utime,
            "system_s": ru1.ru_stime - ru0.ru_stime,
            "wall_s": wall1 - wall0,
            "messages": stats.messages,
            "stored_events": stats.stored,
            "gaps": stats.gaps,
            "index_blocks": router.index.blocks_of(WORKER),
        }
    finally:
        await sub.stop()


# ------------------------------------------------------------------ the engine side


@dataclass
class Run:
    blocks: int
    subscribers: int
    results: list[dict[str, Any]]
    publisher_cpu_s: float


def run_once(events: int, blocks: int, subscribers: int, rate: float) -> Run:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
    pub.bind(endpoint)
    cmd = [sys.executable, __file__, "--serve-subscriber", endpoint, "--events", str(events)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(subscribers)]
    try:
        frames = [message(seq, blocks) for seq in range(events)]
        # Probe until every subscriber has heard us (ZMQ's slow joiner).
        ready = 0
        deadline = time.monotonic() + READY_TIMEOUT_S
        probe = [b"probe", (0).to_bytes(8, "big"), msgpack.packb([0.0, [], 0])]
        sel = selectors.DefaultSelector()
        for p in procs:
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ)
        while ready < subscribers:
            if time.monotonic() > deadline:
                raise RuntimeError("the subscribers never heard the publisher")
            pub.send_multipart(probe)
            for key, _ in sel.select(timeout=0.01):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if line.strip() == "ready":
                    ready += 1
                    sel.unregister(key.fileobj)
        cpu0 = time.process_time()
        start = time.monotonic()
        for seq, f in enumerate(frames):
            if rate > 0:
                due = start + seq / rate
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
            pub.send_multipart(f)
        publisher_cpu = time.process_time() - cpu0
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
            if p.returncode != 0:
                raise RuntimeError(f"a subscriber failed (exit {p.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return Run(blocks, subscribers, results, publisher_cpu)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        pub.close()
        ctx.term()


def handle_only(events: int, blocks: int) -> float:
    """CPU seconds of ``KvEventSubscriber.handle`` alone on ``events`` messages."""
    sub, _ = new_subscriber(None)
    frames = [message(seq, blocks) for seq in range(events)]
    cpu0 = time.process_time()
    for f in frames:
        sub.handle(f)
    return time.process_time() - cpu0


# ------------------------------------------------------------------ report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=10_000, help="messages per run")
    ap.add_argument("--blocks", default="1,16", help="blocks per BlockStored, comma-separated")
    ap.add_argument("--subscribers", default="1,2", help="replica counts, comma-separated")
    ap.add_argument("--rate", type=float, default=5000.0, help="messages/s (0: unpaced)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--serve-subscriber", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_subscriber:
        # The gateway's event loop (prefixrouter serve runs on uvloop).
        result = uvloop.run(serve_subscriber(args.serve_subscriber, args.events))
        print(json.dumps(result), flush=True)
        return

    blocks_list = [int(b) for b in args.blocks.split(",")]
    subs_list = [int(s) for s in args.subscribers.split(",")]
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("runs", total=len(blocks_list) * (len(subs_list) + 1))
        for blocks in blocks_list:
            progress.update(task, description=f"handle() alone, {blocks} blocks/event")
            cpu = handle_only(args.events, blocks)
            rows.append(
                {
                    "blocks": blocks,
                    "subscribers": 0,
                    "what": "handle() alone",
                    "us_per_event": [cpu / args.events * 1e6],
                    "us_per_block": [cpu / (args.events * blocks) * 1e6],
                }
            )
            progress.advance(task)
            for n in subs_list:
                progress.update(task, description=f"{n} subscriber(s), {blocks} blocks/event")
                run = run_once(args.events, blocks, n, args.rate)
                for r in run.results:
                    if r["messages"] != args.events or r["gaps"]:
                        raise SystemExit(f"a subscriber lost messages: {r}")
                rows.append(
                    {
                        "blocks": blocks,
                        "subscribers": n,
                        "what": f"{n} subscriber process(es)",
                        "us_per_event": [r["cpu_s"] / args.events * 1e6 for r in run.results],
                        "us_per_block": [
                            r["cpu_s"] / (args.events * blocks) * 1e6 for r in run.results
                        ],
                        "user_s": [r["user_s"] for r in run.results],
                        "system_s": [r["system_s"] for r in run.results],
                        "wall_s": [r["wall_s"] for r in run.results],
                        "publisher_cpu_s": run.publisher_cpu_s,
                    }
                )
                progress.advance(task)
    if args.json:
        meta = {"events": args.events, "rate": args.rate, "block_size": BLOCK_SIZE}
        print(json.dumps({**meta, "runs": rows}, indent=2))
        return
    table = Table(title=f"CPU per KV event ({args.events} events, {args.rate:g} msg/s)")
    for col in ("blocks/event", "measured", "us/event", "us/block", "publisher CPU s"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["blocks"]),
            row["what"],
            " / ".join(f"{v:.1f}" for v in row["us_per_event"]),
            " / ".join(f"{v:.2f}" for v in row["us_per_block"]),
            f"{row['publisher_cpu_s']:.2f}" if "publisher_cpu_s" in row else "",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
