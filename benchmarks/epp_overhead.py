"""What the endpoint picker adds behind Envoy, side by side with the standalone gateway.

Setup, all on loopback, every server a process of one
:class:`~prefixrouter.harness.processes.Fleet` (stopped by PID):

* **engines**: :mod:`prefixrouter.bench.instant`, one process on three ports,
  answering every completion at once with a fixed vLLM-shaped body;
* **gateway**: ``python -m prefixrouter.gateway`` over the three engines
  (text mode, ``prefix_aware``);
* **Envoy alone**: the shipped bootstrap (``deploy/envoy/envoy.yaml``) without
  its ext_proc filter, round robin over the engines: the data plane's own cost;
* **Envoy + EPP**: the shipped bootstrap as it is (``FULL_DUPLEX_STREAMED``;
  ``--body-mode BUFFERED`` for the other) asking ``python -m prefixrouter.epp``,
  which routes as the gateway does on the same configuration;
* **load**: this process, :mod:`prefixrouter.bench.loadgen` (raw HTTP/1.1
  keep-alive, uvloop): the same 8 KB chat bodies as ``gateway_overhead.py``.

Phases:

1. open loop at ``--rate`` requests/s for ``--seconds`` per path, in
   ``--rounds`` interleaved rounds (direct, gateway, Envoy alone, Envoy + EPP,
   the order alternating), latency counted from the scheduled send time;
   *added* latency is a path's percentile minus the direct one's. The EPP's
   own share is Envoy + EPP minus Envoy alone (the ext_proc gRPC round trip
   included). CPU per request is each process's CPU time over its rounds
   (warm-up included) divided by their requests, read from
   ``/proc/PID/task/*/schedstat`` (:func:`prefixrouter.bench.overhead.process_cpu_s`);
2. closed loop with ``--connections`` connections for ``--seconds``: requests
   per second through the gateway and through Envoy + EPP.

Usage::

    python benchmarks/epp_overhead.py [--rate 50] [--seconds 8] [--rounds 4]
                                      [--connections 16] [--body-mode BUFFERED]
                                      [--json-out benchmarks/results/epp_overhead.json]

``--in-process N`` measures no network at all: N requests' four ext_proc
messages (request headers, the body, response headers, the answer) handed
straight to :class:`prefixrouter.epp.exchange.Exchange` in this process,
best of five: the picker's own work per request (admission, routing,
feedback, the protobuf messages), without gRPC.

The machine's other load lands on every path alike (rounds interleave), but
figures from a shared machine are noisier than from an idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import uvloop
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prefixrouter.bench.loadgen import Latencies, build_requests, closed_loop, open_loop
from prefixrouter.bench.overhead import overhead_bodies, process_cpu_s
from prefixrouter.epp.envoy import render, start_envoy
from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet

PY = sys.executable
PATH = "/v1/chat/completions"
WARMUP = 50
console = Console(width=None if sys.stdout.isatty() else 130)
err = Console(stderr=True)


def start(fleet: Fleet, body_mode: str, workdir: Path) -> dict[str, Any]:
    """Every server, healthy; returns the paths' ports and the processes to meter."""
    ports = [free_port() for _ in range(3)]
    engines = fleet.start_command(
        "instant engines",
        [PY, "-m", "prefixrouter.bench.instant", "--ports", ",".join(map(str, ports))],
        ports[0],
    )
    workers = [a for p in ports for a in ("--worker", f"http://{HOST}:{p}")]
    gateway = fleet.start("gateway", "prefixrouter.gateway", workers)
    grpc_port, epp_http = free_port(), free_port()
    epp = fleet.start_command(
        "epp",
        [
            PY,
            "-m",
            "prefixrouter.epp",
            "--port",
            str(grpc_port),
            "--http-port",
            str(epp_http),
            *workers,
        ],
        epp_http,
    )
    pool = [(HOST, p) for p in ports]
    alone = start_envoy(
        fleet,
        render(free_port(), grpc_port, free_port(), pool, picker=False),
        name="envoy-alone",
        workdir=workdir,
    )
    with_epp = start_envoy(
        fleet,
        render(free_port(), grpc_port, free_port(), pool, body_mode=body_mode),
        name="envoy-epp",
        workdir=workdir,
    )
    wait_healthy([engines, gateway, epp], 60)
    wait_healthy([alone.server, with_epp.server], 60, path="/ready")
    return {
        "direct": (ports[0], []),
        "gateway": (gateway.port, [gateway]),
        "envoy alone": (alone.listen_port, [alone.server]),
        "envoy + epp": (with_epp.listen_port, [with_epp.server, epp]),
    }


