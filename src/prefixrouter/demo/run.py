"""``prefixrouter demo``: the same live traffic through round robin, then through prefixrouter.

Steps:

1. start ``workers`` engine processes (``prefixrouter engine``: the engine
   model behind a vLLM-compatible API, real tokenizer) on free loopback ports,
   with a small KV cache so that not every replica can hold every prefix;
2. for each router (our gateway with ``round_robin``, then with
   ``prefix_aware``): reset the engines' prefix caches, start the gateway,
   replay the built-in workload (:mod:`prefixrouter.demo.workload`) at its
   offsets with a bounded streaming client, stop the gateway;
3. print TTFT p50/p99, cached-token share and prefill tokens side by side and
   write a PNG; with ``--serve``, keep a prefixrouter gateway running and
   print its URL, a curl example and its admin API key (generated for this
   run: the admin API is never open without one) until Ctrl-C.

Everything runs on 127.0.0.1 and stops by itself; every server is stopped by
PID when the demo ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from prefixrouter.demo.client import Result, replay
from prefixrouter.demo.fleet import Fleet, Server
from prefixrouter.demo.workload import DemoRequest, build_workload
from prefixrouter.gateway.cli import ADMIN_KEY_ENV

ROUTERS = ("round_robin", "prefix_aware")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Knobs of the demo (the CLI's options).

    Attributes:
        workers: Engine processes.
        requests: Requests per router.
        rate: Offered requests per second.
        profile: Engine profile (see ``prefixrouter profiles``).
        kv_blocks: KV blocks per engine (small, so caches must be shared wisely).
        time_scale: Engine time compression (1 = the profile's real speed).
        seed: Workload seed.
    """

    workers: int = 4
    requests: int = 240
    rate: float = 8.0
    profile: str = "llama3-8b-h100"
    kv_blocks: int = 700
    time_scale: float = 1.0
    seed: int = 0


@dataclass(slots=True)
class RouterRun:
    """One router's results."""

    router: str
    results: list[Result]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        ttft = sorted(r.ttft_s * 1e3 for r in ok if r.ttft_s >= 0)
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        return {
            "router": self.router,
            "requests": len(self.results),
            "ok": len(ok),
            "ttft_p50_ms": _rank(ttft, 0.50),
            "ttft_p99_ms": _rank(ttft, 0.99),
            "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else 0.0,
            "cached_share": cached / prompt if prompt else 0.0,
            "prefill_tokens": prompt - cached,
        }


def _rank(values: Sequence[float], q: float) -> float:
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else 0.0


async def _reset_caches(engines: Sequence[Server]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for e in engines:
            async with session.post(e.url + "/reset_prefix_cache") as resp:
                await resp.read()


def _engine_args(cfg: DemoConfig, index: int) -> list[str]:
    return [
        "--profile", cfg.profile, "--kv-blocks", str(cfg.kv_blocks),
        "--time-scale", str(cfg.time_scale), "--model", "tiny", "--engine-id", str(index),
    ]  # fmt: skip


def _gateway_args(engines: Sequence[Server], policy: str) -> list[str]:
    args = ["--policy", policy]
    for e in engines:
        args += ["--worker", e.url]
    return args


async def run_demo(
    cfg: DemoConfig,
    fleet: Fleet,
    *,
    on_router: Callable[[str, int], None] | None = None,
    on_done: Callable[[Result], None] | None = None,
) -> list[RouterRun]:
    """Start the engines, then replay the workload through each router in turn."""
    engines = [
        fleet.start(f"engine {i}", "prefixrouter.simulated_engine", _engine_args(cfg, i))
        for i in range(cfg.workers)
    ]
    await fleet.wait_healthy(engines)
    workload: list[DemoRequest] = build_workload(cfg.requests, rate=cfg.rate, seed=cfg.seed)
    runs: list[RouterRun] = []
    for policy in ROUTERS:
        await _reset_caches(engines)
        gateway = fleet.start(
            f"gateway ({policy})", "prefixrouter.gateway", _gateway_args(engines, policy)
        )
        await fleet.wait_healthy([gateway])
        if on_router is not None:
            on_router(policy, len(workload))
        results = await replay(gateway.url, workload, on_done=on_done)
        fleet.stop(gateway)
        runs.append(RouterRun(policy, results))
    return runs


async def serve_forever(
    fleet: Fleet, engines: Sequence[Server], admin_api_key: str | None = None
) -> Server:
    """Start a prefixrouter gateway in front of ``engines`` and return it (healthy).

    ``admin_api_key`` opens its ``/admin/*`` endpoints to that key (passed in
    the environment, not on the command line); without it they are off.
    """
    env = {ADMIN_KEY_ENV: admin_api_key} if admin_api_key else None
    gateway = fleet.start(
        "gateway", "prefixrouter.gateway", _gateway_args(engines, "prefix_aware"), env=env
    )
    await fleet.wait_healthy([gateway])
    return gateway


async def wait_for_interrupt() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def plot_runs(runs: Sequence[RouterRun], path: Path) -> None:
    """TTFT distributions and cached share of the routers, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_bar) = plt.subplots(1, 2, figsize=(11, 4.5))
    for run, color in zip(runs, ("tab:blue", "black"), strict=False):
        ttft = sorted(r.ttft_s * 1e3 for r in run.results if r.ok and r.ttft_s >= 0)
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax_cdf.step(ttft, ys, where="post", label=run.router, color=color, linewidth=2)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("time to first token (ms, log)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend()
    ax_cdf.set_title("TTFT, measured by the client")
    names = [r.router for r in runs]
    shares = [r.summary()["cached_share"] * 100 for r in runs]
    ax_bar.bar(names, shares, color=["tab:blue", "black"][: len(runs)])
    ax_bar.set_ylabel("prompt tokens served from cache (%)")
    ax_bar.set_title("Cached-token share (engine usage)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
