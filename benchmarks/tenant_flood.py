"""One tenant floods the gateway with 300 concurrent clients; does another tenant notice?

Starts three simulated engines (``python -m prefixrouter.simulated_engine``,
``--profile llama3-8b-h100`` in real time by default) and two gateways on
loopback: ``limited``, where tenant ``flood`` has ``max_in_flight``
(``--flood-limit``) and tenant ``victim`` a higher ``priority``, and
``unlimited``, the same without the limits. ``e0`` and ``e1`` serve the victim
and the flood; ``e2`` serves only tenant ``refused`` (``max_in_flight: 1``), so
that a flood of that tenant costs the victim's engines nothing and measures
the gateway's refusals alone. The victim sends streamed chat requests open
loop (``--victim-rate`` a second, Poisson, seeded; each with a prompt of its
own, so every one is a cold prefill) through ``limited``; its time to first
token is measured at the client and as the gateway logged it (access log
``ttft_ms``: upstream send to first byte).

One round is five windows of ``--seconds`` each, in this order (ABA'..):

1. **alone**: nothing else runs (the unloaded value, A);
2. **flood, limited**: ``--flood`` clients (300) of tenant ``flood`` each send
   chat requests back to back through ``limited``; a refused one (429) waits
   its ``Retry-After`` (plus up to 0.5 s of jitter, as OpenAI's SDKs back off)
   and tries again (B);
3. **alone again**: unloaded once more (A'): ``A'/A`` is the noise floor,
   measured exactly as ``B/A`` is (same sample sizes, interleaved);
4. **refusals only**: 300 clients of tenant ``refused``: the same 429 stream
   through the victim's gateway, no flood request on the victim's engines
   (what refusing costs);
5. **admitted only**: ``--flood-limit`` clients of tenant ``flood``: as many
   flood requests on the engines as the limit admits, and no refusal (what
   the admitted flood costs).

``--rounds`` rounds run back to back (a burst of other work on the machine
lands on every window kind alike); ``--unlimited-rounds`` windows of the
flood through ``unlimited`` come last (their engine backlog would spill into
the next window). The flood runs in a child process at lower CPU priority
(``os.nice(--nice)``): the attacker would be on another machine, and on a
2-core box its own CPU would otherwise be measured as the gateway's.

Figures per window kind: the victim's p50/p99 TTFT (client and gateway), the
p99 ratio to ``alone`` pooled over every round and its spread over rounds
(min / median / max of the per-round ratios), the flood's requests, answers
and 429s, the most flood requests the gateway had in flight (sampled from
``prefixrouter_tenant_in_flight`` every 0.2 s: the limit holding), the most
requests the engines ran at once, and the CPU seconds per window of the
victim's gateway and of the victim's engines (``/proc``).

    PYTHONPATH=src python benchmarks/tenant_flood.py [--json OUT] [--plot OUT.png]

Every process is stopped by its PID at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
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

FLOOD_KEY, VICTIM_KEY, REFUSED_KEY = "bench-flood-key", "bench-victim-key", "bench-refused-key"
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
    gateway_cpu_s: float = 0.0
    engines_cpu_s: float = 0.0
    windows: int = 0

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
            "gateway_cpu_s_per_window": round(self.gateway_cpu_s / max(1, self.windows), 2),
            "engines_cpu_s_per_window": round(self.engines_cpu_s / max(1, self.windows), 2),
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


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gateway_config(engines: list[Server], limit: int | None, retry_after_s: int) -> dict[str, Any]:
    tenants: dict[str, Any] = {"victim": {"priority": 10}, "refused": {"max_in_flight": 1}}
    if limit is not None:
        tenants["flood"] = {"max_in_flight": limit}
    # The last engine serves only tenant "refused": its one admitted request
    # never shares an engine with the victim.
    shared, own = engines[:-1], engines[-1]
    return {
        "workers": [
            {"url": e.url, "id": e.name, "tenants": ["victim", "flood", ""]} for e in shared
        ]
        + [{"url": own.url, "id": own.name, "tenants": ["refused"]}],
        "api_keys": {FLOOD_KEY: "flood", VICTIM_KEY: "victim", REFUSED_KEY: "refused"},
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
    headers = {"Authorization": f"Bearer {args.flood_key}"}
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


@dataclass(frozen=True)
class Flood:
    """What a window's flood is: where it goes, how many clients, whose key."""

    url: str
    clients: int
    key: str = FLOOD_KEY


