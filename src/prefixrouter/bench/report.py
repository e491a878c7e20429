"""What ``prefixrouter bench`` shows and writes: rich tables, the JSON file and the PNG.

JSON: one scenario gives ``{"scenario", ..., "results": [{"router", "ttft_ms":
{"mean", "p50", "p90", "p99"}, "e2e_ms": {...}, "throughput_rps",
"cached_token_share", "per_worker_requests", ...}]}``; several scenarios (or a
scenario and the overhead comparison) give a list of such objects. The overhead
comparison is the object whose ``scenario`` is ``"overhead"``; its results hold
``added_p50_ms``, ``added_p99_ms``, ``rps_max``, ``cpu_ms_per_request`` and
``engine_cpu_ms_per_request`` per router. A skipped router has ``skipped`` (why,
and the install command) instead of figures; a failed one has ``error``. A
figure nothing measured is null (a router whose requests all failed has no
TTFT; an engine that stopped during the run has no counters) and the tables
show it as ``-``. Under each scenario's table, notes say what a reader needs
to weigh the figures: a router's failed requests and the first error, an
engine that could not be read after the run, and requests that waited in the
client for a concurrency slot (their TTFT includes that wait: the client,
not only the router, limited them).

PNG: one row per scenario (TTFT distribution, TTFT p50 and p99, cached-token
share per router) and one row for the overhead comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.table import Table

from prefixrouter.bench.live import ScenarioRun
from prefixrouter.bench.ratios import describe
from prefixrouter.bench.rounds import round_label

COLORS = {
    "round_robin": "tab:blue",
    "prefix_aware": "black",
    "prefix_aware-token": "dimgray",
    "oracle": "tab:purple",
    "sglang-cache_aware": "tab:orange",
    "sglang-round_robin": "tab:green",
    "vllm-cache_aware": "tab:red",
}


NOT_MEASURED = "-"
"""A figure nothing measured (JSON null), in the tables."""


def _ms(value: float | None) -> str:
    if value is None:
        return NOT_MEASURED
    return f"{value / 1e3:.2f} s" if value >= 10_000 else f"{value:.0f} ms"


def _pct(value: float | None) -> str:
    return NOT_MEASURED if value is None else f"{value:.1%}"


def _stat(figures: dict[str, float] | None, key: str) -> float | None:
    """One statistic of a ``ttft_ms``/``e2e_ms`` object, None when not measured."""
    return None if figures is None else figures[key]


def _engines(per_worker: list[int | None]) -> str:
    return " ".join(NOT_MEASURED if n is None else str(n) for n in per_worker)


def result_notes(report: dict[str, Any]) -> list[str]:
    """What a reader needs to weigh one scenario's figures, one line per finding.

    A router's failed requests with the first error, engines that could not
    be read after its run, and requests that waited in the client for a
    concurrency slot (their TTFT counts that wait).
    """
    notes: list[str] = []
    limit = report.get("client_concurrency")
    for r in report["results"]:
        if "requests" not in r:  # skipped or failed as a whole: its row says why
            continue
        name = _label(r)
        # .get: a report written before these fields (a saved JSON) has no notes.
        if r.get("errors"):
            notes.append(
                f"{name}: {r['errors']} of {r['requests']} requests failed; the first: "
                f"{_one_line(r.get('first_error') or '')}"
            )
        for line in r.get("unread") or ():
            notes.append(
                f"{name}: not read after the run, its figures shown as {NOT_MEASURED}: {line}"
            )
        queued = r.get("client_queued") or 0
        if queued:
            wait = r["client_wait_ms"]
            slots = f"all {limit} client slots" if limit else "every client slot"
            notes.append(
                f"{name}: {queued} of {r['requests']} requests found {slots} taken and waited "
                f"(client-side wait up to {_ms(wait['max'])}, mean {_ms(wait['mean'])} over all "
                "requests): the client limited these figures too; TTFT counts from the "
                "scheduled send"
            )
    return notes


def _one_line(text: str, width: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def scenario_table(report: dict[str, Any]) -> Table:
    """One scenario's results, one row per router."""
    title = (
        f"{report['scenario']} · {report['workers']} engines · {report['requests']} requests at "
        f"{report['rate_rps']:g} req/s · load {report['load']:.2f} · engine time scale "
        f"{report['time_scale']:.3g}"
    )
    ratios = report.get("ratios") or []
    lines = result_notes(report)
    if "oracle" in _names(report):
        lines += [describe(r) for r in ratios]
    caption = "\n".join(lines) or None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    cols = ["router", "ok", "TTFT mean", "p50", "p90", "p99", "e2e p50", "e2e p99", "req/s",
            "cached", "requests per engine"]  # fmt: skip
    # Gateway replicas: the fact propagation lag and each replica's CPU.
    replicated = any("replicas" in r for r in report["results"])
    if replicated:
        cols += ["lag p50", "lag p99", "CPU/req per replica", "sync CPU/req (all requests)"]
    for col in cols:
        table.add_column(
            col,
            justify="left" if col in ("router", "requests per engine") else "right",
            no_wrap=col == "router",
        )
    for r in report["results"]:
        if "requests" not in r:
            why = r.get("skipped") or r.get("error", "")
            table.add_row(_label(r), "skipped" if "skipped" in r else "failed", why[:150])
            continue
        t, e = r["ttft_ms"], r["e2e_ms"]
        cells = [
            _label(r),
            f"{r['ok']}/{r['requests']}",
            _ms(_stat(t, "mean")), _ms(_stat(t, "p50")), _ms(_stat(t, "p90")),
            _ms(_stat(t, "p99")), _ms(_stat(e, "p50")), _ms(_stat(e, "p99")),
            f"{r['throughput_rps']:.2f}",
            _pct(r["cached_token_share"]),
            _engines(r["per_worker_requests"]),
        ]  # fmt: skip
        if replicated:
            cells += _replica_cells(r)
        table.add_row(*cells, style="bold" if r["router"].startswith("prefix_aware") else None)
    return table


