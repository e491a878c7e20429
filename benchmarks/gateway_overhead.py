"""What the gateway adds over a direct call: latency, throughput and CPU per request.

Setup, all on loopback:

* **upstream**: :mod:`prefixrouter.bench.instant` in one separate process
  listening on three ports, i.e. three "engines" that answer every completion
  at once with a fixed vLLM-shaped body (usage with
  ``prompt_tokens_details.cached_tokens``), plus ``/health``, ``/v1/models``
  and vLLM ``/metrics``;
* **gateway**: ``python -m prefixrouter.gateway`` in its own process, routing
  in text mode with the ``prefix_aware`` policy over the three engines, no
  decision-log file (the admin ring only);
* **load**: this process, :mod:`prefixrouter.bench.loadgen` (a minimal
  HTTP/1.1 keep-alive client on raw asyncio protocols, uvloop), so the
  generator costs little of the shared CPUs.
  Requests are 8 KB chat bodies: a shared 6 KB system prompt plus a 2 KB
  user message, one of 64 variants.

Phases:

1. direct (client -> engine) and via the gateway, each at a fixed offered rate
   (``--rate``, default 500 requests/s, open loop: latency counts from the
   scheduled send time) for ``--seconds`` in all, in ``--rounds`` interleaved
   rounds; ``added_p50_ms`` / ``added_p99_ms``
   are the differences of the latency percentiles; the gateway's CPU time
   over the via-gateway rounds divided by their requests (warm-up included)
   is ``cpu_ms_per_request``. CPU time is read from ``/proc/PID/task/*/schedstat``
   (nanoseconds; ``/proc/PID/stat`` counts 10 ms ticks) by
   :func:`prefixrouter.bench.overhead.process_cpu_s`;
2. closed loop with ``--connections`` concurrent connections through the
   gateway for ``--seconds``: completed requests per second is ``rps_max``.

``--baseline`` also measures a bare aiohttp + uvloop proxy (read the body,
POST it upstream, return the answer), reported under
``"baseline_bare_proxy"``: what the issue's reference proxy (aiohttp's
server and client) pays on this machine. The gateway's own upstream client is
cheaper than aiohttp's (``benchmarks/upstream_client.py``).
Both proxies run at once and their open-loop rounds alternate, so a burst of
other work on a shared machine lands on both sides of the comparison.

``--breakdown`` (implies ``--baseline``) adds a third proxy: the gateway with
the routing core stubbed out (``Router.route`` answers its first decision
again, ``on_routed`` / ``on_completed`` do nothing), and reports under
``"breakdown"`` the CPU per request of the bare proxy, of the gateway's own
work on top of it (stubbed gateway minus bare proxy: request building,
bookkeeping, metrics, decision log, pollers, the collector, net of the
gateway's upstream client, which costs less than the bare proxy's aiohttp
client, so this figure can be negative) and of the routing core (gateway minus
stubbed gateway).

``--hot-loop N`` measures no network at all: the gateway's request handler
runs in this process N times per repeat against a fake upstream session that
answers at once, and the best of five repeats gives the microseconds per
request of the handler (``handler_us``), of the same handler with the
routing core stubbed out as above (``gateway_own_us``) and their difference
(``routing_core_us``), and the routing core's calls timed one by one
(``routing_core_calls``: ``route``, of it the text hashing, ``on_routed``,
``on_completed``). It is free of the noise of a shared machine, but
hot: the caches hold everything, so in a live process the same work costs
about twice as much.

``--profile OUT`` runs the gateway under pyinstrument (``pip install
pyinstrument``; figures are then slower): ``OUT.txt`` gets the text call
tree, ``OUT.html`` / ``OUT.pyisession`` pyinstrument's other formats.

Usage::

    python benchmarks/gateway_overhead.py [--json] [--rate 500] [--seconds 4] [--rounds 4]
                                          [--baseline] [--breakdown] [--profile OUT.txt]
    python benchmarks/gateway_overhead.py --hot-loop 5000

Targets (issue 4): <= 1 ms added p50, <= 5 ms added p99, >= 2,500 rps,
<= 0.4 ms of gateway CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

import orjson

from prefixrouter.bench.loadgen import Latencies, build_requests, closed_loop, open_loop
from prefixrouter.bench.overhead import overhead_bodies, process_cpu_s
from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Server, stop_process

PY = sys.executable
PATH = "/v1/chat/completions"
WARMUP = 50  # sequential requests before each open-loop round (counted in CPU)
RESPONSE = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 2048,
            "completion_tokens": 1,
            "total_tokens": 2049,
            "prompt_tokens_details": {"cached_tokens": 1536},
        },
    }
)


def _bodies() -> list[bytes]:
    # The same 64 bodies as `prefixrouter bench`'s overhead comparison.
    return overhead_bodies("tiny")


# ----------------------------------------------------------------- servers (subprocesses)


def serve_bare_proxy(port: int, upstream: str) -> None:
    """The floor: a bare aiohttp + uvloop proxy without routing."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            async with session.post(
                upstream + request.path,
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r:
                data = await r.read()
                return web.Response(body=data, status=r.status, content_type="application/json")

        async def process(request: web.Request) -> web.Response:
            return web.Response(text="{}")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", forward)
        app.router.add_get("/health", process)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def _stub_routing_core() -> Any:
    """Make ``Router`` answer its first decision again and ignore feedback.

    Returns:
        A function that puts the real methods back.
    """
    from prefixrouter.core.router import Decision, Router

    real = (Router.route, Router.on_routed, Router.on_completed)
    first: list[Decision] = []

    def route_once(
        self: Router,
        request: Any,
        workers: Any,
        now: float,
        blocks: Any = None,
        steering: Any = None,
    ) -> Decision:
        if not first:
            first.append(real[0](self, request, workers, now, blocks, steering))
        return first[0]

    def on_routed(self: Router, decision: Decision, now: float) -> None:
        return None

    def on_completed(
        self: Router, decision: Decision, outcome: Any, now: float, block_tokens: Any = None
    ) -> bool:
        return False

    def undo() -> None:
        Router.route, Router.on_routed, Router.on_completed = real  # type: ignore[method-assign]

    Router.route = route_once  # type: ignore[method-assign]
    Router.on_routed = on_routed  # type: ignore[method-assign]
    Router.on_completed = on_completed  # type: ignore[method-assign]
    return undo


