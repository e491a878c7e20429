"""Every scenario, at a moderate and a high load, under every policy: benchmarks/RESULTS.md.

Usage::

    python benchmarks/sim_results.py [--out benchmarks] [--loads 0.6,0.9]
        [--scenarios a,b,...] [--modes token,text] [--mooncake-limit 3000] [--seed 0]

For each scenario, load and routing mode (``token``: the router hashes token
ids; ``text``: the gateway's default, chat bodies hashed in character chunks,
see ``prefixrouter.sim.text``) it simulates every registered policy on the
same requests and fleet (``prefixrouter.sim.runner``), then writes

* ``RESULTS.md``: a summary (ours against the best baseline per scenario and
  load) and one table per scenario and load;
* ``results/<scenario>-<load>.json`` (token mode) and
  ``results/<scenario>-<load>-text.json`` (text mode): the same report
  ``prefixrouter simulate --json`` writes;
* ``results/<stem>.png``: TTFT distributions and prefill per policy.

A mode left out of ``--modes`` is not simulated: its JSON files already in
``results/`` (if any) go into ``RESULTS.md`` as they are, so one mode can be
rerun alone.

Load is a fraction of the fleet's capacity with ideal prefix reuse (see
``prefixrouter.sim.runner``); the Mooncake trace is time-scaled to the same
loads. Deterministic: the same seed gives the same files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from prefixrouter.core.policy import policy_names
from prefixrouter.sim.plot import plot_report
from prefixrouter.sim.profiles import get_profile
from prefixrouter.sim.report import (
    lower_bound_prefill_tokens,
    total_prefill_tokens,
    ttft_floor_ms,
)
from prefixrouter.sim.runner import plan, run_plan
from prefixrouter.sim.scenarios import SCENARIOS
from prefixrouter.sim.traces import bundled_mooncake_path, load_mooncake
from prefixrouter.sim.workload import Workload

PROFILE = "llama3-8b-h100"
MOONCAKE_LIMIT = 3000
"""Requests of the bundled trace the tables run (``--mooncake-limit``): its first window."""


def build(name: str, seed: int, mooncake_limit: int) -> Workload:
    if name == "mooncake-conversation":
        return load_mooncake(bundled_mooncake_path(), limit=mooncake_limit, seed=seed)
    return SCENARIOS[name].build(seed)


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Ours against the best baseline on mean and p99 TTFT, and prefill against the bound."""
    ours = next(r for r in report["results"] if r["policy"] == "prefix_aware")
    base = [r for r in report["results"] if r["policy"] != "prefix_aware"]
    best_mean = min(base, key=lambda r: r["ttft_ms"]["mean"])
    best_p99 = min(base, key=lambda r: r["ttft_ms"]["p99"])
    bound = report["lower_bound_prefill_tokens"]
    return {
        "ours_mean": ours["ttft_ms"]["mean"],
        "best_mean": best_mean["ttft_ms"]["mean"],
        "best_mean_policy": best_mean["policy"],
        "ours_p99": ours["ttft_ms"]["p99"],
        "best_p99": best_p99["ttft_ms"]["p99"],
        "best_p99_policy": best_p99["policy"],
        "prefill_x_bound": total_prefill_tokens(ours) / bound if bound else float("nan"),
    }


if TYPE_CHECKING:  # an annotation only: policy_diff.py --against imports this module
    from prefixrouter.core.dispatch import RoutingMode

MODES: tuple[RoutingMode, ...] = ("token", "text")


def stem(name: str, load: float, mode: str) -> str:
    """The file stem of one report: token mode keeps the names it had before modes existed."""
    return f"{name}-{load:.1f}" + ("" if mode == "token" else f"-{mode}")


def mode_of(report: dict[str, Any]) -> str:
    """A report's routing mode (no ``mode`` key: token, as ``simulate --json`` writes)."""
    return str(report.get("mode", "token"))


def _ms(v: float) -> str:
    return f"{v / 1e3:.2f} s" if v >= 10_000 else f"{v:.0f} ms"


def _gain(ours: float, best: float) -> str:
    """How much lower ours is than the best baseline, as a percentage (negative: worse)."""
    if best <= 0:
        return "n/a"
    return f"{(1 - ours / best) * 100:+.0f}%"