def _label(r: dict[str, Any]) -> str:
    """A result's router, and its round under ``--rounds``."""
    return round_label(str(r["router"]), r.get("round"))


def _spread_cell(s: dict[str, float] | None, fmt: Callable[[float], str]) -> str:
    if s is None:
        return "-"
    return f"{fmt(s['mean'])} ({fmt(s['min'])} to {fmt(s['max'])})"


def _ratio_cell(row: dict[str, Any]) -> str:
    v = row["vs_first"]
    if v is None:
        return "-"
    return f"{v['mean']:.2f}x ({v['min']:.2f}x to {v['max']:.2f}x) of {v['router']}"


def _spread_rows(report: dict[str, Any], ms: Callable[[float], str]) -> list[list[str]]:
    """The rounds table's cells, one row per router (:mod:`prefixrouter.bench.rounds`)."""
    return [
        [
            row["router"],
            str(row["rounds"]),
            _spread_cell(row["ttft_mean_ms"], ms),
            _spread_cell(row["ttft_p99_ms"], ms),
            _spread_cell(row["cached_share"], lambda v: f"{v:.1%}"),
            _ratio_cell(row),
        ]
        for row in report["rounds"]
    ]


ROUNDS_COLUMNS = ("router", "rounds", "TTFT mean: mean (min to max)", "TTFT p99",
                  "cached", "mean TTFT over the first router's, per round")  # fmt: skip


def rounds_table(report: dict[str, Any]) -> Table:
    """Each router over the rounds of ``--rounds``: its spread and its paired ratio."""
    n = max((row["rounds"] for row in report["rounds"]), default=0)
    table = Table(title=f"{report['scenario']} · over {n} rounds", title_justify="left")
    for col in ROUNDS_COLUMNS:
        table.add_column(col, justify="left" if col in ("router", ROUNDS_COLUMNS[-1]) else "right")
    for cells in _spread_rows(report, _ms):
        table.add_row(*cells, style="bold" if cells[0].startswith("prefix_aware") else None)
    return table


def _names(report: dict[str, Any]) -> set[str]:
    """The routers that measured a TTFT."""
    return {r["router"] for r in report["results"] if r.get("ttft_ms") is not None}


def _replica_cells(r: dict[str, Any]) -> list[str]:
    if "replicas" not in r:
        return ["", "", "", ""]
    lag = r["propagation_lag_ms"]
    synced = lag["facts_messages"] > 0
    return [
        f"{lag['p50']:.1f} ms" if synced else "-",
        f"{lag['p99']:.1f} ms" if synced else "-",
        " ".join(f"{c:.2f}" for c in r["cpu_ms_per_request"]) + " ms",
        " ".join(f"{c:.3f}" for c in r["sync_cpu_ms_per_request"]) + " ms",
    ]


