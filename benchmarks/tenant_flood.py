"""One tenant floods the gateway with 300 concurrent clients; does another tenant notice?

Starts two simulated engines (``python -m prefixrouter.simulated_engine``,
``--profile llama3-8b-h100`` in real time by default) and two gateways on
loopback in front of both: ``limited``, where tenant ``flood`` has
``max_in_flight`` (``--flood-limit``) and tenant ``victim`` a higher
``priority``, and ``unlimited``, the same without the limits. The victim
sends streamed chat requests open loop (``--victim-rate`` a second,
Poisson, seeded; each with a prompt of its own, so every one is a cold
prefill) through ``limited``, and its time to first token is measured here, at
the client, in three phases of ``--seconds`` each, one run, the same processes:

1. **alone**: nothing else runs (the unloaded value);
2. **flood, limited**: ``--flood`` clients (300) of tenant ``flood`` each send
   chat requests back to back through ``limited``; a refused one (429) waits
   its ``Retry-After`` (plus up to 0.5 s of jitter, as OpenAI's SDKs back
   off) and tries again;
3. **flood, unlimited**: the same flood through ``unlimited``: what the
   engines do to the victim when nobody holds the flood back;
4. **alone again**: unloaded once more, the noise floor (p99 of one unloaded
   sample over another's: on a shared machine it moves by itself).

The phases run in ``--rounds`` interleaved rounds (a burst of other work on
the machine lands on every phase alike), and the flood runs in a child
process, so its clients never share the victim's event loop.

Figures: the victim's p50/p99 TTFT per phase, at the client and as the
gateway measured it (its access log's ``ttft_ms``: send upstream to first
byte, without the client's and the gateway's own CPU waits), ``ratio_p99`` =
p99(flood, limited) / p99(alone) (the issue's bound: at most 1.2), the
flood's requests, answers and 429s, the most flood requests the gateway had
in flight (sampled from ``prefixrouter_tenant_in_flight`` every 0.2 s: the
limit holding) and the most requests the engines ran at once.

    PYTHONPATH=src python benchmarks/tenant_flood.py [--json OUT] [--plot OUT.png]

Every process is stopped by its PID at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from prefixrouter.harness.health import wait_routable
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.prometheus import samples
from prefixrouter.stats import nearest_rank

FLOOD_KEY, VICTIM_KEY = "bench-flood-key", "bench-victim-key"
WORDS = [
    "cache",
    "prefix",
    "token",
    "engine",
    "route",
    "worker",
    "batch",
    "stream",
    "tenant",
    "limit",
    "queue",
]


@dataclass
class Phase:
    """One phase's figures."""

    name: str
    ttft_s: list[float] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    gateway_ttft_s: list[float] = field(default_factory=list)
    victim_errors: int = 0
    flood_sent: int = 0
    flood_ok: int = 0
    flood_429: int = 0
    flood_other: int = 0
    max_flood_in_flight: float = 0.0
    max_engine_running: float = 0.0

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.ttft_s)
        at_gateway = sorted(self.gateway_ttft_s)
        return {
            "gateway_ttft_p50_ms": round(nearest_rank(at_gateway, 0.5) * 1e3, 2),
            "gateway_ttft_p99_ms": round(nearest_rank(at_gateway, 0.99) * 1e3, 2),
            "victim_requests": len(ordered),
            "victim_errors": self.victim_errors,
            "ttft_p50_ms": round(nearest_rank(ordered, 0.5) * 1e3, 2),
            "ttft_p99_ms": round(nearest_rank(ordered, 0.99) * 1e3, 2),
            "flood_sent": self.flood_sent,
            "flood_ok": self.flood_ok,
            "flood_429": self.flood_429,
            "flood_other": self.flood_other,
            "max_flood_in_flight_at_gateway": self.max_flood_in_flight,
            "max_engine_running": self.max_engine_running,
        }


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _gateway_ttft(log: Path, phases: list[Phase], timeout_s: float = 10.0) -> None:
    """Each phase's victim TTFTs as the gateway measured them (its access log's ``ttft_ms``)."""
    wanted = {rid for p in phases for rid in p.request_ids}
    end = time.monotonic() + timeout_s
    ttft: dict[str, float] = {}
    while len(ttft) < len(wanted) and time.monotonic() < end:
        for line in log.read_bytes().splitlines() if log.exists() else []:
            rec = orjson.loads(line)
            if rec["request_id"] in wanted and rec["ttft_ms"] is not None:
                ttft[rec["request_id"]] = rec["ttft_ms"] / 1e3
        time.sleep(0.2)
    for p in phases:
        p.gateway_ttft_s = [ttft[r] for r in p.request_ids if r in ttft]


