"""A whole benchmark: every scenario through every router, then the overhead comparison.

:func:`run_bench` builds each scenario's text workload, runs it on its own
fleet (:func:`prefixrouter.bench.live.run_scenario`), then measures overhead
(:func:`prefixrouter.bench.overhead.run_overhead`) unless disabled. The JSON,
the PNG and the Markdown tables are rewritten after every scenario, so an
interrupted run keeps what it measured; a write that fails (the CLI checks
the paths first, so a full disk, say) stops the run with :class:`OutputError`
after the scenario's table was shown. Progress goes to a :class:`BenchUI`
(the CLI draws rich progress bars; tests pass nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prefixrouter.bench.live import LiveConfig, ScenarioRun, run_scenario
from prefixrouter.bench.overhead import OverheadConfig, run_overhead
from prefixrouter.bench.report import document, markdown, plot, write_json
from prefixrouter.bench.routers import RouterSpec
from prefixrouter.bench.workload import build_bench_workload, warmup_requests
from prefixrouter.errors import PrefixRouterError, unwritable
from prefixrouter.harness.processes import Fleet
from prefixrouter.harness.replay import ReplayResult
from prefixrouter.sim.profiles import EngineProfile
from prefixrouter.tokenization import hf_tokenizer_dir, load_tokenizer

WARMUP_TOKENS = 1500
"""Warm-up prompt length before ``scale``."""


class OutputError(PrefixRouterError):
    """A result file could not be written; the message names the option and the reason."""


class BenchUI(Protocol):
    """Where progress goes."""

    def router_started(self, scenario: str, router: str, total: int) -> None: ...
    def request_done(self, result: ReplayResult) -> None: ...
    def scenario_done(self, report: dict[str, Any]) -> None: ...
    def overhead_router(self, router: str, index: int, total: int) -> None: ...


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """Everything ``prefixrouter bench`` was asked for (see its options)."""

    scenarios: Sequence[str]
    routers: Sequence[RouterSpec]
    profile: EngineProfile
    peers_dir: Path
    workers: int = 4
    rate: float = 8.0
    requests: int = 160
    load: float = 0.8
    time_scale: float | None = None
    scale: float = 0.5
    warmup: int = 100
    rounds: int = 1
    seed: int = 0
    kv_blocks: int | None = None
    log_dir: Path | None = None
    json_out: Path | None = None
    plot_out: Path | None = None
    markdown_out: Path | None = None
    overhead: OverheadConfig | None = field(default_factory=OverheadConfig)


@dataclass(slots=True)
class BenchResult:
    """What a benchmark measured."""

    runs: list[ScenarioRun] = field(default_factory=list)
    overhead: list[dict[str, Any]] | None = None

    def document(self, opts: BenchOptions) -> dict[str, Any] | list[dict[str, Any]]:
        """The JSON document (see :mod:`prefixrouter.bench.report`)."""
        over = None
        if self.overhead is not None and opts.overhead is not None:
            over = {
                "scenario": "overhead",
                "workers": opts.workers,
                "rate_rps": opts.overhead.rate,
                "results": self.overhead,
            }
        return document([r.report() for r in self.runs], over)

    def save(self, opts: BenchOptions) -> None:
        """Write the JSON, the PNG and the Markdown asked for (each rewritten whole).

        Raises:
            OutputError: A file could not be written (``--json PATH: cannot write: WHY``).
        """

        def write_markdown(path: Path) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(markdown(self.document(opts)), encoding="utf-8")

        writes: list[tuple[str, Path | None, Callable[[Path], None]]] = [
            ("--json", opts.json_out, lambda path: write_json(path, self.document(opts))),
            ("--plot", opts.plot_out, lambda path: plot(self.runs, self.overhead or [], path)),
            ("--markdown", opts.markdown_out, write_markdown),
        ]
        for option, path, write in writes:
            if path is None:
                continue
            try:
                write(path)
            except OSError as exc:
                raise OutputError(f"{option} {unwritable(path, exc)}") from None


def _run_loop(coro: Any) -> Any:
    """Run ``coro`` on uvloop when installed (tighter timing for the load generator)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_bench(opts: BenchOptions, fleet: Fleet, ui: BenchUI | None = None) -> BenchResult:
    """Run the benchmark ``opts`` describes; servers are started in ``fleet``.

    Raises:
        ConfigError: A bad scenario or number.
        OutputError: A result file could not be written.
        RuntimeError: The engines could not start.
    """
    tokenizer = load_tokenizer()
    tok_dir = hf_tokenizer_dir()
    warm = warmup_requests(
        opts.warmup, tokens=max(64, round(WARMUP_TOKENS * opts.scale)), tokenizer=tokenizer,
        seed=opts.seed,
    )  # fmt: skip
    cfg = LiveConfig(
        workers=opts.workers, profile=opts.profile.name, peers_dir=opts.peers_dir,
        tokenizer_dir=tok_dir, log_dir=opts.log_dir, warmup=tuple(warm),
    )  # fmt: skip
    workloads = [
        build_bench_workload(
            name,
            requests=opts.requests,
            rate=opts.rate,
            scale=opts.scale,
            workers=opts.workers,
            profile=opts.profile,
            tokenizer=tokenizer,
            load=opts.load,
            time_scale=opts.time_scale,
            seed=opts.seed,
            kv_blocks=opts.kv_blocks,
        )
        for name in opts.scenarios
    ]
    out = BenchResult()
    for workload in workloads:

        def on_start(router: str, total: int, scenario: str = workload.scenario) -> None:
            if ui is not None:
                ui.router_started(scenario, router, total)

        run = asyncio.run(
            run_scenario(
                workload,
                opts.routers,
                cfg,
                fleet,
                on_start=on_start,
                on_done=ui.request_done if ui is not None else None,
                rounds=opts.rounds,
            )
        )
        out.runs.append(run)
        if ui is not None:  # first: the table is shown even if the write below fails
            ui.scenario_done(run.report())
        out.save(opts)
    # Overhead is one process's: replicated routers are measured once, as one;
    # the oracle (pins for a workload) and token mode (a written config) are not measured.
    single = [
        s for s in opts.routers
        if s.replicas == 1 and s.kind != "oracle" and (s.mode == "text" or s.config is not None)
    ]  # fmt: skip
    if opts.overhead is not None and single:
        total = len(single)
        names = [s.name for s in single]

        def started(router: str) -> None:
            if ui is not None:
                ui.overhead_router(router, names.index(router), total)

        out.overhead = _run_loop(
            run_overhead(
                single,
                opts.overhead,
                fleet,
                peers_dir=opts.peers_dir,
                tokenizer_dir=tok_dir,
                on_start=started,
            )
        )
        if ui is not None:
            ui.overhead_router("done", total, total)
        out.save(opts)
    return out