def overhead_table(rows: Sequence[dict[str, Any]], rate: float) -> Table:
    """The overhead comparison, one row per router."""
    table = Table(
        title=f"overhead over a direct call · instant engines · {rate:g} req/s open loop",
        title_justify="left",
    )
    for col in ("router", "added p50", "added p99", "max req/s", "router CPU/req",
                "engine CPU/req", "errors"):  # fmt: skip
        table.add_column(col, justify="left" if col == "router" else "right")
    for r in rows:
        if "added_p50_ms" not in r:
            why = r.get("skipped") or r.get("error", "")
            table.add_row(r["router"], "skipped" if "skipped" in r else "failed", why[:150])
            continue
        table.add_row(
            r["router"],
            f"{r['added_p50_ms']:.2f} ms",
            f"{r['added_p99_ms']:.2f} ms",
            f"{r['rps_max']:,.0f}",
            f"{r['cpu_ms_per_request']:.3f} ms",
            f"{r['engine_cpu_ms_per_request']:.3f} ms",
            str(r["errors"]),
            style="bold" if r["router"] == "prefix_aware" else None,
        )
    return table


def document(
    scenarios: Sequence[dict[str, Any]], overhead: dict[str, Any] | None
) -> dict[str, Any] | list[dict[str, Any]]:
    """The JSON document: one object, or a list when there is more than one."""
    items = [*scenarios, *([overhead] if overhead is not None else [])]
    return items[0] if len(items) == 1 else items