SEED_VERDICTS = (
    Path(__file__).with_name("seed_verdict_results.md"),
    Path(__file__).with_name("seed_verdict_bursty_results.md"),
    Path(__file__).with_name("seed_verdict_heldout_results.md"),
)
"""The summary's verdict over several seeds (``benchmarks/seed_verdict.py``), Poisson
arrivals and bursty ones, and held out (another engine profile and fleet size), under it."""
NOTES = Path(__file__).with_name("results_notes.md")
TEXT_NOTES = Path(__file__).with_name("text_mode_notes.md")
"""Where text mode loses to token mode and why (written from these figures), appended."""
CLIENT_CAP = Path(__file__).with_name("client_cap_results.md")
"""Clients that send max_tokens as a cap (``benchmarks/client_cap.py``), after the notes."""
LIVE = Path(__file__).with_name("live_results.md")
"""The live comparison with the real peer routers (``prefixrouter bench``), appended."""
VLLM = Path(__file__).with_name("vllm_results.md")
"""The comparison on real vLLM engines (``benchmarks/vllm_live.py``), appended."""
REPLICAS = Path(__file__).with_name("replicas_results.md")
"""Router replicas, simulated (``benchmarks/replica_sweep.py``), appended."""
REPLICAS_LIVE = Path(__file__).with_name("replicas_live_results.md")
"""Router replicas, live (``prefixrouter bench --replicas``), appended."""
RELIABILITY = Path(__file__).with_name("reliability_results.md")
"""Faults and soak (``benchmarks/faults_table.py``, ``benchmarks/soak.py``), appended."""
EPP = Path(__file__).with_name("epp_results.md")
"""The endpoint picker behind Envoy (``benchmarks/epp_overhead.py``), appended."""
TENANT_FLOOD = Path(__file__).with_name("tenant_flood_results.md")
"""Tenant limits under a one-tenant flood, and the fuzzing totals, appended."""


PERCENTILES = (
    "**Percentiles**, in every table of this file and in every figure the project",
    "reports (simulator, `prefixrouter bench` and `demo`, the load generator,",
    "`benchmarks/`, `prefixrouter analyze`), are nearest rank",
    "(`prefixrouter.stats`): the q-quantile of n values is the value at rank",
    "ceil(q × n) of the values sorted ascending (rank 1 the smallest), so it is",
    "always a value that occurred, a TTFT some request had, never a blend of two;",
    "p50 of an even count is the lower middle value and p99 of fewer than 100",
    "values the largest. Means and percentiles are over completed requests",
    '(successful ones, live). The overhead rows of "Live, against the real peer',
    'routers" were measured when the load generator still took the values at',
    "index n // 2 and int(0.99 n) (at most one rank higher); a rerun uses nearest rank.",
)
"""The percentile definition, stated under the introduction (``prefixrouter.stats``)."""


def _by_policy(report: dict[str, Any], policy: str) -> dict[str, Any] | None:
    return next((r for r in report["results"] if r["policy"] == policy), None)


def _share(r: dict[str, Any]) -> str:
    return f"{r['cached_tokens'] / r['prompt_tokens']:.1%}" if r["prompt_tokens"] else "n/a"


