"""Downstream limits of a running gateway: timeouts, the connection cap, large bodies.

Starts, on loopback, one instant engine (:mod:`prefixrouter.bench.instant`)
and ``python -m prefixrouter.gateway`` in front of it (with its file-descriptor
limit, soft and hard, set to ``--gateway-fds`` so the flood phase stays cheap), then measures:

1. **timeouts** (all at once, each capped at ``--cap-s``): how long the
   gateway keeps a connection that sends its headers one byte per 1.5 s
   (slowloris), one that sends a 1,000-byte body one byte per second, one
   that sends nothing, and one idle after a keep-alive request;
2. **flood**: opens idle connections 50 at a time up to ``--flood`` and after
   each step asks ``GET /health`` on a fresh connection (2 s timeout); prints
   the count at which /health first stopped answering 200 and what it got
   instead, what /health says (the gateway's view of its engine, which its
   pollers must reach) on a connection opened before the flood, and whether
   /health answers again once the flood closes;
3. **large bodies**: ``--clients`` concurrent clients each POST a
   ``--body-mb`` MB ``/v1/completions`` body of token ids, back to back, for
   ``--seconds``, while a prober asks ``/health`` every 20 ms on a keep-alive
   connection; prints the prober's p50/p99/max (and the same without load).
   Twice: for a model no worker serves (the body is read, parsed and built,
   then answered 404: the request-building path alone) and for the served
   model (routed and forwarded: the routing core's work on a prompt of a
   million tokens included).

Before/after: run it once with each tree on ``PYTHONPATH`` (the gateway is a
subprocess of ``sys.executable`` and inherits the environment)::

    PYTHONPATH=OLD/src python benchmarks/downstream_limits.py
    PYTHONPATH=NEW/src python benchmarks/downstream_limits.py

``--skip timeouts`` (or flood, bodies) leaves a phase out. ``--against
OLD/src`` runs the bodies phase with this tree and the other, alternately,
``--rounds`` times each, and prints the median /health p99 of each and the
ratio: side by side in one run, so the machine's other load falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from prefixrouter.gateway.config import LimitsConfig
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import stop_process
from prefixrouter.stats import nearest_rank, percentile

HOST = "127.0.0.1"


def _limit_fds(n: int) -> Callable[[], None]:
    def apply() -> None:  # hard limit too: the gateway may not raise its soft one past it
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return apply


def _raise_own_fds() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def _request(
    port: int, method: str, path: str, body: bytes = b"", timeout: float = 2.0
) -> int | str:
    """One request on a fresh connection: the status, or why there was none."""
    try:
        async with asyncio.timeout(timeout):
            r, w = await asyncio.open_connection(HOST, port)
            try:
                head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                if body:
                    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                w.write(head.encode() + b"\r\n" + body)
                line = await r.readline()
                await r.read()
            finally:
                w.close()
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return type(exc).__name__
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 else "closed"


async def _survives(port: int, first: bytes, then: bytes, every_s: float, cap_s: float) -> float:
    """Seconds until the gateway closes a connection sending ``first``, then ``then`` bytewise."""
    r, w = await asyncio.open_connection(HOST, port)
    t0 = time.monotonic()
    w.write(first)

    async def trickle() -> None:
        for i in range(len(then)):
            await asyncio.sleep(every_s)
            w.write(then[i : i + 1])
            await w.drain()

    feeder = asyncio.create_task(trickle()) if then else None
    try:
        async with asyncio.timeout(cap_s):
            while True:
                try:
                    data = await r.read(65536)
                except OSError:
                    break
                if not data:
                    break
    except TimeoutError:
        pass
    finally:
        if feeder is not None:
            feeder.cancel()
        w.close()
    return time.monotonic() - t0


async def phase_timeouts(port: int, cap_s: float) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    slow_body_head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    keepalive = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    names = [
        "slowloris headers (1 B / 1.5 s)",
        "slow body (1 B/s)",
        "idle socket",
        "idle keep-alive",
    ]
    results = await asyncio.gather(
        _survives(port, head, b"X-Slow: " + b"a" * 1000, 1.5, cap_s),
        _survives(port, slow_body_head, b"1" * 1000, 1.0, cap_s),
        _survives(port, b"", b"", 0, cap_s),
        _survives(port, keepalive, b"", 0, cap_s),
    )
    for name, s in zip(names, results, strict=True):
        shown = f">= {cap_s:.0f} s (cap)" if s >= cap_s - 0.05 else f"{s:.1f} s"
        print(f"  {name:34s} connection closed after {shown}")


async def _health_on(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> str:
    """GET /health on a connection opened before the flood: the gateway's view of the engine."""
    try:
        async with asyncio.timeout(3):
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status = (await r.readline()).split()
            length = 0
            while (line := await r.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = orjson.loads(await r.readexactly(length))
    except (TimeoutError, OSError, IndexError, ValueError) as exc:
        return f"no answer ({type(exc).__name__})"
    return f"{status[1].decode()}, healthy_workers={body.get('healthy_workers')}"


async def phase_flood(port: int, flood: int) -> None:
    # The operator's connection, opened before the flood: it asks /health
    # (the gateway's view of its engine) while the flood holds every other slot.
    monitor = await asyncio.open_connection(HOST, port)
    held: list[asyncio.StreamWriter] = []
    failed_at: int | None = None
    failure: int | str | None = None
    try:
        while len(held) < flood:
            for _ in range(50):
                try:
                    _, w = await asyncio.wait_for(asyncio.open_connection(HOST, port), 2)
                except (TimeoutError, OSError):
                    break
                held.append(w)
            await asyncio.sleep(0.2)
            status = await _request(port, "GET", "/health")
            if status != 200 and failed_at is None:
                failed_at, failure = len(held), status
                break
        print(f"  held {len(held)} idle connections")
        if failed_at is None:
            print(f"  /health answered 200 up to {len(held)} connections")
        else:
            print(
                f"  /health on a new connection first failed at {failed_at} connections: {failure}"
            )
        await asyncio.sleep(3.0)  # several poll rounds under the flood
        print(f"  /health on the earlier connection, under the flood: {await _health_on(*monitor)}")
    finally:
        for w in held:
            w.close()
        monitor[1].close()
    t0 = time.monotonic()
    after: int | str = "never"
    while time.monotonic() - t0 < 20:
        after = await _request(port, "GET", "/health")
        if after == 200:
            break
        await asyncio.sleep(0.2)
    print(f"  after closing them: /health {after} within {time.monotonic() - t0:.1f} s")


async def _post_loop(port: int, body: bytes, stop: float, done: list[int]) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    while time.monotonic() < stop:
        try:
            r, w = await asyncio.open_connection(HOST, port)
            w.write(head)
            w.write(body)
            await w.drain()
            await r.readline()
            w.close()
            done[0] += 1
        except OSError:
            await asyncio.sleep(0.05)


async def _probe(port: int, stop: float) -> list[float]:
    r, w = await asyncio.open_connection(HOST, port)
    out: list[float] = []
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    while time.monotonic() < stop:
        t = time.perf_counter()
        w.write(req)
        length = 0
        while True:  # status line and headers
            line = await r.readline()
            if not line:
                raise ConnectionError("gateway closed the probe")
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            if line == b"\r\n":
                break
        await r.readexactly(length)
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.02)
    w.close()
    return out