async def _flood_child(
    flood: Flood, seconds: float, args: argparse.Namespace
) -> asyncio.subprocess.Process:
    """The flood in a process of its own, niced: its clients do not share the victim's
    event loop, and the CPU it would use on another machine is what the box spares."""
    cmd = [sys.executable, __file__, "--flood-client", flood.url, "--seconds", str(seconds)]
    cmd += ["--flood", str(flood.clients), "--flood-key", flood.key, "--nice", str(args.nice)]
    for name in ("flood_words", "flood_tokens"):
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
    flood: Flood | None,
    engines: list[str],
    pids: tuple[int, list[int]],
    args: argparse.Namespace,
    progress: Progress,
    seed: int,
) -> Phase:
    phase = Phase(name, windows=1)
    stop = asyncio.Event()
    task = progress.add_task(name, total=args.seconds)
    child = None
    flood_url = flood.url if flood is not None else None
    if flood is not None:
        child = await _flood_child(flood, args.warmup_s + args.seconds + 0.5, args)
        await asyncio.sleep(args.warmup_s)  # the flood reaches its steady state first
    gateway_pid, engine_pids = pids
    cpu0 = _cpu_s(gateway_pid), sum(_cpu_s(p) for p in engine_pids)
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
    phase.gateway_cpu_s = _cpu_s(gateway_pid) - cpu0[0]
    phase.engines_cpu_s = sum(_cpu_s(p) for p in engine_pids) - cpu0[1]
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
        out.gateway_ttft_s += p.gateway_ttft_s
        out.victim_errors += p.victim_errors
        out.flood_sent += p.flood_sent
        out.flood_ok += p.flood_ok
        out.flood_429 += p.flood_429
        out.flood_other += p.flood_other
        out.max_flood_in_flight = max(out.max_flood_in_flight, p.max_flood_in_flight)
        out.max_engine_running = max(out.max_engine_running, p.max_engine_running)
        out.gateway_cpu_s += p.gateway_cpu_s
        out.engines_cpu_s += p.engines_cpu_s
        out.windows += p.windows
    return out


def _key(name: str) -> str:
    """A window kind's JSON key: ``flood, limited`` -> ``flood_limited``."""
    return name.replace(", ", "_").replace(" ", "_")


def _p99(values: list[float]) -> float:
    return nearest_rank(sorted(values), 0.99) if values else float("nan")


def _ratios(rounds: dict[str, list[Phase]], base: str, gateway: bool) -> dict[str, Any]:
    """Each window kind's p99 over ``base``'s: pooled, and per round (min / median / max)."""

    def pick(p: Phase) -> list[float]:
        return p.gateway_ttft_s if gateway else p.ttft_s

    pooled_base = _p99([v for p in rounds[base] for v in pick(p)])
    out: dict[str, Any] = {}
    for name, phases in rounds.items():
        pooled = _p99([v for p in phases for v in pick(p)]) / pooled_base
        per = [_p99(pick(p)) / _p99(pick(b)) for p, b in zip(phases, rounds[base], strict=False)]
        out[name] = {
            "pooled": round(pooled, 3),
            "per_round": [round(r, 3) for r in per],
            "min": round(min(per), 3),
            "median": round(statistics.median(per), 3),
            "max": round(max(per), 3),
        }
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
            fleet.start(f"e{i}", "prefixrouter.simulated_engine", engine_args) for i in range(3)
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
        urls = [e.url for e in engines[:-1]]  # the victim's engines
        pids = (gateways["limited"].pid, [e.pid for e in engines[:-1]])
        steps: list[tuple[str, Flood | None]] = [
            ("alone", None),
            ("flood, limited", Flood(limited, args.flood)),
            ("alone again", None),  # the noise floor: measured as the flood's ratio is
            ("refusals only", Flood(limited, args.flood, REFUSED_KEY)),
            ("admitted only", Flood(limited, args.flood_limit)),
        ]
        plan = [step for _ in range(args.rounds) for step in steps]
        plan += [("flood, unlimited", Flood(unlimited, args.flood))] * args.unlimited_rounds
        with Progress(
            TextColumn("[bold]{task.description:<18}"),
            BarColumn(),
            TextColumn("{task.completed:>5.1f}/{task.total:.0f} s"),
            TimeRemainingColumn(),
            console=console,
        ) as progress:
            by_kind: dict[str, list[Phase]] = {}
            for k, (name, flood) in enumerate(plan):
                got = await _phase(name, limited, flood, urls, pids, args, progress, seed=k)
                by_kind.setdefault(name, []).append(got)
        _gateway_ttft(args.workdir / "access.jsonl", [p for ps in by_kind.values() for p in ps])
    phases = {name: _merge(name, rounds) for name, rounds in by_kind.items()}
    summaries = {
        name.replace(", ", "_").replace(" ", "_"): p.summary() for name, p in phases.items()
    }
    ratios = _ratios({k: v for k, v in by_kind.items() if k != "flood, unlimited"}, "alone", False)
    gw_ratios = _ratios(
        {k: v for k, v in by_kind.items() if k != "flood, unlimited"}, "alone", True
    )
    alone = phases["alone"]
    if "flood, unlimited" in phases:
        ratios["flood, unlimited"] = {
            "pooled": round(_p99(phases["flood, unlimited"].ttft_s) / _p99(alone.ttft_s), 3)
        }
        gw_ratios["flood, unlimited"] = {
            "pooled": round(
                _p99(phases["flood, unlimited"].gateway_ttft_s) / _p99(alone.gateway_ttft_s), 3
            )
        }
    return {
        "benchmark": "tenant_flood",
        "settings": {
            "profile": args.profile,
            "time_scale": args.time_scale,
            "flood_clients": args.flood,
            "flood_max_in_flight": args.flood_limit,
            "retry_after_s": args.retry_after,
            "seconds_per_window": args.seconds,
            "rounds": args.rounds,
            "flood_nice": args.nice,
            "victim_rate": args.victim_rate,
            "victim_prompt_words": args.victim_words,
            "victim_max_tokens": args.victim_tokens,
            "flood_prompt_words": args.flood_words,
            "flood_max_tokens": args.flood_tokens,
        },
        "phases": summaries,
        "ratio_p99": ratios,
        "ratio_p99_gateway": gw_ratios,
        "ttft_s": {p.name: sorted(p.ttft_s) for p in phases.values()},
    }