def _gateway_config(engines: list[Server], limit: int | None, retry_after_s: int) -> dict[str, Any]:
    tenants: dict[str, Any] = {"victim": {"priority": 10}}
    if limit is not None:
        tenants["flood"] = {"max_in_flight": limit}
    return {
        "workers": [{"url": e.url, "id": e.name} for e in engines],
        "api_keys": {FLOOD_KEY: "flood", VICTIM_KEY: "victim"},
        "tenants": tenants,
        "overload": {"max_in_flight": "slots"},
        "proxy": {"retry_after_s": retry_after_s},  # Retry-After of an in-flight refusal
        "metrics_poll": {"interval_s": 0.5},
    }


async def _victim(
    session: aiohttp.ClientSession, url: str, phase: Phase, args: argparse.Namespace, seed: int
) -> None:
    """Open-loop streamed requests for ``args.seconds``; TTFT at the first body bytes."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}

    async def one(i: int) -> None:
        body = {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": f"{seed}-{i}: {_prompt(rng, args.victim_words)}"}
            ],
            "max_tokens": args.victim_tokens,
            "stream": True,
        }
        t0 = time.monotonic()
        try:
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    phase.victim_errors += 1
                    await r.read()
                    return
                await r.content.readany()
                phase.ttft_s.append(time.monotonic() - t0)
                phase.request_ids.append(r.headers["X-Request-Id"])
                await r.read()
        except aiohttp.ClientError:
            phase.victim_errors += 1

    tasks = []
    end = time.monotonic() + args.seconds
    i = 0
    while (now := time.monotonic()) < end:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(min(rng.expovariate(args.victim_rate), max(0.0, end - now)))
    await asyncio.gather(*tasks)


async def _flood(
    url: str, clients: int, seconds: float, args: argparse.Namespace
) -> dict[str, int]:
    """``clients`` clients sending back to back for ``seconds``; a 429 waits Retry-After."""
    headers = {"Authorization": f"Bearer {FLOOD_KEY}"}
    counts = {"sent": 0, "ok": 0, "429": 0, "other": 0}
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        rng = random.Random(10_000 + k)
        while not stop.is_set():
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": _prompt(rng, args.flood_words)}],
                "max_tokens": args.flood_tokens,
            }
            counts["sent"] += 1
            wait = 0.0
            try:
                async with session.post(
                    url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    await r.read()
                    if r.status == 200:
                        counts["ok"] += 1
                        continue
                    key = "429" if r.status == 429 else "other"
                    counts[key] += 1
                    wait = float(r.headers.get("Retry-After", "1")) if key == "429" else 0.5
            except aiohttp.ClientError:
                counts["other"] += 1
                wait = 0.5
            with contextlib.suppress(TimeoutError):  # back off as OpenAI's SDKs do
                await asyncio.wait_for(stop.wait(), wait + rng.uniform(0, 0.5))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(client(session, k)) for k in range(clients)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
    return counts


async def _flood_child(
    url: str, seconds: float, args: argparse.Namespace
) -> asyncio.subprocess.Process:
    """The flood in a process of its own: its clients do not share the victim's event loop."""
    cmd = [sys.executable, __file__, "--flood-client", url, "--seconds", str(seconds)]
    for name in ("flood", "flood_words", "flood_tokens"):
        cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)


async def _sample(
    session: aiohttp.ClientSession,
    gateway: str,
    engines: list[str],
    phase: Phase,
    stop: asyncio.Event,
) -> None:
    """Every 0.2 s: the flood's in-flight count at ``gateway``, the engines' running sum."""
    while not stop.is_set():
        async with session.get(gateway + "/metrics") as r:
            for s in samples(await r.text()):
                if s.name == "prefixrouter_tenant_in_flight" and s.labels.get("tenant") == "flood":
                    phase.max_flood_in_flight = max(phase.max_flood_in_flight, s.value)
        running = 0.0
        for url in engines:
            async with session.get(url + "/metrics") as r:
                for s in samples(await r.text()):
                    if s.name == "vllm:num_requests_running":
                        running += s.value
        phase.max_engine_running = max(phase.max_engine_running, running)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def _phase(
    name: str,
    victim_url: str,
    flood_url: str | None,
    engines: list[str],
    args: argparse.Namespace,
    progress: Progress,
    seed: int,
) -> Phase:
    phase = Phase(name)
    stop = asyncio.Event()
    task = progress.add_task(name, total=args.seconds)
    child = None
    if flood_url is not None:
        child = await _flood_child(flood_url, args.warmup_s + args.seconds + 0.5, args)
        await asyncio.sleep(args.warmup_s)  # the flood reaches its steady state first
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sampler = asyncio.create_task(
            _sample(session, flood_url or victim_url, engines, phase, stop)
        )

        async def tick() -> None:
            t0 = time.monotonic()
            while not stop.is_set():
                progress.update(task, completed=min(args.seconds, time.monotonic() - t0))
                await asyncio.sleep(0.25)

        ticker = asyncio.create_task(tick())
        await _victim(session, victim_url, phase, args, seed)
        stop.set()
        await asyncio.gather(sampler, ticker)
    if child is not None:
        out, _ = await asyncio.wait_for(child.communicate(), 60)
        counts = orjson.loads(out)
        phase.flood_sent, phase.flood_ok = counts["sent"], counts["ok"]
        phase.flood_429, phase.flood_other = counts["429"], counts["other"]
    progress.update(task, completed=args.seconds)
    return phase


