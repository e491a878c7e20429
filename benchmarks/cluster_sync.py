"""What replica sync costs: propagation lag and CPU per request per replica.

Setup, all on loopback, every process started by the harness and stopped by PID:

* a real ``nats-server -js`` (:class:`prefixrouter.harness.nats.NatsServer`);
* **engines**: :mod:`prefixrouter.bench.instant` on three ports (answers at
  once, so the gateways' own work dominates);
* **replicas**: two ``python -m prefixrouter.gateway --cluster ... --replica-id``
  processes (:mod:`prefixrouter.harness.replicas`) and, for the comparison,
  two lone gateways with the same configuration and no ``--cluster``;
* **load**: this process, open loop (:mod:`prefixrouter.bench.loadgen`) at
  ``--rate`` requests/s *per gateway*, both gateways of a pair at once, 8 KB
  chat bodies (64 variants of a shared 6 KB system prompt), text mode.

Rounds alternate between the clustered pair and the lone pair, so a burst of
other work on a shared machine lands on both. Figures:

* ``lag_p50_ms`` / ``lag_p99_ms``: a peer's fact message, from its publish
  (after the batch window) to its receipt, over the last 8,192 live messages
  of each replica (``/admin/process``: the replica's samples);
* ``sync_cpu_ms_per_request``: the CPU the replica's node counted for
  publishing and applying facts (encode, envelope, publish call; decode,
  registry, ``apply_peer``), per request the replica served: it applied its
  peer's facts too, so this is the cost per request per replica at two
  replicas. It leaves out nats-py's own protocol work (socket reads, parsing,
  flushing);
* ``process_cpu_ms_per_request``: the whole gateway process's CPU per request,
  clustered and lone, and their difference (``sync_process_cpu_ms_per_request``),
  which includes nats-py; noisier on a shared machine.

``--hot-loop N`` measures no network and no processes: N requests' facts
(text mode, the same bodies) recorded by one dispatcher, encoded into
messages of ``--per-message`` requests' facts each, then unpacked, decoded
and applied by a second dispatcher in this process, best of five repeats:
the microseconds per request of the publishing side and of the applying
side, free of the noise of a shared machine but hot (caches hold everything).

Usage::

    python benchmarks/cluster_sync.py [--rate 200] [--seconds 8] [--rounds 4] [--json]
    python benchmarks/cluster_sync.py --hot-loop 3000 [--per-message 1]

Target (issue 14): sync at most 0.05 ms of CPU per request per replica;
propagation lag p99 under 10 ms on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console

from prefixrouter.bench.loadgen import build_requests, open_loop
from prefixrouter.bench.overhead import overhead_bodies, process_cpu_s
from prefixrouter.harness.health import wait_routable
from prefixrouter.harness.nats import NatsServer
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.harness.replicas import start_replicas, wait_ready_async

ADMIN_KEY = "bench-admin-key"
PATH = "/v1/chat/completions"
console = Console(stderr=True)


async def _process(server: Server) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with (
        aiohttp.ClientSession(headers=headers) as s,
        s.get(server.url + "/admin/process") as r,
    ):
        data: dict[str, Any] = await r.json()
        return data


async def _round(pair: list[Server], bodies: list[bytes], rate: float, seconds: float) -> int:
    reqs = [build_requests(s.port, PATH, bodies) for s in pair]
    results = await asyncio.gather(
        *(open_loop(s.port, r, rate, seconds, 20) for s, r in zip(pair, reqs, strict=True))
    )
    errors = sum(res.errors for res in results)
    if errors:
        console.print(f"[yellow]{errors} errors in a round")
    return sum(len(res.values) + 20 for res in results)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bodies = overhead_bodies("tiny")
    with tempfile.TemporaryDirectory() as tmp, Fleet() as fleet, NatsServer() as nats:
        ports = [free_port() for _ in range(3)]
        cmd = [sys.executable, "-m", "prefixrouter.bench.instant", "--ports"]
        engines = fleet.start_command(
            "instant engines", [*cmd, ",".join(map(str, ports))], ports[-1]
        )
        await fleet.wait_healthy([engines], 30)
        cfg = Path(tmp) / "gw.yaml"
        cfg.write_bytes(
            orjson.dumps(
                {
                    "workers": [
                        {"url": f"http://127.0.0.1:{p}", "id": f"e{i}"} for i, p in enumerate(ports)
                    ],
                    "server": {"admin_api_key": ADMIN_KEY},
                    "cluster": {"batch_window_s": args.batch_window},
                }
            )
        )
        replicas = start_replicas(fleet, cfg, nats.url, 2)
        lone = [
            fleet.start(f"lone{i}", "prefixrouter.gateway", ["--config", str(cfg)])
            for i in range(2)
        ]
        await wait_ready_async(replicas, 60)
        await fleet.wait_healthy(lone, 60)
        for s in [*replicas, *lone]:
            await wait_routable(s.url)
        pairs = {"clustered": replicas, "lone": lone}
        cpu = {k: 0.0 for k in pairs}
        sent = {k: 0 for k in pairs}
        before = [await _process(s) for s in replicas]
        for i in range(args.rounds):
            for name, pair in pairs.items():
                console.print(
                    f"round {i + 1}/{args.rounds}: {name} pair, "
                    f"{args.rate:g} req/s each for {args.seconds / args.rounds:g} s"
                )
                c0 = sum(process_cpu_s(s.pid) for s in pair)
                sent[name] += await _round(pair, bodies, args.rate, args.seconds / args.rounds)
                cpu[name] += sum(process_cpu_s(s.pid) for s in pair) - c0
        after = [await _process(s) for s in replicas]
    per_replica = []
    for s, b, a in zip(replicas, before, after, strict=True):
        served = a["requests"] - b["requests"]
        sync = a["cluster_sync_cpu_s"] - b["cluster_sync_cpu_s"]
        per_replica.append(
            {
                "replica": s.name,
                "requests": served,
                "facts_published": a["cluster_facts_published"] - b["cluster_facts_published"],
                "facts_applied": a["cluster_facts_applied"] - b["cluster_facts_applied"],
                "messages_published": a["cluster_messages_published"]
                - b["cluster_messages_published"],
                "sync_cpu_ms_per_request": round(1e3 * sync / max(1, served), 4),
                "lag_p50_ms": round(a.get("cluster_lag_p50_ms", 0.0), 3),
                "lag_p99_ms": round(a.get("cluster_lag_p99_ms", 0.0), 3),
            }
        )
    proc = {k: 1e3 * cpu[k] / max(1, sent[k]) for k in pairs}
    return {
        "rate_per_replica": args.rate,
        "seconds": args.seconds,
        "batch_window_s": args.batch_window,
        "replicas": per_replica,
        "process_cpu_ms_per_request": {k: round(v, 4) for k, v in proc.items()},
        "sync_process_cpu_ms_per_request": round(proc["clustered"] - proc["lone"], 4),
    }


def hot_loop(n: int, per_message: int) -> dict[str, Any]:
    """Publish-side and apply-side microseconds per request, in process (module doc)."""
    import time

    from prefixrouter.cluster import envelope
    from prefixrouter.cluster.codec import decode_facts, encode_facts
    from prefixrouter.core import Dispatcher, Outcome, Router, WorkerId
    from prefixrouter.core.hashing import BlockHasher
    from prefixrouter.core.types import CacheNamespace, RequestId, RoutingRequest, WorkerView

    chats = [orjson.loads(b) for b in overhead_bodies("tiny")]
    texts = ["".join(m["content"] for m in c["messages"]) for c in chats]
    views = [WorkerView(WorkerId(f"w{i}"), kv_capacity_blocks=1 << 16) for i in range(3)]
    ns = CacheNamespace("tiny")
    best_pub = best_apply = float("inf")
    for _ in range(5):
        a = Dispatcher(Router("prefix_aware", BlockHasher()), "text", record_facts=True)
        b = Dispatcher(Router("prefix_aware", BlockHasher()), "text")
        batches = []
        for i in range(n):
            req = RoutingRequest(
                RequestId(f"r{i}"),
                ns,
                text=texts[i % len(texts)],
                prompt_tokens=2048,
                max_tokens=16,
                model="tiny",
            )
            adm = a.admit(req, views, i * 1e-3)
            a.complete(adm, Outcome(1536, 0.01), i * 1e-3)
            if (i + 1) % per_message == 0:
                batches.append(a.drain_facts())
        head = envelope.Envelope(envelope.FACTS, "a", 1, 2, 0.0)
        t0 = time.process_time()
        messages = [envelope.pack(head, body) for facts in batches for body in encode_facts(facts)]
        t1 = time.process_time()
        for data in messages:
            got, body = envelope.unpack(data)
            for fact in decode_facts(body):
                b.apply_peer(got.origin, fact, 1.0)
        t2 = time.process_time()
        best_pub = min(best_pub, (t1 - t0) / n)
        best_apply = min(best_apply, (t2 - t1) / n)
    return {
        "requests": n,
        "requests_per_message": per_message,
        "publish_side_us": round(best_pub * 1e6, 2),
        "apply_side_us": round(best_apply * 1e6, 2),
        "sync_us_per_request_per_replica_at_2": round((best_pub + best_apply) * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=200.0, help="requests/s per replica")
    ap.add_argument("--seconds", type=float, default=8.0, help="load per pair, all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-window", type=float, default=0.002, help="cluster.batch_window_s")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--hot-loop", type=int, default=0, metavar="N", help="in process, no network")
    ap.add_argument("--per-message", type=int, default=1, help="requests per message (hot loop)")
    args = ap.parse_args()
    if args.hot_loop:
        print(orjson.dumps(hot_loop(args.hot_loop, args.per_message)).decode())
        return
    out = asyncio.run(run(args))
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return
    for r in out["replicas"]:
        console.print(
            f"{r['replica']}: {r['requests']} requests, lag p50 {r['lag_p50_ms']} ms "
            f"p99 {r['lag_p99_ms']} ms, sync CPU {r['sync_cpu_ms_per_request']} ms/request"
        )
    p = out["process_cpu_ms_per_request"]
    console.print(
        f"process CPU per request: clustered {p['clustered']} ms, lone {p['lone']} ms, "
        f"difference {out['sync_process_cpu_ms_per_request']} ms"
    )
    print(orjson.dumps(out).decode())


if __name__ == "__main__":
    main()