def write_json(path: Path, doc: dict[str, Any] | list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


def plot(runs: Sequence[ScenarioRun], overhead: Sequence[dict[str, Any]], path: Path) -> None:
    """The PNG (module doc)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured_overhead = [r for r in overhead if "added_p50_ms" in r]
    nrows = len(runs) + (1 if measured_overhead else 0)
    if nrows == 0:
        return
    fig, axes = plt.subplots(nrows, 3, figsize=(16, 3.8 * nrows), squeeze=False)
    for row, run in zip(axes, runs, strict=False):
        ax_cdf, ax_ttft, ax_cache = row
        done = [r for r in run.runs if r.results]
        names = [r.label for r in done]
        colors = [COLORS.get(r.spec.name, "tab:gray") for r in done]
        for r, color in zip(done, colors, strict=True):
            ttft = sorted(x.ttft_s * 1e3 for x in r.results if x.ok and x.ttft_s >= 0)
            if ttft:
                ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
                width = 2.5 if r.spec.name.startswith("prefix_aware") else 1.5
                ax_cdf.step(ttft, ys, where="post", label=r.label, color=color, lw=width)
        ax_cdf.set_xscale("log")
        ax_cdf.set_xlabel("TTFT (ms, log)")
        ax_cdf.set_ylabel("share of requests")
        ax_cdf.set_title(f"{run.workload.scenario}: TTFT distribution")
        ax_cdf.grid(True, which="both", alpha=0.3)
        if ax_cdf.get_legend_handles_labels()[0]:  # no router measured a TTFT: no legend
            ax_cdf.legend(fontsize=8)
        summaries = [r.summary() for r in done]
        xs = range(len(done))
        # Not measured: NaN, no bar (a zero bar would read as a measured 0).
        p50 = [_nan(_stat(s["ttft_ms"], "p50")) for s in summaries]
        p99 = [_nan(_stat(s["ttft_ms"], "p99")) for s in summaries]
        ax_ttft.bar([x - 0.2 for x in xs], p50, 0.4, color=colors, alpha=0.5, label="p50")
        ax_ttft.bar([x + 0.2 for x in xs], p99, 0.4, color=colors, label="p99")
        ax_ttft.set_xticks(list(xs), names, rotation=20, fontsize=8)
        ax_ttft.set_ylabel("TTFT (ms)")
        ax_ttft.set_title("TTFT p50 (light) and p99")
        cached = [100 * _nan(s["cached_token_share"]) for s in summaries]
        ax_cache.bar(list(xs), cached, color=colors)
        ax_cache.set_xticks(list(xs), names, rotation=20, fontsize=8)
        ax_cache.set_ylim(0, 100)
        ax_cache.set_ylabel("prompt tokens from cache (%)")
        ax_cache.set_title("cached-token share (engine counters)")
    if measured_overhead:
        ax_lat, ax_cpu, ax_rps = axes[-1]
        names = [r["router"] for r in measured_overhead]
        colors = [COLORS.get(n, "tab:gray") for n in names]
        xs = range(len(names))
        ax_lat.bar([x - 0.2 for x in xs], [r["added_p50_ms"] for r in measured_overhead], 0.4,
                   color=colors, alpha=0.5)  # fmt: skip
        ax_lat.bar([x + 0.2 for x in xs], [r["added_p99_ms"] for r in measured_overhead], 0.4,
                   color=colors)  # fmt: skip
        ax_lat.set_yscale("symlog", linthresh=1.0)
        ax_lat.set_title("overhead: added latency p50 (light) and p99 (ms)")
        ax_cpu.bar(list(xs), [r["cpu_ms_per_request"] for r in measured_overhead], color=colors)
        ax_cpu.set_title("router CPU per request (ms)")
        ax_rps.bar(list(xs), [r["rps_max"] for r in measured_overhead], color=colors)
        ax_rps.set_title("most requests per second (closed loop)")
        for ax in (ax_lat, ax_cpu, ax_rps):
            ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # format: a PNG at ``path`` whatever its name (without it, matplotlib
        # writes NAME.png for a name with no extension, another file than named).
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _md_ms(value: float | None) -> str:
    if value is None:
        return NOT_MEASURED
    return f"{value / 1e3:.2f} s" if value >= 10_000 else f"{value:,.0f} ms"


def markdown(doc: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The results as Markdown tables (one per scenario, then the overhead)."""
    items = doc if isinstance(doc, list) else [doc]
    lines: list[str] = []
    for rep in items:
        if rep["scenario"] == "overhead":
            lines += [
                f"Overhead over a direct call ({rep['workers']} instant engines, "
                f"{rep['rate_rps']:g} req/s open loop, 8 KB prompts):",
                "",
                "| router | added p50 | added p99 | most req/s | router CPU/req | engine CPU/req |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for r in rep["results"]:
                if "added_p50_ms" not in r:
                    lines.append(
                        f"| {r['router']} | {r.get('skipped') or r.get('error')} | | | | |"
                    )
                    continue
                lines.append(
                    f"| {r['router']} | {r['added_p50_ms']:.2f} ms | {r['added_p99_ms']:.2f} ms | "
                    f"{r['rps_max']:,.0f} | {r['cpu_ms_per_request']:.3f} ms | "
                    f"{r['engine_cpu_ms_per_request']:.3f} ms |"
                )
            lines.append("")
            continue
        lines += [
            f"`{rep['scenario']}`: {rep['requests']} requests at {rep['rate_rps']:g} req/s on "
            f"{rep['workers']} engines, load {rep['load']:.2f}, engine time scale "
            f"{rep['time_scale']:.3g}, KV {rep['kv_blocks'] or 'profile'} blocks per engine.",
            "",
        ]
        replicated = any("replicas" in r for r in rep["results"])
        extra = (
            " lag p50 | lag p99 | CPU/req per replica | sync CPU/req (all) |" if replicated else ""
        )
        lines += [
            "| router | ok | TTFT mean | p50 | p90 | p99 | e2e p50 | e2e p99 | req/s | cached "
            "| requests per engine |" + extra,
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
            + (" ---: | ---: | ---: | ---: |" if replicated else ""),
        ]
        for r in rep["results"]:
            if "requests" not in r:
                why = r.get("skipped") or r.get("error")
                lines.append(f"| {_label(r)} | {why} | | | | | | | | | |")
                continue
            t, e = r["ttft_ms"], r["e2e_ms"]
            ours = r["router"].startswith("prefix_aware")
            name = f"**{_label(r)}**" if ours else _label(r)
            lines.append(
                f"| {name} | {r['ok']}/{r['requests']} | {_md_ms(_stat(t, 'mean'))} | "
                f"{_md_ms(_stat(t, 'p50'))} | {_md_ms(_stat(t, 'p90'))} | "
                f"{_md_ms(_stat(t, 'p99'))} | {_md_ms(_stat(e, 'p50'))} | "
                f"{_md_ms(_stat(e, 'p99'))} | {r['throughput_rps']:.2f} | "
                f"{_pct(r['cached_token_share'])} | {_engines(r['per_worker_requests'])} |"
                + ("".join(f" {c} |" for c in _replica_cells(r)) if replicated else "")
            )
        lines.append("")
        notes = result_notes(rep)
        if notes:
            lines += [f"- {n}" for n in notes] + [""]
        if "rounds" in rep:
            lines += [
                "| " + " | ".join(ROUNDS_COLUMNS) + " |",
                "| --- | ---: | ---: | ---: | ---: | --- |",
                *("| " + " | ".join(cells) + " |" for cells in _spread_rows(rep, _md_ms)),
                "",
            ]
        if "oracle" in _names(rep):
            lines += [f"- {describe(r)}" for r in rep.get("ratios") or []] + [""]
    return "\n".join(lines)
