"""What replica sync costs: CPU per request per replica and propagation lag, at several rates.

Setup, all on loopback, every process started by the harness and stopped by PID:

* **engines**: :mod:`prefixrouter.bench.instant` on four ports, answering
  after ``--ttft-ms`` (first bytes) and ``--decode-ms`` more (the rest), so a
  request's routing, first token and answer happen apart as they do live
  (each is a fact its peers must hear);
* **clusters**: ``--replicas`` gateway replicas (``python -m
  prefixrouter.gateway --cluster ... --replica-id``,
  :mod:`prefixrouter.harness.replicas`) on their own real ``nats-server -js``
  (:class:`prefixrouter.harness.nats.NatsServer`): one of this checkout and,
  with ``--baseline-src DIR`` (another checkout's ``src``, e.g. ``git archive
  main src | tar -x -C /tmp/base``), one of that code, side by side on the
  same engines;
* **load**: this process, open loop (:mod:`prefixrouter.bench.loadgen`) at
  each of ``--rates`` requests/s *across the cluster*, spread over the
  replicas round robin (replica ``k`` of ``N`` takes requests ``k, k + N,
  ...``, as a Service would), 8 KB chat bodies (64 variants of a shared 6 KB
  system prompt) or, with ``--doc-kb K``, one of three K KB documents with a
  new question each (doc-qa's shape: a long known prefix, a new tail).

For each rate the two clusters take turns, ``--rounds`` rounds each, so a
burst of other work on a shared machine lands on both. Figures per rate and
cluster:

* ``sync_ms_per_request``: CPU the replica's node counted for sync (publish:
  drain, encode, publish call; receive: the check and hold of each message
  heard; apply: unpack, decode, ``apply_peer``) **divided by the requests of
  the whole cluster** (every request's facts reach every replica, so its sync
  work scales with the cluster's requests; the definition of ``prefixrouter
  bench --replicas`` and of ``replicas_live_results.md``), mean and range over
  the replicas. nats-py's own protocol work is not in it;
* ``process_ms_per_request``: each replica's whole process CPU per request it
  served (everything: HTTP, routing, sync, nats-py), mean over replicas;
* ``marginal_ms_per_request`` (with ``--no-sync-side``: ``--replicas``
  gateways without ``--cluster``, sharing nothing, in the same rounds on the
  same engines): what sync adds to a replica's whole process per request of
  the cluster, ``(process_ms_per_request - no sync's) / replicas``. It counts
  nats-py's work, which ``sync_ms_per_request`` leaves out, and the cost of
  waking for each message (``replicas_live_results.md``);
* ``lag_p50_ms`` / ``lag_p99_ms`` / ``over_10ms``: the fact propagation lag
  from every replica's ``prefixrouter_cluster_propagation_lag_seconds``
  histogram (deltas over the rounds; percentiles interpolated within buckets
  as Prometheus does, and the exact share of messages over 10 ms: p99 is
  under 10 ms when that share is under 1 %). This checkout dates a message by
  its first fact, so its lag includes the batch wait; code before this stop
  dated it at publish, after the 2-4 ms window;
* ``messages_per_request``: facts messages published per request.

Usage::

    python benchmarks/cluster_sync.py [--replicas 4] [--rates 8,50,200] [--seconds 12]
        [--rounds 2] [--baseline-src DIR] [--no-sync-side] [--doc-kb 0] [--json FILE]
    python benchmarks/cluster_sync.py --hot-loop 3000 [--per-message 1] [--doc-kb 0] [--gap-ms 0]

``--hot-loop N`` measures no network and no processes: N requests' facts
recorded by one dispatcher, encoded into messages of ``--per-message``
requests' facts each, then unpacked, decoded and applied by a second
dispatcher in this process, best of five repeats: the microseconds per
request of the publishing side and of the applying side, free of the noise
of a shared machine but hot (caches hold everything). With ``--gap-ms G``
it also applies the same messages twice more with a fresh dispatcher, back
to back and each after ``G`` ms of unrelated interpreter work, and prints
both apply figures and their ratio: what the same calls cost when they run
cold, as a live replica's do between other work.

Target (issue 14): sync at most 0.05 ms of CPU per request per replica;
propagation lag p99 under 10 ms on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from prefixrouter.bench.loadgen import build_requests, open_loop
from prefixrouter.bench.overhead import overhead_bodies, process_cpu_s
from prefixrouter.harness.health import wait_routable
from prefixrouter.harness.nats import NatsServer
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.harness.replicas import GATEWAY_MODULE, start_replicas, wait_ready_async
from prefixrouter.prometheus import histogram, histogram_quantile

ADMIN_KEY = "bench-admin-key"
PATH = "/v1/chat/completions"
LAG = "prefixrouter_cluster_propagation_lag_seconds"
NO_SYNC = "no sync"
"""The side of ``--no-sync-side``: the same replicas without ``--cluster``."""
SETTLE_S = 0.8
"""After a round: the last answers' facts arrive and held ones are applied (0.5 s bound)."""
console = Console(stderr=True)