def _pcts(xs: list[float]) -> str:
    xs = sorted(xs)

    p50, p99, top = nearest_rank(xs, 0.5) * 1e3, nearest_rank(xs, 0.99) * 1e3, xs[-1] * 1e3
    return f"p50 {p50:.1f} ms  p99 {p99:.1f} ms  max {top:.1f} ms (n={len(xs)})"


async def phase_bodies(port: int, clients: int, body_mb: float, seconds: float) -> dict[str, float]:
    """Prints the prober's figures; returns its p99 (ms) per load."""
    n = int(body_mb * 1e6 / 6.45)  # "123456," is about 6.45 bytes per id on average
    rng = random.Random(1)
    prompt = [rng.randrange(200_000) for _ in range(n)]
    idle = await _probe(port, time.monotonic() + 2.0)
    print(f"  /health without load: {_pcts(idle)}")
    p99s = {"idle": percentile(idle, 0.99) * 1e3}
    # "unserved": a model no worker serves, answered 404 once the body is
    # parsed and built (the request-building path alone); "tiny": routed and
    # forwarded too (the routing core's work on the prompt included).
    for model, what in (("unserved", "parse + build only (404)"), ("tiny", "full path")):
        body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": 1})
        stop = time.monotonic() + seconds
        done = [0]
        posts = [asyncio.create_task(_post_loop(port, body, stop, done)) for _ in range(clients)]
        lat = await _probe(port, stop)
        await asyncio.gather(*posts)
        print(
            f"  /health, {clients} x {len(body) / 1e6:.1f} MB bodies, {what}: {_pcts(lat)};"
            f" {done[0]} bodies answered"
        )
        p99s[what] = percentile(lat, 0.99) * 1e3
    return p99s