def _merge(name: str, rounds: list[Phase]) -> Phase:
    """One phase kind's rounds as one sample (counts summed, maxima kept)."""
    out = Phase(name)
    for p in rounds:
        out.ttft_s += p.ttft_s
        out.request_ids += p.request_ids
        out.victim_errors += p.victim_errors
        out.flood_sent += p.flood_sent
        out.flood_ok += p.flood_ok
        out.flood_429 += p.flood_429
        out.flood_other += p.flood_other
        out.max_flood_in_flight = max(out.max_flood_in_flight, p.max_flood_in_flight)
        out.max_engine_running = max(out.max_engine_running, p.max_engine_running)
    return out


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    engine_args = [
        "--profile",
        args.profile,
        "--model",
        "tiny",
        "--time-scale",
        str(args.time_scale),
    ]
    with Fleet() as fleet:
        engines = [
            fleet.start(f"e{i}", "prefixrouter.simulated_engine", engine_args) for i in range(2)
        ]
        await fleet.wait_healthy(engines, timeout_s=60)
        gateways: dict[str, Server] = {}
        for name, limit in (("limited", args.flood_limit), ("unlimited", None)):
            cfg = args.workdir / f"gateway-{name}.yaml"
            data = _gateway_config(engines, limit, args.retry_after)
            if name == "limited":  # the victim's own TTFT as the gateway measures it
                data["access_log"] = {"path": str(args.workdir / "access.jsonl")}
            cfg.write_bytes(orjson.dumps(data))
            gateways[name] = fleet.start(
                f"gateway-{name}", "prefixrouter.gateway", ["--config", str(cfg)]
            )
        await fleet.wait_healthy(list(gateways.values()), timeout_s=60)
        for gw in gateways.values():
            await wait_routable(gw.url, timeout_s=30)
        limited, unlimited = gateways["limited"].url, gateways["unlimited"].url
        urls = [e.url for e in engines]
        steps: list[tuple[str, str | None]] = [
            ("alone", None),
            ("flood, limited", limited),
            ("flood, unlimited", unlimited),
            ("alone again", None),  # the noise floor: two unloaded samples apart
        ]
        with Progress(
            TextColumn("[bold]{task.description:<18}"),
            BarColumn(),
            TextColumn("{task.completed:>5.1f}/{task.total:.0f} s"),
            TimeRemainingColumn(),
            console=console,
        ) as progress:
            # Interleaved rounds: a burst of other work on a shared machine
            # lands on every phase alike, not on one of them.
            by_kind: dict[str, list[Phase]] = {name: [] for name, _ in steps}
            for r in range(args.rounds):
                for k, (name, flood_url) in enumerate(steps):
                    seed = len(steps) * r + k
                    got = await _phase(name, limited, flood_url, urls, args, progress, seed)
                    by_kind[name].append(got)
            phases = [_merge(name, rounds) for name, rounds in by_kind.items()]
        _gateway_ttft(args.workdir / "access.jsonl", phases)
    alone, limited_phase, unlimited_phase, again = (p.summary() for p in phases)
    base = alone["ttft_p99_ms"] or 1e-9
    gw_base = alone["gateway_ttft_p99_ms"] or 1e-9
    return {
        "benchmark": "tenant_flood",
        "settings": {
            "profile": args.profile,
            "time_scale": args.time_scale,
            "flood_clients": args.flood,
            "flood_max_in_flight": args.flood_limit,
            "retry_after_s": args.retry_after,
            "seconds_per_phase": args.seconds,
            "rounds": args.rounds,
            "victim_rate": args.victim_rate,
            "victim_prompt_words": args.victim_words,
            "victim_max_tokens": args.victim_tokens,
            "flood_prompt_words": args.flood_words,
            "flood_max_tokens": args.flood_tokens,
        },
        "phases": {
            "alone": alone,
            "flood_limited": limited_phase,
            "flood_unlimited": unlimited_phase,
            "alone_again": again,
        },
        "ratio_p99": round(limited_phase["ttft_p99_ms"] / base, 3),
        "ratio_p99_unlimited": round(unlimited_phase["ttft_p99_ms"] / base, 3),
        "ratio_p99_noise": round(again["ttft_p99_ms"] / base, 3),
        "ratio_p99_gateway": round(limited_phase["gateway_ttft_p99_ms"] / gw_base, 3),
        "ratio_p99_gateway_unlimited": round(unlimited_phase["gateway_ttft_p99_ms"] / gw_base, 3),
        "ratio_p99_gateway_noise": round(again["gateway_ttft_p99_ms"] / gw_base, 3),
        "ttft_s": {p.name: sorted(p.ttft_s) for p in phases},
    }