def measure(paths: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    bodies = overhead_bodies("tiny")
    lat = {name: Latencies() for name in paths}
    cpu: dict[str, float] = {}
    sent = dict.fromkeys(paths, 0)
    seconds = args.seconds / args.rounds
    names = list(paths)
    with Progress(
        TextColumn("[bold]{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
    ) as progress:
        task = progress.add_task("open loop", total=args.rounds * len(names))
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                port, metered = paths[name]
                progress.update(task, description=f"open loop: {name}")
                before = {s.name: process_cpu_s(s.pid) for s in metered}
                got = uvloop.run(
                    open_loop(port, build_requests(port, PATH, bodies), args.rate, seconds, WARMUP)
                )
                for s in metered:
                    cpu[s.name] = cpu.get(s.name, 0.0) + process_cpu_s(s.pid) - before[s.name]
                lat[name].extend(got)
                sent[name] += len(got.values) + got.errors + WARMUP
                progress.advance(task)
        rps: dict[str, dict[str, float]] = {}
        sat = progress.add_task("closed loop", total=2)
        for name in ("gateway", "envoy + epp"):
            port, _ = paths[name]
            progress.update(sat, description=f"closed loop: {name}")
            rps[name] = uvloop.run(
                closed_loop(
                    port, build_requests(port, PATH, bodies), args.connections, args.seconds
                )
            )
            progress.advance(sat)
    summary = {name: lat[name].summary() for name in names}
    cpu_ms = {}
    for name in names:
        _, metered = paths[name]
        for s in metered:
            cpu_ms[s.name] = round(1e3 * cpu[s.name] / sent[name], 4)
    return {"latency": summary, "cpu_ms_per_request": cpu_ms, "saturation": rps}


def report(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    lat = raw["latency"]
    d50, d99 = lat["direct"]["p50_ms"], lat["direct"]["p99_ms"]

    def added(name: str) -> tuple[float, float]:
        return round(lat[name]["p50_ms"] - d50, 3), round(lat[name]["p99_ms"] - d99, 3)

    cpu = raw["cpu_ms_per_request"]
    gw50, gw99 = added("gateway")
    al50, al99 = added("envoy alone")
    ep50, ep99 = added("envoy + epp")
    rps = raw["saturation"]
    out = {
        "body_mode": args.body_mode,
        "rate_rps": args.rate,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "connections": args.connections,
        "gateway": {
            "added_p50_ms": gw50,
            "added_p99_ms": gw99,
            "cpu_ms_per_request": cpu["gateway"],
            "rps_max": round(rps["gateway"]["rps"], 1),
        },
        "envoy_alone": {
            "added_p50_ms": al50,
            "added_p99_ms": al99,
            "cpu_ms_per_request": cpu["envoy-alone"],
        },
        "envoy_epp": {
            "added_p50_ms": ep50,
            "added_p99_ms": ep99,
            "epp_added_p50_ms": round(ep50 - al50, 3),
            "epp_added_p99_ms": round(ep99 - al99, 3),
            "epp_cpu_ms_per_request": cpu["epp"],
            "envoy_cpu_ms_per_request": cpu["envoy-epp"],
            "rps_max": round(rps["envoy + epp"]["rps"], 1),
        },
        "detail": raw,
    }
    return out


def table(r: dict[str, Any]) -> Table:
    gw, al, ep = r["gateway"], r["envoy_alone"], r["envoy_epp"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}×" if b > 0 else "-"

    t = Table(
        title=f"EPP behind Envoy vs the standalone gateway · {r['body_mode']} · "
        f"{r['rate_rps']:g} req/s open loop, {r['connections']} connections closed loop",
        title_justify="left",
    )
    for col in ("figure", "gateway", "envoy alone", "envoy + epp", "epp's share", "epp / gateway"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    t.add_row(
        "added p50 (ms)",
        f"{gw['added_p50_ms']:.2f}",
        f"{al['added_p50_ms']:.2f}",
        f"{ep['added_p50_ms']:.2f}",
        f"{ep['epp_added_p50_ms']:.2f}",
        ratio(ep["epp_added_p50_ms"], gw["added_p50_ms"]),
    )
    t.add_row(
        "added p99 (ms)",
        f"{gw['added_p99_ms']:.2f}",
        f"{al['added_p99_ms']:.2f}",
        f"{ep['added_p99_ms']:.2f}",
        f"{ep['epp_added_p99_ms']:.2f}",
        ratio(ep["epp_added_p99_ms"], gw["added_p99_ms"]),
    )
    t.add_row(
        "CPU per request (ms)",
        f"{gw['cpu_ms_per_request']:.3f}",
        f"{al['cpu_ms_per_request']:.3f}",
        f"{ep['epp_cpu_ms_per_request'] + ep['envoy_cpu_ms_per_request']:.3f}",
        f"{ep['epp_cpu_ms_per_request']:.3f} (epp)",
        ratio(ep["epp_cpu_ms_per_request"], gw["cpu_ms_per_request"]),
    )
    t.add_row(
        "requests/s (closed loop)",
        f"{gw['rps_max']:.0f}",
        "-",
        f"{ep['rps_max']:.0f}",
        "-",
        ratio(ep["rps_max"], gw["rps_max"]),
    )
    return t


def exchange_us(n: int) -> float:
    """Microseconds per request of the picker's exchange, in process (``--in-process``)."""
    import time

    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from prefixrouter.bench.instant import RESPONSE_USAGE
    from prefixrouter.epp.exchange import Exchange
    from prefixrouter.gateway.config import config_from_dict
    from prefixrouter.gateway.flow import RequestFlow
    from prefixrouter.gateway.state import build_state

    cfg = config_from_dict({"workers": [{"url": f"http://{HOST}:{9000 + i}"} for i in range(3)]})
    st = build_state(cfg)
    for w in st.registry.workers.values():
        w.healthy = True  # no health checks run here
    flow = RequestFlow(st)

    def headers(values: dict[str, str]) -> Any:
        return pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            )
        )

    request = headers({":method": "POST", ":path": PATH, "content-type": "application/json"})
    response = headers({":status": "200", "content-type": "application/json"})
    answer = orjson.dumps({"choices": [{"message": {"content": "ok"}}], "usage": RESPONSE_USAGE})
    bodies = overhead_bodies("tiny")

    async def one(body: bytes) -> None:
        ex = Exchange(st, flow)
        await ex.on(pb.ProcessingRequest(request_headers=request))
        await ex.on(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        await ex.on(pb.ProcessingRequest(response_headers=response))
        await ex.on(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True))
        )
        ex.close()

    async def best() -> float:
        for i in range(3000):  # fill the index, the decision ring and the memos
            await one(bodies[i % len(bodies)])
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                await one(bodies[i % len(bodies)])
            times.append((time.perf_counter() - t0) / n)
        return min(times) * 1e6

    return asyncio.run(best())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=50.0, help="offered rate, requests/s")
    ap.add_argument("--seconds", type=float, default=8.0, help="duration of each phase")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    ap.add_argument("--connections", type=int, default=16, help="closed-loop connections")
    ap.add_argument(
        "--body-mode", default="FULL_DUPLEX_STREAMED", choices=("FULL_DUPLEX_STREAMED", "BUFFERED")
    )
    ap.add_argument("--json-out", type=Path, help="write the report here")
    ap.add_argument("--in-process", type=int, metavar="N", help="only the in-process exchange")
    args = ap.parse_args()
    if args.in_process:
        console.print(f"exchange in process: {exchange_us(args.in_process):.0f} us per request")
        return
    with Fleet() as fleet, tempfile.TemporaryDirectory(prefix="epp-overhead-") as tmp:
        err.print("starting engines, gateway, picker and two Envoys ...")
        paths = start(fleet, args.body_mode, Path(tmp))
        out = report(measure(paths, args), args)
    console.print(table(out))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")
        console.print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