def doc_bodies(doc_kb: int, n: int = 512, seed: int = 0) -> list[bytes]:
    """``n`` chat bodies: one of three ``doc_kb`` KB documents, then a question of its own."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(2000)
    ]
    docs = []
    for _ in range(3):
        text: list[str] = []
        size = 0
        while size < doc_kb * 1024:
            w = rng.choice(words)
            text.append(w)
            size += len(w) + 1
        docs.append(" ".join(text))
    out = []
    for i in range(n):
        question = f"Question {i}: what does section {rng.randint(1, 999)} say? " * 8
        body = {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": docs[i % 3]},
                {"role": "user", "content": question},
            ],
            "max_tokens": 16,
            "stream": True,
        }
        out.append(orjson.dumps(body))
    return out


def streamed(bodies: list[bytes]) -> list[bytes]:
    """``bodies`` asking for a stream (the gateway notes the first token as it comes)."""
    return [orjson.dumps({**orjson.loads(b), "stream": True}) for b in bodies]


async def _state(session: aiohttp.ClientSession, server: Server) -> dict[str, Any]:
    async with session.get(server.url + "/admin/process") as r:
        data: dict[str, Any] = await r.json()
    async with session.get(server.url + "/metrics") as r:
        data["lag"] = histogram(await r.text(), LAG)
    data["cpu_s"] = process_cpu_s(server.pid)
    return data


async def _round(cluster: Sequence[Server], bodies: list[bytes], rate: float, s: float) -> int:
    """Round robin over the replicas at ``rate`` across them; returns the errors."""
    n = len(cluster)

    async def one(k: int, server: Server) -> int:
        await asyncio.sleep(k / rate)  # replica k takes requests k, k + n, ...
        mine = bodies[k::n] or bodies
        res = await open_loop(server.port, build_requests(server.port, PATH, mine), rate / n, s, 0)
        return res.errors

    errors = await asyncio.gather(*(one(k, srv) for k, srv in enumerate(cluster)))
    return sum(errors)


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0.0)) - float(before.get(key, 0.0))


def _summary(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """One cluster's figures at one rate from its replicas' (before, after) pairs."""
    requests = sum(_delta(b, a, "requests") for b, a in rows)
    total = max(1.0, requests)
    sync = [1e3 * _delta(b, a, "cluster_sync_cpu_s") / total for b, a in rows]
    phases = {
        p: sum(1e3 * _delta(b, a, f"cluster_{p}_cpu_s") for b, a in rows) / total / len(rows)
        for p in ("publish", "receive", "apply")
    }
    proc = [1e3 * (a["cpu_s"] - b["cpu_s"]) / max(1.0, _delta(b, a, "requests")) for b, a in rows]
    lag: dict[float, float] = {}
    for b, a in rows:
        for le, count in a["lag"].items():
            lag[le] = lag.get(le, 0.0) + count - b["lag"].get(le, 0.0)
    heard = lag.get(float("inf"), 0.0)
    messages = sum(_delta(b, a, "cluster_messages_published") for b, a in rows)
    passes = sum(_delta(b, a, "cluster_apply_passes") for b, a in rows)
    return {
        "requests": int(requests),
        "sync_ms_per_request": round(sum(sync) / len(sync), 4),
        "sync_ms_per_request_range": [round(min(sync), 4), round(max(sync), 4)],
        "phase_ms_per_request": {k: round(v, 4) for k, v in phases.items()},
        "process_ms_per_request": round(sum(proc) / len(proc), 3),
        "messages_per_request": round(messages / total, 3),
        "messages_per_apply_pass": round((heard / passes) if passes else 0.0, 2),
        "lag_p50_ms": round(1e3 * histogram_quantile(lag, 0.5), 3),
        "lag_p99_ms": round(1e3 * histogram_quantile(lag, 0.99), 3),
        "over_10ms": round(1 - lag.get(0.01, 0.0) / heard, 4) if heard else 0.0,
        "lag_messages": int(heard),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bodies = doc_bodies(args.doc_kb) if args.doc_kb else streamed(overhead_bodies("tiny"))
    sides: list[tuple[str, str | None]] = [("this", None)]
    if args.baseline_src:
        sides.insert(0, ("baseline", str(Path(args.baseline_src).resolve())))
    if args.no_sync_side:
        sides.append((NO_SYNC, None))
    with (
        tempfile.TemporaryDirectory() as tmp,
        Fleet() as fleet,
        contextlib.ExitStack() as stack,
    ):
        ports = [free_port() for _ in range(4)]
        cmd = [sys.executable, "-m", "prefixrouter.bench.instant", "--ports"]
        delays = ["--ttft-ms", str(args.ttft_ms), "--decode-ms", str(args.decode_ms)]
        engines = fleet.start_command(
            "instant engines", [*cmd, ",".join(map(str, ports)), *delays], ports[-1]
        )
        await fleet.wait_healthy([engines], 30)
        cfg = Path(tmp) / "gw.yaml"
        workers = [{"url": f"http://127.0.0.1:{p}", "id": f"e{i}"} for i, p in enumerate(ports)]
        cfg.write_bytes(orjson.dumps({"workers": workers, "server": {"admin_api_key": ADMIN_KEY}}))
        clusters: dict[str, list[Server]] = {}
        for side, src in sides:
            if side == NO_SYNC:  # the same gateways sharing nothing: no --cluster
                clusters[side] = [
                    fleet.start(f"{side}-r{i}", GATEWAY_MODULE, ["--config", str(cfg)])
                    for i in range(args.replicas)
                ]
                continue
            nats = stack.enter_context(NatsServer())
            env = {"PYTHONPATH": src} if src else None
            clusters[side] = start_replicas(
                fleet, cfg, nats.url, args.replicas, prefix=f"{side}-r", env=env
            )
        every = [s for c in clusters.values() for s in c]
        await wait_ready_async(every, 90)
        for s in every:
            await wait_routable(s.url)
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        timeout = aiohttp.ClientTimeout(total=30)
        out: dict[str, Any] = {
            "replicas": args.replicas,
            "seconds_per_rate": args.seconds,
            "rounds": args.rounds,
            "ttft_ms": args.ttft_ms,
            "decode_ms": args.decode_ms,
            "doc_kb": args.doc_kb,
            "rates": [],
        }
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            console.print("warm-up: 2 s at 8 req/s on each cluster")
            for cluster in clusters.values():
                await _round(cluster, bodies, 8.0, 2.0)
            for rate in args.rates:
                pairs: dict[str, list[list[tuple[dict[str, Any], dict[str, Any]]]]] = {
                    side: [[] for _ in clusters[side]] for side in clusters
                }
                errors = dict.fromkeys(clusters, 0)
                for i in range(args.rounds):
                    order = list(clusters) if i % 2 == 0 else list(reversed(clusters))
                    for side in order:
                        cluster = clusters[side]
                        console.print(
                            f"{rate:g} req/s, round {i + 1}/{args.rounds}: {side} "
                            f"({args.seconds / args.rounds:g} s)"
                        )
                        before = [await _state(session, s) for s in cluster]
                        errors[side] += await _round(
                            cluster, bodies, rate, args.seconds / args.rounds
                        )
                        await asyncio.sleep(SETTLE_S)
                        after = [await _state(session, s) for s in cluster]
                        for k, pair in enumerate(zip(before, after, strict=True)):
                            pairs[side][k].append(pair)
                row: dict[str, Any] = {"rate": rate}
                for side, per_replica in pairs.items():
                    # Sum each replica's rounds into one (before, after) pair.
                    merged = []
                    for rounds in per_replica:
                        b = {"requests": 0.0, "cpu_s": 0.0, "lag": {}}
                        a: dict[str, Any] = {"requests": 0.0, "cpu_s": 0.0, "lag": {}}
                        for rb, ra in rounds:
                            for key, value in ra.items():
                                if isinstance(value, int | float) and key != "pid":
                                    a[key] = a.get(key, 0.0) + value - rb.get(key, 0.0)
                            for le, c in ra["lag"].items():
                                a["lag"][le] = a["lag"].get(le, 0.0) + c - rb["lag"].get(le, 0.0)
                        merged.append((b, a))
                    row[side] = {**_summary(merged), "errors": errors[side]}
                if NO_SYNC in row:
                    # What sync adds to a replica's whole process (nats-py included),
                    # per request of the cluster: the per-own-request difference / N.
                    extra = row["this"]["process_ms_per_request"]
                    extra -= row[NO_SYNC]["process_ms_per_request"]
                    row["this"]["marginal_ms_per_request"] = round(extra / args.replicas, 4)
                out["rates"].append(row)
    return out


def _table(out: dict[str, Any]) -> Table:
    t = Table(title=f"sync per request per replica, {out['replicas']} replicas")
    for col in (
        "req/s",
        "code",
        "sync ms/req/replica",
        "publish · receive · apply",
        "msgs/req",
        "lag p50",
        "lag p99",
        ">10 ms",
        "process ms/req",
        "marginal ms/req/replica",
    ):
        t.add_column(col, justify="right")
    for row in out["rates"]:
        for side in ("baseline", "this", NO_SYNC):
            r = row.get(side)
            if r is None:
                continue
            ph = r["phase_ms_per_request"]
            phases = " · ".join(f"{ph[p]:.3f}" for p in ("publish", "receive", "apply"))
            lo, hi = r["sync_ms_per_request_range"]
            t.add_row(
                f"{row['rate']:g}",
                side,
                f"{r['sync_ms_per_request']:.3f} ({lo:.3f}-{hi:.3f})",
                phases if any(ph.values()) else "-",
                f"{r['messages_per_request']:.2f}",
                f"{r['lag_p50_ms']:.2f} ms",
                f"{r['lag_p99_ms']:.2f} ms",
                f"{100 * r['over_10ms']:.1f} %",
                f"{r['process_ms_per_request']:.2f}",
                f"{r['marginal_ms_per_request']:.3f}" if "marginal_ms_per_request" in r else "-",
            )
    return t


def _other_work(ms: float) -> None:
    """About ``ms`` of interpreter work that touches none of sync's code or data."""
    import time

    end = time.thread_time() + ms / 1e3
    x = 0
    while time.thread_time() < end:
        for i in range(1000):
            x += i


