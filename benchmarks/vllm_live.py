"""Live comparison on real vLLM CPU engines: our gateway against the peer routers.

    python benchmarks/vllm_live.py [--repeats 2] [--questions 24] [--turns 8]
        [--routers all] [--workloads doc-qa,multi-turn,cache-pressure]
        [--json benchmarks/results/vllm_live.json] [--plot PNG]

The same doc-QA and multi-turn traffic goes, in turn, through each router in
front of the same two vLLM engines (tiny local model, 20,480-token KV pool each,
block size 32, pinned to cores 0 and 1, KV events and render endpoints on), the
engines' prefix caches reset between runs (``POST /reset_prefix_cache``):

* ``round_robin``: our gateway, round robin;
* ``prefix_aware``: our gateway, text mode (its default configuration);
* ``prefix_aware+events``: our gateway, token mode, KV events;
* ``prefix_aware-no-events``: our gateway, token mode, learning from its own
  routing and the engines' ``cached_tokens`` only;
* ``oracle``: each document pinned to one engine in advance, computed from
  the workload (:mod:`prefixrouter.bench.oracle`);
* ``sglang-cache_aware`` and ``vllm-cache_aware``: the peers from PyPI
  (``scripts/install_peers.sh``), skipped with the install command if absent.

Workloads (seeded, open loop, one request every ``--gap`` seconds, streamed):

* **doc-qa**: 4 documents of about 8,000 tokens, ``--questions`` questions
  each, rounds in shuffled order. Two documents fit one engine's pool, all
  four do not: the ceiling is to pin two per engine.
* **multi-turn**: 8 conversations sharing nothing, each a 1,500-token
  system prompt and ``--turns`` turns; every turn resends the history (our
  own canned answers, since the tiny model's output is noise).
* **cache-pressure** (:mod:`prefixrouter.bench.pressure`): sized from the KV
  the engines report (``vllm:cache_config_info``: ``num_gpu_blocks``,
  ``block_size``) once they are up: 2 documents per engine, 70% of the
  fleet's KV in all (1.4x one engine's), ``--pressure-requests`` questions
  interleaved, Poisson arrivals at ``--pressure-rate``. Printed with the
  ratios of issue 15's goal (ours against the oracle and the best peer).

Per router and run: client-side TTFT mean/p50/p99, the engines' cached-token
share (their ``vllm:prefix_cache_*`` counters) and prefill tokens (prompt
minus cached, from ``usage``). Each run is repeated: mean TTFT moves about 15%
between identical runs here, the cached share much less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from prefixrouter.bench import pressure
from prefixrouter.bench.engine_metrics import kv_config
from prefixrouter.bench.live import LiveConfig, RouterRun, run_router
from prefixrouter.bench.ratios import describe, ttft_ratios
from prefixrouter.bench.routers import ROUTERS, RouterSpec, default_peers_dir
from prefixrouter.bench.workload import BenchWorkload, request_body, text_requests
from prefixrouter.harness.ports import free_port
from prefixrouter.harness.processes import Fleet
from prefixrouter.harness.replay import ReplayRequest
from prefixrouter.harness.texts import record_text
from prefixrouter.real_engines.vllm_fleet import (
    KvEventsOptions,
    VllmFleet,
    VllmOptions,
    ensure_vllm,
)
from prefixrouter.tokenization import load_tokenizer

BLOCK = 32
KV_BLOCKS = 640
ANSWER = "Here is what the record says about that, in short, with the relevant clause."


def body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return request_body(messages, 8, "tiny")


def doc_qa(questions: int, gap_s: float) -> BenchWorkload:
    docs = {s: record_text(s, 8000) for s in (1, 2, 3, 4)}
    reqs: list[ReplayRequest] = []
    for q in range(questions):
        order = list(docs)
        random.Random(q).shuffle(order)
        for s in order:
            messages = [
                {"role": "system", "content": "Answer from this document.\n\n" + docs[s]},
                {"role": "user", "content": f"Question {q} about document {s}?"},
            ]
            reqs.append(ReplayRequest(len(reqs) * gap_s, "doc-qa", f"doc{s}", body(messages)))
    return _workload("doc-qa", "4 x 8k-token documents, interleaved questions", reqs, gap_s)


def multi_turn(turns: int, gap_s: float, sessions: int = 8) -> BenchWorkload:
    systems = {c: record_text(100 + c, 1500) for c in range(sessions)}
    history: dict[int, list[dict[str, str]]] = {
        c: [{"role": "system", "content": systems[c]}] for c in range(sessions)
    }
    reqs: list[ReplayRequest] = []
    for t in range(turns):
        order = list(range(sessions))
        random.Random(1000 + t).shuffle(order)
        for c in order:
            history[c].append(
                {"role": "user", "content": f"Turn {t}: {record_text(c * 97 + t, 60)}"}
            )
            reqs.append(ReplayRequest(len(reqs) * gap_s, "multi-turn", f"c{c}", body(history[c])))
            history[c] = [*history[c], {"role": "assistant", "content": ANSWER}]
    return _workload("multi-turn", f"{sessions} conversations x {turns} turns", reqs, gap_s)


def _workload(name: str, what: str, reqs: list[ReplayRequest], gap_s: float) -> BenchWorkload:
    return BenchWorkload(
        scenario=name,
        description=what,
        shared_prefix=True,
        requests=reqs,
        rate=1 / gap_s,
        load=0.0,
        time_scale=1.0,
        kv_blocks=KV_BLOCKS,
        block_size=BLOCK,
    )


def cache_pressure(url: str, engines: int, requests: int, rate: float) -> BenchWorkload:
    """The cache-pressure scenario sized from the KV the engine at ``url`` reports."""
    blocks, block = asyncio.run(kv_config(url))
    sizing = pressure.size_pressure(engines, blocks, block, requests)
    timed = pressure.pressure_workload(sizing).scaled(rate)
    reqs = text_requests(timed, load_tokenizer())
    return BenchWorkload(
        scenario=pressure.NAME,
        description=sizing.describe(),
        shared_prefix=True,
        requests=reqs,
        rate=rate,
        load=0.0,
        time_scale=1.0,
        kv_blocks=blocks,
        block_size=block,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--questions", type=int, default=24)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.5, help="seconds between requests")
    p.add_argument("--routers", default="all")
    p.add_argument("--workloads", default="doc-qa,multi-turn,cache-pressure")
    p.add_argument("--pressure-requests", type=int, default=96)
    p.add_argument(
        "--pressure-rate", type=float, default=4.0, help="cache-pressure: requests per second"
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of cache-pressure")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="render an earlier --json only (give that run's --questions, --turns, --repeats and "
        "--gap: the Markdown text names them)",
    )
    args = p.parse_args(argv)
    console = Console(stderr=True)
    if args.from_json is not None:
        earlier: list[dict[str, Any]] = json.loads(args.from_json.read_text())
        print_table(earlier)
        for line in ratio_lines(earlier):
            console.print(line)
        if args.markdown is not None:
            args.markdown.write_text(markdown(earlier, args))
        return 0

    setup = ensure_vllm()
    tmp = Path(tempfile.mkdtemp(prefix="vllm-live-"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # The gateway's workers come from --worker URL, whose id is host:port: the
    # engines' topics are the same, so no per-worker configuration is needed.
    events = KvEventsOptions(endpoint=endpoint, topic="127.0.0.1:{port}", replay=True)
    options = VllmOptions(
        max_model_len=(KV_BLOCKS - 1) * BLOCK,
        block_size=BLOCK,
        num_gpu_blocks_override=KV_BLOCKS,
        enable_scale_out=True,  # vllm-router's cache_aware calls the render endpoints
        kv_events=events,
    )
    token_mode = {"mode": "token", "tokenizer": str(setup.model)}
    configs = {
        "events": {"routing": token_mode, "kv_events": {"endpoint": endpoint}},
        "no-events": {"routing": token_mode},
    }
    paths = {}
    for name, cfg in configs.items():
        paths[name] = tmp / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))
    specs = [
        ROUTERS["round_robin"],
        ROUTERS["prefix_aware"],
        RouterSpec("prefix_aware+events", "gateway", "prefix_aware", paths["events"]),
        RouterSpec("prefix_aware-no-events", "gateway", "prefix_aware", paths["no-events"]),
        ROUTERS["oracle"],
        ROUTERS["sglang-cache_aware"],
        ROUTERS["vllm-cache_aware"],
    ]
    if args.routers != "all":
        wanted = set(args.routers.split(","))
        specs = [s for s in specs if s.name in wanted]
    builders = {
        "doc-qa": lambda: doc_qa(args.questions, args.gap),
        "multi-turn": lambda: multi_turn(args.turns, args.gap),
    }
    names = args.workloads.split(",")
    bad = [n for n in names if n not in (*builders, pressure.NAME)]
    if bad:
        p.error(f"--workloads: unknown {bad[0]!r}")
    live = LiveConfig(
        workers=2,
        profile="vllm-cpu",
        peers_dir=default_peers_dir(),
        tokenizer_dir=setup.model,
        log_dir=tmp / "logs",
    )
    results: list[dict[str, Any]] = []
    runs: dict[tuple[str, int], list[RouterRun]] = {}
    with VllmFleet(2, options, setup=setup, log_dir=tmp / "engines") as engines, Fleet() as fleet:
        console.print("starting 2 vLLM engines ...")
        engines.start()
        servers = [e.server for e in engines.engines]
        # cache-pressure is sized from the KV the engines report, so it is built now.
        workloads = [
            cache_pressure(servers[0].url, 2, args.pressure_requests, args.pressure_rate)
            if n == pressure.NAME
            else builders[n]()
            for n in names
        ]
        total = len(workloads) * len(specs) * args.repeats
        with Progress(console=console) as progress:
            task = progress.add_task("runs", total=total)
            for w in workloads:
                for rep in range(args.repeats):
                    for spec in specs:
                        progress.update(task, description=f"{w.scenario} {spec.name} #{rep + 1}")
                        run = asyncio.run(run_router(spec, live, w, fleet, servers))
                        results.append({"workload": w.scenario, "repeat": rep, **run.summary()})
                        progress.advance(task)
                        runs.setdefault((w.scenario, rep), []).append(run)
    print_table(results)
    for w in workloads:
        if w.scenario == pressure.NAME:
            console.print(f"cache-pressure: {w.description}")
    for line in ratio_lines(results):
        console.print(line)
    if args.plot is not None:
        pressure_runs = [r for (name, _), rs in runs.items() if name == pressure.NAME for r in rs]
        plot_pressure(pressure_runs, args.plot)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(markdown(results, args))
    console.print(f"router logs and decision logs: {tmp / 'logs'}")
    return 0


COLUMNS = (
    "workload", "router", "run", "TTFT mean", "p50", "p99", "cached", "prefill tokens",
    "requests per engine",
)  # fmt: skip


def ratio_lines(results: list[dict[str, Any]]) -> list[str]:
    """Issue 15's ratios for each cache-pressure repeat (ours / oracle, ours / best peer)."""
    out = []
    repeats = sorted({r["repeat"] for r in results if r["workload"] == pressure.NAME})
    for rep in repeats:
        rows = [r for r in results if r["workload"] == pressure.NAME and r["repeat"] == rep]
        out += [f"run {rep + 1}: {describe(row)}" for row in ttft_ratios(rows)]
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def plot_pressure(runs: list[RouterRun], path: Path) -> None:
    """TTFT distributions, mean TTFT and cached share per router (cache-pressure runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prefixrouter.bench.report import COLORS

    done = [r for r in runs if r.results]
    if not done:
        return
    fig, (ax_cdf, ax_mean, ax_cache) = plt.subplots(1, 3, figsize=(16, 4.2))
    seen: set[str] = set()
    for r in done:
        name = r.spec.name
        ttft = sorted(x.ttft_s for x in r.results if x.ok and x.ttft_s >= 0)
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            label = None if name in seen else name
            width = 2.2 if name.startswith("prefix_aware") else 1.3
            color = COLORS.get(name.split("+")[0])
            ax_cdf.step(ttft, ys, where="post", color=color, label=label, lw=width)
            seen.add(name)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s, log)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.set_title("cache-pressure on 2 vLLM CPU engines: TTFT")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=7)
    names = list(dict.fromkeys(r.spec.name for r in done))
    sums = {n: [r.summary() for r in done if r.spec.name == n] for n in names}
    # Over the runs that measured each figure (null: all requests failed, an engine unread).
    means = [_mean([s["ttft_ms"]["mean"] / 1e3 for s in sums[n] if s["ttft_ms"]]) for n in names]
    cached = [
        _mean(
            [100 * s["cached_token_share"] for s in sums[n] if s["cached_token_share"] is not None]
        )
        for n in names
    ]
    xs = list(range(len(names)))
    ax_mean.bar(xs, means, color="tab:gray")
    ax_mean.set_xticks(xs, names, rotation=25, fontsize=7)
    ax_mean.set_ylabel("mean TTFT (s), mean over runs")
    ax_cache.bar(xs, cached, color="tab:gray")
    ax_cache.set_xticks(xs, names, rotation=25, fontsize=7)
    ax_cache.set_ylim(0, 100)
    ax_cache.set_ylabel("prompt tokens from cache (%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sec(t: dict[str, float] | None, key: str) -> str:
    """A TTFT statistic in seconds; ``-`` when nothing was measured (null in the summary)."""
    return "-" if t is None else f"{t[key] / 1e3:.3f} s"


def rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per run: figures (``-`` where none was measured), or why the router did not run."""
    out: list[tuple[str, ...]] = []
    for r in results:
        head = (r["workload"], r["router"], str(r["repeat"] + 1))
        if "requests" not in r:
            reason = r.get("skipped") or r.get("error") or ""
            out.append((*head, reason, "", "", "", "", ""))
            continue
        t, share, prefill = r["ttft_ms"], r["cached_token_share"], r["prefill_tokens"]
        out.append(
            (
                *head,
                _sec(t, "mean"),
                _sec(t, "p50"),
                _sec(t, "p99"),
                "-" if share is None else f"{share:.1%}",
                "-" if prefill is None else f"{prefill:,}",
                " ".join("-" if n is None else str(n) for n in r["per_worker_requests"]),
            )
        )
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    table = Table(title="real vLLM, 2 CPU engines")
    for col in COLUMNS:
        table.add_column(col, no_wrap=True)
    for row in rows(results):
        table.add_row(*row)
    Console().print(table)


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The tables as a Markdown section (for benchmarks/RESULTS.md)."""
    lines = [
        "## Live, on real vLLM engines",
        "",
        "`python benchmarks/vllm_live.py "
        f"--questions {args.questions} --turns {args.turns} --repeats {args.repeats} "
        f"--gap {args.gap:g}`: two vLLM "
        "CPU engines (tiny local model, 20,480-token KV pool each, block size 32, pinned to "
        "cores 0 and 1), the same traffic through each router in turn, caches reset between "
        "runs. doc-qa: 4 documents of 8,000 tokens, interleaved questions, one request every "
        f"{args.gap:g} s; multi-turn: 8 conversations with 1,500-token system prompts. "
        "TTFT measured by the client (streaming), from each request's scheduled send; "
        "cached share from the engines' counters.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    lines += ["", *(f"- {line}" for line in ratio_lines(results))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