def serve_gateway_without_routing(argv: list[str]) -> None:
    """The gateway with the routing core stubbed out (``--breakdown``)."""
    from prefixrouter.gateway.cli import main

    _stub_routing_core()
    main(argv)


class _FakeUpstream:
    """Stands in for the upstream client and its response (``--hot-loop``)."""

    status = 200
    content_type = "application/json"

    async def post(
        self,
        endpoint: Any,
        path: str,
        body: bytes,
        first_byte_timeout_s: float | None = None,
        headers: bytes = b"",
    ) -> _FakeUpstream:
        return self

    async def read(self) -> bytes:
        return RESPONSE

    def release(self) -> None:
        return None


class _FakeRequest(dict[Any, Any]):
    """What the handler reads of an aiohttp request (``--hot-loop``): its headers,
    body, method and path, and a mapping for what the handler keeps on it (as
    ``web.Request`` is one)."""

    method = "POST"
    path = "/v1/chat/completions"

    def __init__(self, raw: bytes) -> None:
        from multidict import CIMultiDict, CIMultiDictProxy

        super().__init__()
        self.raw = raw
        self.content_length = len(raw)
        self.headers = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))

    async def read(self) -> bytes:
        return self.raw


def hot_loop(n: int) -> dict[str, Any]:
    """Microseconds per request of the gateway's handler, in process (see the docstring)."""
    import gc

    from prefixrouter.gateway.config import config_from_dict
    from prefixrouter.gateway.proxy import Proxy
    from prefixrouter.gateway.state import build_state

    def per_request_us() -> float:
        cfg = config_from_dict(
            {"workers": [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(3)]}
        )
        st = build_state(cfg)
        st.upstream = _FakeUpstream()  # type: ignore[assignment]
        proxy = Proxy(st)
        requests = [_FakeRequest(b) for b in _bodies()]

        def run(count: int, start: int) -> None:
            for i in range(start, start + count):
                coro = proxy.chat(requests[i % len(requests)])  # type: ignore[arg-type]
                try:
                    coro.send(None)
                except StopIteration as done:
                    assert done.value.status == 200, (done.value.status, done.value.body)
                else:
                    raise RuntimeError("the handler waited on something")

        run(3000, 0)  # fill the index, the decision ring and the memos
        gc.collect()
        best = float("inf")
        for r in range(5):
            t = time.perf_counter()
            run(n, 3000 + r * n)
            best = min(best, time.perf_counter() - t)
        return 1e6 * best / n

    def core_calls_us() -> dict[str, float]:
        """The routing core's calls one by one, on the same requests."""
        from prefixrouter.core.policy import Outcome

        cfg = config_from_dict(
            {"workers": [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(3)]}
        )
        st = build_state(cfg)
        built = [
            st.builder.build(
                orjson.loads(b), b, "chat", lambda salt: st.tenancy.resolve(None, None, salt), None
            )
            for b in _bodies()
        ]
        router, clock = st.dispatch.router, time.perf_counter
        best = {
            "route_us": 1e9,
            "text_hashing_us": 1e9,
            "on_routed_us": 1e9,
            "on_completed_us": 1e9,
        }
        for r in range(6):  # the first round fills the index and is not counted
            spent = dict.fromkeys(best, 0.0)
            for i in range(n):
                rr = built[i % len(built)].routing
                t0 = clock()
                d = router.route(rr, st.registry.views(), st.clock())
                t1 = clock()
                router.on_routed(d, st.clock())
                t2 = clock()
                router.on_completed(d, Outcome(1536, None, True), st.clock())
                t3 = clock()
                router.blocks_for(rr)
                t4 = clock()
                spent["route_us"] += t1 - t0
                spent["on_routed_us"] += t2 - t1
                spent["on_completed_us"] += t3 - t2
                spent["text_hashing_us"] += t4 - t3
            if r:
                best = {k: min(v, 1e6 * spent[k] / n) for k, v in best.items()}
        return {k: round(v, 2) for k, v in best.items()}

    full = per_request_us()
    undo = _stub_routing_core()
    try:
        own = per_request_us()
    finally:
        undo()
    return {
        "handler_us": round(full, 2),
        "gateway_own_us": round(own, 2),
        "routing_core_us": round(full - own, 2),
        "routing_core_calls": core_calls_us(),
    }