def _table(doc: dict[str, Any]) -> Table:
    clients = doc["settings"]["flood_clients"]
    t = Table(title=f"victim TTFT while tenant 'flood' runs {clients} clients", width=200)
    for col in (
        "phase",
        "victim reqs",
        "client p50 ms",
        "client p99 ms",
        "gateway p50 ms",
        "gateway p99 ms",
        "flood sent",
        "flood 200",
        "flood 429",
        "flood in flight (max)",
        "engines running (max)",
    ):
        t.add_column(col, justify="right")
    for name, p in doc["phases"].items():
        t.add_row(
            name,
            str(p["victim_requests"]),
            f"{p['ttft_p50_ms']:.1f}",
            f"{p['ttft_p99_ms']:.1f}",
            f"{p['gateway_ttft_p50_ms']:.1f}",
            f"{p['gateway_ttft_p99_ms']:.1f}",
            str(p["flood_sent"]),
            str(p["flood_ok"]),
            str(p["flood_429"]),
            f"{p['max_flood_in_flight_at_gateway']:.0f}",
            f"{p['max_engine_running']:.0f}",
        )
    return t


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in doc["ttft_s"].items():
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot([v * 1e3 for v in values], ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("victim TTFT (ms, client side)")
    ax.set_ylabel("share of requests")
    ax.set_title(
        f"{doc['settings']['flood_clients']} flood clients: p99 ratio "
        f"{doc['ratio_p99']:.2f} limited, {doc['ratio_p99_unlimited']:.2f} unlimited"
    )
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood", type=int, default=300, help="concurrent flood clients")
    ap.add_argument("--flood-limit", type=int, default=8, help="the flood tenant's max_in_flight")
    ap.add_argument("--seconds", type=float, default=10.0, help="victim traffic per phase")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="flood before the victim starts")
    ap.add_argument("--victim-rate", type=float, default=10.0, help="victim requests per second")
    ap.add_argument("--victim-words", type=int, default=600)
    ap.add_argument("--victim-tokens", type=int, default=8)
    ap.add_argument("--flood-words", type=int, default=600)
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--plot", type=Path, help="write the victim's TTFT CDF here (PNG)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the phases")
    ap.add_argument("--retry-after", type=int, default=1, help="the gateways' proxy.retry_after_s")
    ap.add_argument("--flood-client", metavar="URL", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args(argv)
    if args.flood_client:
        counts = asyncio.run(_flood(args.flood_client, args.flood, args.seconds, args))
        sys.stdout.buffer.write(orjson.dumps(counts))
        return 0
    console = Console()
    with tempfile.TemporaryDirectory(prefix="tenant-flood-") as tmp:
        args.workdir = Path(tmp)  # the gateways' configuration files
        doc = asyncio.run(run(args, console))
    console.print(_table(doc))
    console.print(
        f"victim p99 TTFT under the flood / alone, at the client: [bold]{doc['ratio_p99']:.3f}[/]"
        f" with limits, {doc['ratio_p99_unlimited']:.3f} without; at the gateway: "
        f"[bold]{doc['ratio_p99_gateway']:.3f}[/] with limits, "
        f"{doc['ratio_p99_gateway_unlimited']:.3f} without (noise floor, unloaded / unloaded: "
        f"{doc['ratio_p99_noise']:.3f} client, {doc['ratio_p99_gateway_noise']:.3f} gateway)"
    )
    if args.json:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if args.plot:
        _plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
