"""``prefixrouter demo``: the bench's live comparison, preset to two routers and the demo workload.

The demo is :func:`prefixrouter.bench.live.run_scenario` with:

* **routers**: our gateway with ``round_robin``, then with ``prefix_aware``
  (:data:`ROUTERS`);
* **workload**: the built-in doc-QA and system-prompt traffic
  (:mod:`prefixrouter.demo.workload`), as a
  :class:`~prefixrouter.bench.workload.BenchWorkload`;
* **engines**: ``workers`` simulated engines at the profile's real speed, with a
  small KV cache (``kv_blocks``) so that not every replica can hold every
  prefix; started first (:func:`~prefixrouter.bench.live.start_engines`) so that
  ``--serve`` can keep them;
* **client**: open loop, each request timed from its scheduled send; at most
  :data:`CONCURRENCY` (512, the bench's) in flight, 120 s per request.

Everything else is the bench's: each router is started, sent one probe
request, measured after the engines' caches are emptied, and stopped; the
figures are :meth:`RouterRun.summary <prefixrouter.bench.live.RouterRun.summary>`'s
and the PNG is :func:`prefixrouter.bench.report.plot`'s. Before any engine
starts, every request is checked against the engines' KV cache
(:func:`~prefixrouter.bench.workload.check_requests_fit`): a demo whose
requests every engine would refuse is refused with one line. A router whose
run failed is kept in the result with its error, so the table still shows
what the others measured. With ``--serve``, a
prefixrouter gateway then stays in front of the engines, with an admin API
key generated for the run (:func:`serve_forever`), until Ctrl-C.

Everything runs on 127.0.0.1; every server is stopped by PID when the demo
ends, whatever happened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixrouter.bench.live import LiveConfig, ScenarioRun, run_scenario, start_engines
from prefixrouter.bench.routers import ROUTERS as BENCH_ROUTERS
from prefixrouter.bench.routers import default_peers_dir, router_command
from prefixrouter.bench.workload import BenchWorkload, check_requests_fit
from prefixrouter.demo.workload import build_workload
from prefixrouter.gateway.cli import ADMIN_KEY_ENV
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet, Server
from prefixrouter.harness.replay import ReplayResult
from prefixrouter.sim.profiles import get_profile
from prefixrouter.tokenization import load_tokenizer

ROUTERS = ("round_robin", "prefix_aware")
"""The bench routers the demo compares, in order."""

CONCURRENCY = 512
"""Most requests the demo's client keeps in flight: the bench's. A request
beyond it waits in the client, where no router sees it; 64 made round
robin's requests wait there (at ``--rate 24``, 94 of 240 waited, up to 9.3 s)
instead of in the engines' queues, which are the routers' doing. At 512 none
waits at that rate; the report says so if one ever does."""
TIMEOUT_S = 120.0


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


def demo_workload(cfg: DemoConfig) -> BenchWorkload:
    """The demo's traffic as a bench workload (its load is not computed: 0)."""
    return BenchWorkload(
        scenario="demo",
        description="questions about policy documents and chats under one system prompt",
        shared_prefix=True,
        requests=build_workload(cfg.requests, rate=cfg.rate, seed=cfg.seed),
        rate=cfg.rate,
        load=0.0,
        time_scale=cfg.time_scale,
        kv_blocks=cfg.kv_blocks,
    )


def live_config(cfg: DemoConfig) -> LiveConfig:
    """The bench's fleet and client settings for the demo (no peers, no warm-up)."""
    return LiveConfig(
        workers=cfg.workers,
        profile=cfg.profile,
        peers_dir=default_peers_dir(),
        concurrency=CONCURRENCY,
        timeout_s=TIMEOUT_S,
    )


async def run_demo(
    cfg: DemoConfig,
    fleet: Fleet,
    *,
    on_router: Callable[[str, int], None] | None = None,
    on_done: Callable[[ReplayResult], None] | None = None,
) -> tuple[ScenarioRun, list[Server]]:
    """Start the engines and replay the workload through each router; the engines stay up.

    A router whose run failed is in the result with its ``error`` (the
    caller shows what the others measured, then the error).

    Raises:
        ConfigError: A request is too long for the engines' KV cache (checked
            before any engine starts).
        RuntimeError: The engines did not start.
    """
    workload = demo_workload(cfg)
    live = live_config(cfg)
    block_size = get_profile(cfg.profile).block_size
    check_requests_fit(
        "demo", workload.requests, load_tokenizer(), cfg.kv_blocks, block_size,
        f"--kv-blocks {cfg.kv_blocks}",
    )  # fmt: skip
    engines = start_engines(live, workload, fleet)
    run = await run_scenario(
        workload,
        [BENCH_ROUTERS[name] for name in ROUTERS],
        live,
        fleet,
        engines=engines,
        on_start=on_router,
        on_done=on_done,
    )
    return run, engines


async def serve_forever(
    fleet: Fleet, engines: Sequence[Server], admin_api_key: str | None = None
) -> Server:
    """Start a prefixrouter gateway in front of ``engines`` and return it (healthy).

    ``admin_api_key`` opens its ``/admin/*`` endpoints to that key (passed in
    the environment, not on the command line); without it they are off.
    """
    env = {ADMIN_KEY_ENV: admin_api_key} if admin_api_key else None
    port = free_port()
    cmd = router_command(
        BENCH_ROUTERS["prefix_aware"], port=port, workers=[e.url for e in engines],
        peers_dir=default_peers_dir(), prometheus_port=0, tokenizer_dir=None,
    )  # fmt: skip
    gateway = fleet.start_command("gateway", cmd, port, env=env)
    await fleet.wait_healthy([gateway])
    return gateway