def mode_table(reports: list[dict[str, Any]]) -> list[str]:
    """Text mode beside token mode: prefix_aware's and round robin's figures per scenario, load."""
    token = {(r["scenario"], r["load"]): r for r in reports if mode_of(r) == "token"}
    pairs = [(token.get((r["scenario"], r["load"])), r) for r in reports if mode_of(r) == "text"]
    if not pairs:
        return []
    lines = [
        "",
        "## Text mode beside token mode",
        "",
        "Text mode is the gateway's default: the router sees each request as the chat",
        "body a client sends (`prefixrouter.sim.text`: one word per token id, the",
        "system part as the system message), rendered to ChatML and hashed in",
        "256-character chunks, with prompt tokens estimated from characters per",
        "token learned from the engine's `prompt_tokens` (start 4.0; the cpt column",
        "is prefix_aware's estimate at the end). The engines are the same in both",
        "modes (token blocks), so only routing differs. Each cell: token → text.",
        "",
        "| scenario | load | prefix_aware mean | p99 | cached | round_robin mean | p99 | "
        "cached | cpt |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for tok, txt in pairs:
        cells: list[str] = []
        for policy in ("prefix_aware", "round_robin"):
            b = _by_policy(txt, policy)
            a = _by_policy(tok, policy) if tok is not None else None
            if b is None:
                cells += ["n/a"] * 3
                continue
            for fmt in (
                lambda r: _ms(r["ttft_ms"]["mean"]),
                lambda r: _ms(r["ttft_ms"]["p99"]),
                _share,
            ):
                cells.append(f"{fmt(a)} → {fmt(b)}" if a is not None else fmt(b))
        ours = _by_policy(txt, "prefix_aware")
        cpt = ours.get("chars_per_token") if ours is not None else None
        lines.append(
            f"| {txt['scenario']} | {txt['load']:.1f} | {' | '.join(cells)} | {cpt:.2f} |"
            if cpt is not None
            else f"| {txt['scenario']} | {txt['load']:.1f} | {' | '.join(cells)} | n/a |"
        )
    if TEXT_NOTES.exists():
        lines += ["", TEXT_NOTES.read_text(encoding="utf-8").strip()]
    return lines


def markdown(reports: list[dict[str, Any]], command: str, elapsed_s: float) -> str:
    # A --markdown-only rewrite simulates nothing: no duration to report.
    took = f" in {elapsed_s / 60:.0f} minutes" if elapsed_s >= 30 else ""
    lines = [
        "# Simulated results: prefixrouter against the peers' policies",
        "",
        f"Produced by `{command}`{took} on the 2-core",
        f"development machine; profile `{PROFILE}` (Llama-3-8B on one H100 per replica,",
        "see `prefixrouter profiles`). Every policy sees the same requests on the same",
        "simulated fleet. Load is a fraction of the fleet's capacity with ideal prefix",
        "reuse (`prefixrouter.sim.runner`). The bound is the prefill no router can",
        "avoid: each reusable prefix computed once. The TTFT floor is the mean time",
        "to first token no router can beat (`prefixrouter.sim.report.ttft_floor`):",
        "each request prefilled on an idle engine, reusing any prefix an earlier",
        "request brought once it can have been computed; the distance to it is",
        "what queues, decode batches and cold prefills cost. JSON and plots: `results/`.",
        "",
        *PERCENTILES,
        "",
        "## Summary",
        "",
        "Token mode (the router hashes token ids, as the gateway's `routing.mode:",
        "token`), one seed: the tables below. Gain = how much lower prefixrouter's",
        "TTFT is than the best baseline's (a different baseline may be best on mean",
        "and on p99). One seed's p99 can turn on one request; the verdict over four",
        "seeds, with its spread, follows the table (Poisson arrivals, then bursty ones).",
        "",
        "| scenario | load | ours mean | best baseline mean | gain | ours p99 | "
        "best baseline p99 | gain | prefill ×bound | TTFT floor mean |",
        "| --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for rep in reports:
        if mode_of(rep) != "token":
            continue
        v = verdict(rep)
        lines.append(
            f"| {rep['scenario']} | {rep['load']:.1f} | {_ms(v['ours_mean'])} | "
            f"{_ms(v['best_mean'])} ({v['best_mean_policy']}) | "
            f"{_gain(v['ours_mean'], v['best_mean'])} | {_ms(v['ours_p99'])} | "
            f"{_ms(v['best_p99'])} ({v['best_p99_policy']}) | "
            f"{_gain(v['ours_p99'], v['best_p99'])} | {v['prefill_x_bound']:.2f} | "
            f"{_ms(rep['ttft_floor_ms']['mean']) if 'ttft_floor_ms' in rep else 'n/a'} |"
        )
    for notes in (*SEED_VERDICTS, NOTES, CLIENT_CAP):
        if notes.exists():
            lines += ["", notes.read_text(encoding="utf-8").strip()]
    lines += mode_table(reports)
    for rep in reports:
        mode = mode_of(rep)
        suffix = "" if mode == "token" else f", {mode} mode"
        lines += [
            "",
            f"## {rep['scenario']} at load {rep['load']:.1f}{suffix}",
            "",
            f"{rep['workers']} workers, {rep['rate_rps']:.2f} req/s, "
            f"{rep['results'][0]['requests']} requests, KV {rep['kv_blocks']} blocks per "
            f"worker; bound {rep['lower_bound_prefill_tokens']:,} prefill tokens. "
            f"![plot](results/{stem(rep['scenario'], rep['load'], mode)}.png)",
            "",
            "| policy | TTFT mean | p50 | p90 | p99 | e2e mean | e2e p99 | cached | "
            "prefill ×bound | evictions | imbalance | warm left |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        bound = rep["lower_bound_prefill_tokens"] or 1
        for r in sorted(rep["results"], key=lambda r: r["ttft_ms"]["mean"]):
            t, e = r["ttft_ms"], r["e2e_ms"]
            share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0
            name = f"**{r['policy']}**" if r["policy"] == "prefix_aware" else r["policy"]
            lines.append(
                f"| {name} | {_ms(t['mean'])} | {_ms(t['p50'])} | {_ms(t['p90'])} | "
                f"{_ms(t['p99'])} | {_ms(e['mean'])} | {_ms(e['p99'])} | {share:.1%} | "
                f"{total_prefill_tokens(r) / bound:.2f} | {r['evictions']} | "
                f"{r['load_imbalance']:.2f} | {r['warm_abandoned']} |"
            )
    for appended in (LIVE, VLLM, REPLICAS_LIVE, REPLICAS, RELIABILITY, EPP, TENANT_FLOOD):
        if appended.exists():
            lines += ["", appended.read_text(encoding="utf-8").strip()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks"))
    ap.add_argument("--loads", default="0.6,0.9")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--mooncake-limit", type=int, default=MOONCAKE_LIMIT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help="routing modes to simulate")
    ap.add_argument(
        "--markdown-only",
        action="store_true",
        help="rewrite RESULTS.md from the JSON files already in results/ (no simulation)",
    )
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    names = [n for n in args.scenarios.split(",") if n]
    asked = [m for m in args.modes.split(",") if m]
    for m in asked:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}; known: {', '.join(MODES)}")
    modes = [mode for mode in MODES if mode in asked]
    policies = policy_names()
    profile = get_profile(PROFILE)
    out_dir = args.out / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    command = "python benchmarks/sim_results.py"
    if args.modes != ",".join(MODES) and not args.markdown_only:
        command += f" --modes {args.modes}"  # the other modes' figures: results/ as it was
    if args.markdown_only:
        modes = []
    started = time.monotonic()
    fresh: dict[str, dict[str, Any]] = {}
    with Progress(
        TextColumn("[bold]{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        total = len(names) * len(loads) * len(modes)
        overall = progress.add_task("scenario x load x mode", total=total)
        for name in names:
            if not modes:
                break
            workload = build(name, args.seed, args.mooncake_limit)
            bound = lower_bound_prefill_tokens(workload)
            for load, mode in ((x, m) for x in loads for m in modes):
                p = plan(workload, profile, policies, load=load, mode=mode)
                task = progress.add_task(f"{name} @ {load} {mode}", total=len(policies))

                def advance(_name: str, _requests: int, task: TaskID = task) -> None:
                    progress.advance(task)

                results, runs = run_plan(p, on_start=advance)
                report = {
                    "scenario": name,
                    "workers": p.workers,
                    "profile": profile.name,
                    "kv_blocks": p.kv_blocks if p.kv_blocks is not None else profile.kv_blocks,
                    "seed": args.seed,
                    "load": load,
                    "rate_rps": p.rate,
                    "kv_events": False,
                    **({"mode": mode} if mode != "token" else {}),
                    "lower_bound_prefill_tokens": bound,
                    "ttft_floor_ms": ttft_floor_ms(p.workload, profile.speed),
                    "results": results,
                }
                key = stem(name, load, mode)
                (out_dir / f"{key}.json").write_bytes(
                    orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n"
                )
                plot_report(report, runs, out_dir / f"{key}.png")
                fresh[key] = report
                progress.remove_task(task)
                progress.advance(overall)
    elapsed = time.monotonic() - started
    reports: list[dict[str, Any]] = []
    for name, load, mode in ((n, x, m) for m in MODES for n in names for x in loads):
        key = stem(name, load, mode)
        path = out_dir / f"{key}.json"
        if key in fresh:
            reports.append(fresh[key])
        elif path.exists():  # a mode not rerun: its last results as they are
            rep = orjson.loads(path.read_bytes())
            if "ttft_floor_ms" not in rep:  # from before the floor: it needs no run
                workload = build(name, args.seed, args.mooncake_limit)
                p = plan(workload, profile, ["prefix_aware"], load=load, mode=mode)
                rep["ttft_floor_ms"] = ttft_floor_ms(p.workload, profile.speed)
            reports.append(rep)
    (args.out / "RESULTS.md").write_text(markdown(reports, command, elapsed), encoding="utf-8")
    console.print(f"wrote {args.out / 'RESULTS.md'} and {out_dir}/")


if __name__ == "__main__":
    main()