def hot_loop(n: int, per_message: int, doc_kb: int, gap_ms: float = 0.0) -> dict[str, Any]:
    """Publish-side and apply-side microseconds per request, in process (module doc)."""
    import time

    from prefixrouter.cluster import envelope
    from prefixrouter.cluster.codec import decode_facts, encode_facts
    from prefixrouter.core import Dispatcher, Outcome, Router, WorkerId
    from prefixrouter.core.hashing import BlockHasher
    from prefixrouter.core.types import CacheNamespace, RequestId, RoutingRequest, WorkerView

    raw = doc_bodies(doc_kb, n) if doc_kb else overhead_bodies("tiny")
    chats = [orjson.loads(b) for b in raw]
    texts = ["".join(m["content"] for m in c["messages"]) for c in chats]
    views = [WorkerView(WorkerId(f"w{i}"), kv_capacity_blocks=1 << 16) for i in range(3)]
    ns = CacheNamespace("tiny")

    def apply_message(d: Dispatcher, data: bytes) -> None:
        got, body = envelope.unpack(data)
        for fact in decode_facts(body):
            d.apply_peer(got.origin, fact, 1.0)

    best_pub = best_apply = float("inf")
    for _ in range(5):
        a = Dispatcher(Router("prefix_aware", BlockHasher()), "text", record_facts=True)
        b = Dispatcher(Router("prefix_aware", BlockHasher()), "text")
        batches = []
        for i in range(n):
            text = texts[i % len(texts)]
            req = RoutingRequest(
                RequestId(f"r{i}"),
                ns,
                text=text,
                prompt_tokens=len(text) // 4,
                max_tokens=16,
                model="tiny",
            )
            adm = a.admit(req, views, i * 1e-3)
            a.complete(adm, Outcome(len(text) // 5, 0.01), i * 1e-3)
            if (i + 1) % per_message == 0:
                batches.append(a.drain_facts())
        head = envelope.Envelope(envelope.FACTS, "a", 1, 2, 0.0)
        t0 = time.process_time()
        messages = [envelope.pack(head, body) for facts in batches for body in encode_facts(facts)]
        t1 = time.process_time()
        for data in messages:
            apply_message(b, data)
        t2 = time.process_time()
        best_pub = min(best_pub, (t1 - t0) / n)
        best_apply = min(best_apply, (t2 - t1) / n)
    out = {
        "requests": n,
        "requests_per_message": per_message,
        "doc_kb": doc_kb,
        "publish_side_us": round(best_pub * 1e6, 2),
        "apply_side_us": round(best_apply * 1e6, 2),
        "sync_us_per_request_per_replica_at_2": round((best_pub + best_apply) * 1e6, 2),
    }
    if gap_ms > 0:
        # The same messages applied by a fresh dispatcher, each after gap_ms of
        # other work (as a live replica applies a pass between other processes'
        # and its own HTTP work), and back to back, in one run: only the apply
        # calls are timed.
        timed: dict[float, float] = {}
        for gap in (0.0, gap_ms):
            c = Dispatcher(Router("prefix_aware", BlockHasher()), "text")
            spent = 0.0
            for data in messages:
                if gap:
                    _other_work(gap)
                t0 = time.thread_time()
                apply_message(c, data)
                spent += time.thread_time() - t0
            timed[gap] = spent / n
        out["gap_ms"] = gap_ms
        out["apply_side_us_back_to_back"] = round(timed[0.0] * 1e6, 2)
        out["apply_side_us_after_gap"] = round(timed[gap_ms] * 1e6, 2)
        out["after_gap_ratio"] = round(timed[gap_ms] / timed[0.0], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument(
        "--rates",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[8.0, 50.0, 200.0],
        help="requests/s across the cluster, comma-separated",
    )
    ap.add_argument("--seconds", type=float, default=12.0, help="load per rate and cluster")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ttft-ms", type=float, default=100.0, help="engines' first bytes")
    ap.add_argument("--decode-ms", type=float, default=300.0, help="engines' rest, after")
    ap.add_argument("--doc-kb", type=int, default=0, help="K KB documents (0: 8 KB bodies)")
    ap.add_argument("--baseline-src", default="", help="another checkout's src, side by side")
    ap.add_argument(
        "--no-sync-side",
        action="store_true",
        help="also N gateways sharing nothing, side by side (the marginal CPU of sync)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--hot-loop", type=int, default=0, metavar="N", help="in process, no network")
    ap.add_argument("--per-message", type=int, default=1, help="requests per message (hot loop)")
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="hot loop: also apply each message after this much other work, side by side",
    )
    args = ap.parse_args()
    if args.hot_loop:
        figures = hot_loop(args.hot_loop, args.per_message, args.doc_kb, args.gap_ms)
        print(orjson.dumps(figures).decode())
        return
    out = asyncio.run(run(args))
    console.print(_table(out))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(out).decode())


if __name__ == "__main__":
    main()