def side_by_side(against: str, rounds: int, argv: list[str]) -> None:
    """Run the bodies phase with this tree and ``against``, alternately, ``rounds`` times each.

    Alternating spreads whatever else the machine is doing over both trees;
    prints each round's /health p99 and, per load, the median p99 of each
    tree and their ratio.
    """
    here = str(Path(__file__).resolve().parent.parent / "src")
    runs: dict[str, list[dict[str, float]]] = {"this tree": [], "--against": []}
    for r in range(rounds):
        for name, src in (("this tree", here), ("--against", against)):
            cmd = [sys.executable, __file__, "--json-p99", "--skip", "timeouts", "--skip", "flood"]
            out = subprocess.run(
                [*cmd, *argv],
                env={**os.environ, "PYTHONPATH": src},
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            p99s = orjson.loads(out.strip().splitlines()[-1])
            runs[name].append(p99s)
            print(f"round {r + 1} {name:10} /health p99 ms: {p99s}")
    print(f"median /health p99 over {rounds} rounds (ms):")
    for load in runs["this tree"][0]:
        mine = sorted(x[load] for x in runs["this tree"])[rounds // 2]
        theirs = sorted(x[load] for x in runs["--against"])[rounds // 2]
        print(
            f"  {load:28} this tree {mine:8.1f}   --against {theirs:8.1f}   {theirs / mine:5.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--cap-s", type=float, default=100.0)
    ap.add_argument("--gateway-fds", type=int, default=1024)
    ap.add_argument("--flood", type=int, default=0, help="default: gateway fds + 200")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--body-mb", type=float, default=7.8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--skip", action="append", default=[])
    ap.add_argument(
        "--against", metavar="SRC", help="another checkout's src: bodies phase side by side"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds per tree with --against")
    ap.add_argument("--json-p99", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="", help="extra gateway YAML (JSON) merged on top")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="the engine's KV size in blocks, as configured (default: its metrics, 100,000)",
    )
    args = ap.parse_args()
    extra = orjson.loads(Path(args.config).read_bytes()) if args.config else {}
    reserve = extra.get("limits", {}).get("fd_reserve", LimitsConfig().fd_reserve)
    if (args.gateway_fds - reserve) // 2 < args.clients + 1:
        # The gateway keeps fd_reserve descriptors and two per connection:
        # fewer would cap it below the clients this run sends.
        ap.error(
            f"--gateway-fds {args.gateway_fds}: the gateway keeps {reserve} (limits.fd_reserve) "
            f"and two per connection, so it needs at least {reserve + 2 * (args.clients + 1)} "
            f"for {args.clients} clients and a probe"
        )
    if args.against:
        passed = [f"--clients={args.clients}", f"--body-mb={args.body_mb}"]
        passed += [f"--seconds={args.seconds}", f"--kv-blocks={args.kv_blocks}"]
        side_by_side(
            args.against, args.rounds, passed + ([f"--config={args.config}"] if args.config else [])
        )
        return
    _raise_own_fds()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    eport = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "prefixrouter.bench.instant", "--ports", str(eport)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    gw = None
    try:
        assert engine.stderr is not None
        engine.stderr.readline()
        cfg: dict[str, object] = {
            "workers": [
                {
                    "url": f"http://{HOST}:{eport}",
                    "id": "e0",
                    **({"kv_capacity_blocks": args.kv_blocks} if args.kv_blocks else {}),
                }
            ],
            "metrics_poll": {"interval_s": 0.5},
            "health": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
        }
        cfg.update(extra)
        with tempfile.NamedTemporaryFile("wb", suffix=".yaml", delete=False) as f:
            f.write(orjson.dumps(cfg))
        gw = subprocess.Popen(
            [sys.executable, "-m", "prefixrouter.gateway", "--config", f.name, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            preexec_fn=_limit_fds(args.gateway_fds),
        )
        assert gw.stdout is not None
        line = gw.stdout.readline().decode()
        match = re.search(r"listening on http://[^:]+:(\d+)", line)
        assert match, line
        port = int(match.group(1))
        time.sleep(1.0)
        where = env.get("PYTHONPATH")
        print(f"gateway pid {gw.pid}, fd limit {args.gateway_fds}, PYTHONPATH={where}")
        if "timeouts" not in args.skip:
            print("timeouts:")
            asyncio.run(phase_timeouts(port, args.cap_s))
        if "flood" not in args.skip:
            print("flood:")
            asyncio.run(phase_flood(port, args.flood or args.gateway_fds + 200))
        if "bodies" not in args.skip:
            print("large bodies:")
            p99s = asyncio.run(phase_bodies(port, args.clients, args.body_mb, args.seconds))
            if args.json_p99:
                print(orjson.dumps(p99s).decode())
    finally:
        for p in (gw, engine):
            if p is not None:
                stop_process(p, 10.0)


if __name__ == "__main__":
    main()