# ----------------------------------------------------------------- orchestration


def _wait(name: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    wait_healthy([Server(name, port, proc)], timeout)


def _measure_proxies(
    proxies: list[tuple[int, int]], direct_port: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Direct and via-proxy open-loop rounds, interleaved, then each closed loop.

    ``proxies`` are ``(port, pid)`` pairs. Interleaving ``--rounds`` short
    rounds (each proxy's in alternating order) spreads the noise of a shared
    machine over every side instead of letting a burst land on one of them.
    """
    import uvloop

    direct = Latencies()
    via = [Latencies() for _ in proxies]
    cpu = [0.0] * len(proxies)
    requests = [0] * len(proxies)
    seconds = args.seconds / args.rounds
    bodies = _bodies()
    for r in range(args.rounds):
        reqs = build_requests(direct_port, PATH, bodies)
        direct.extend(uvloop.run(open_loop(direct_port, reqs, args.rate, seconds, WARMUP)))
        order = list(range(len(proxies)))
        for i in order if r % 2 == 0 else order[::-1]:
            port, pid = proxies[i]
            cpu0 = process_cpu_s(pid)
            v = uvloop.run(
                open_loop(port, build_requests(port, PATH, bodies), args.rate, seconds, WARMUP)
            )
            cpu[i] += process_cpu_s(pid) - cpu0
            via[i].extend(v)
            requests[i] += len(v.values) + v.errors + WARMUP
    ds = direct.summary()
    out = []
    for i, (port, _) in enumerate(proxies):
        reqs = build_requests(port, PATH, bodies)
        sat = uvloop.run(closed_loop(port, reqs, args.connections, args.seconds))
        vs = via[i].summary()
        out.append(
            {
                "added_p50_ms": round(vs["p50_ms"] - ds["p50_ms"], 3),
                "added_p99_ms": round(vs["p99_ms"] - ds["p99_ms"], 3),
                "rps_max": round(sat["rps"], 1),
                "cpu_ms_per_request": round(1e3 * cpu[i] / requests[i], 4),
                "detail": {"direct": ds, "via": vs, "saturation": sat},
            }
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All phases; returns the report."""

    ports = [free_port() for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up = subprocess.Popen(
            [PY, "-m", "prefixrouter.bench.instant", "--ports", ",".join(map(str, ports))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(up)
        for p in ports:
            _wait("instant engines", p, up)
        gw_port = free_port()
        workers = [a for p in ports for a in ("--worker", f"http://127.0.0.1:{p}")]
        cmd = [PY, "-m", "prefixrouter.gateway", "--port", str(gw_port)]
        if args.profile:
            # pyinstrument samples the gateway in-process and writes the
            # profile when it exits; the format follows the extension.
            render = ["--renderer", "text", "--show-all"] if args.profile.endswith(".txt") else []
            cmd[1:2] = ["-m", "pyinstrument", *render, "-o", args.profile, "-m"]
        gw = subprocess.Popen(cmd + workers, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        _wait("gateway", gw_port, gw)
        proxies = [(gw_port, gw.pid)]
        if args.baseline or args.breakdown:
            bare_port = free_port()
            bare = subprocess.Popen(
                [PY, __file__, "--serve-bare", f"{bare_port},http://127.0.0.1:{ports[0]}"],
                stdout=subprocess.DEVNULL,
            )
            procs.append(bare)
            _wait("bare proxy", bare_port, bare)
            proxies.append((bare_port, bare.pid))
        if args.breakdown:
            stub_port = free_port()
            stub = subprocess.Popen(
                [PY, __file__, "--serve-stubbed", "--port", str(stub_port), *workers],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(stub)
            _wait("stubbed gateway", stub_port, stub)
            proxies.append((stub_port, stub.pid))

        results = _measure_proxies(proxies, ports[0], args)
        report = results[0]
        if len(results) > 1:
            report["baseline_bare_proxy"] = results[1]
        if args.breakdown:
            gw_cpu, bare_cpu, stub_cpu = (r["cpu_ms_per_request"] for r in results)
            report["breakdown"] = {
                "bare_proxy_ms": bare_cpu,
                "gateway_own_ms": round(stub_cpu - bare_cpu, 4),
                "routing_core_ms": round(gw_cpu - stub_cpu, 4),
            }
        return report
    finally:
        for proc in procs:
            stop_process(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--rate", type=float, default=500.0, help="offered rate, requests/s")
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of each phase")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved direct/via rounds")
    ap.add_argument("--connections", type=int, default=32, help="closed-loop connections")
    ap.add_argument("--baseline", action="store_true", help="also measure a bare proxy")
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also measure the gateway without its routing core (implies --baseline)",
    )
    ap.add_argument("--profile", help="write a pyinstrument profile of the gateway here")
    ap.add_argument(
        "--hot-loop", type=int, metavar="N", help="only the in-process handler timing (N/repeat)"
    )
    ap.add_argument("--serve-bare", help=argparse.SUPPRESS)
    if sys.argv[1:2] == ["--serve-stubbed"]:
        serve_gateway_without_routing(sys.argv[2:])
        return
    args = ap.parse_args()
    if args.serve_bare:
        port, upstream = args.serve_bare.split(",", 1)
        serve_bare_proxy(int(port), upstream)
        return
    if args.hot_loop:
        print(orjson.dumps(hot_loop(args.hot_loop)).decode())
        return
    report = run(args)
    if args.json:
        keys = ("added_p50_ms", "added_p99_ms", "rps_max", "cpu_ms_per_request")
        out = {k: report[k] for k in keys}
        if "baseline_bare_proxy" in report:
            b = report["baseline_bare_proxy"]
            out["baseline_bare_proxy"] = {k: b[k] for k in out}
        if "breakdown" in report:
            out["breakdown"] = report["breakdown"]
        print(orjson.dumps(out).decode())
    else:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