def _table(doc: dict[str, Any]) -> Table:
    clients = doc["settings"]["flood_clients"]
    t = Table(title=f"victim TTFT while tenant 'flood' runs {clients} clients", width=220)
    for col in (
        "window",
        "victim reqs",
        "client p50 / p99 ms",
        "p99 ratio pooled",
        "per round min / med / max",
        "gateway p50 / p99 ms",
        "gw p99 ratio",
        "flood sent / 200 / 429",
        "flood in flight (max)",
        "engines running (max)",
        "gw / engines CPU s",
    ):
        t.add_column(col, justify="right")
    for p, (name, r), g in zip(
        doc["phases"].values(),
        doc["ratio_p99"].items(),
        doc["ratio_p99_gateway"].values(),
        strict=True,
    ):
        spread = f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}" if "min" in r else "-"
        t.add_row(
            name,
            str(p["victim_requests"]),
            f"{p['ttft_p50_ms']:.1f} / {p['ttft_p99_ms']:.1f}",
            f"{r['pooled']:.2f}",
            spread,
            f"{p['gateway_ttft_p50_ms']:.1f} / {p['gateway_ttft_p99_ms']:.1f}",
            f"{g['pooled']:.2f}",
            f"{p['flood_sent']} / {p['flood_ok']} / {p['flood_429']}",
            f"{p['max_flood_in_flight_at_gateway']:.0f}",
            f"{p['max_engine_running']:.0f}",
            f"{p['gateway_cpu_s_per_window']:.1f} / {p['engines_cpu_s_per_window']:.1f}",
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
    r = doc["ratio_p99"]
    ax.set_title(
        f"{doc['settings']['flood_clients']} flood clients: p99 ratio "
        f"{r['flood, limited']['pooled']:.2f} limited, noise {r['alone again']['pooled']:.2f}"
    )
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood", type=int, default=300, help="concurrent flood clients")
    ap.add_argument("--flood-limit", type=int, default=8, help="the flood tenant's max_in_flight")
    ap.add_argument("--seconds", type=float, default=10.0, help="victim traffic per window")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="flood before the victim starts")
    ap.add_argument("--victim-rate", type=float, default=10.0, help="victim requests per second")
    ap.add_argument("--victim-words", type=int, default=600)
    ap.add_argument("--victim-tokens", type=int, default=8)
    ap.add_argument("--flood-words", type=int, default=600)
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--plot", type=Path, help="write the victim's TTFT CDF here (PNG)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the five windows")
    ap.add_argument("--unlimited-rounds", type=int, default=1, help="unlimited flood windows")
    ap.add_argument("--nice", type=int, default=10, help="the flood child's os.nice increment")
    ap.add_argument("--retry-after", type=int, default=1, help="the gateways' proxy.retry_after_s")
    ap.add_argument("--flood-client", metavar="URL", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--flood-key", default=FLOOD_KEY, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.flood_client:
        os.nice(args.nice)  # the attacker's CPU is not the gateway's to measure
        counts = asyncio.run(_flood(args.flood_client, args.flood, args.seconds, args))
        sys.stdout.buffer.write(orjson.dumps(counts))
        return 0
    console = Console(width=230)
    with tempfile.TemporaryDirectory(prefix="tenant-flood-") as tmp:
        args.workdir = Path(tmp)  # the gateways' configuration files
        doc = asyncio.run(run(args, console))
    console.print(_table(doc))
    r, g = doc["ratio_p99"], doc["ratio_p99_gateway"]
    fl, noise = r["flood, limited"], r["alone again"]
    console.print(
        f"victim p99 TTFT, flood (limited) / alone, at the client: [bold]{fl['pooled']:.3f}[/]"
        f" (rounds {fl['min']:.2f}-{fl['max']:.2f}, median {fl['median']:.2f}); noise floor "
        f"(alone again / alone): [bold]{noise['pooled']:.3f}[/] (rounds {noise['min']:.2f}-"
        f"{noise['max']:.2f}, median {noise['median']:.2f}); at the gateway: "
        f"{g['flood, limited']['pooled']:.3f} against noise {g['alone again']['pooled']:.3f}"
    )
    if args.json:
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if args.plot:
        _plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
