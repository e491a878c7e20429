"""Plots of a simulation report: TTFT distributions and prefill saved, per policy.

Left: the empirical CDF of time to first token per policy (log time axis), so
both the body and the tail are visible. Right: prefill tokens per policy
against the lower bound (the bound no router can beat), as horizontal bars.
A router-replica sweep has its own figure (:func:`plot_replica_sweep`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixrouter.sim.cluster import SimRun
from prefixrouter.sim.report import arrival_text, total_prefill_tokens


def plot_report(report: dict[str, Any], runs: Sequence[SimRun], path: Path) -> None:
    """Write a two-panel PNG for one scenario run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_bar) = plt.subplots(1, 2, figsize=(13, 5.2))
    # Twelve policies: tab20's pairs, every other shade, then dashed lines, so
    # no two curves look alike.
    palette = [plt.get_cmap("tab20")(i) for i in range(20)]
    for k, run in enumerate(runs):
        ttft = sorted(r.ttft_s * 1e3 for r in run.records if r.first_token >= 0)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        style: dict[str, object] = (
            {"linewidth": 2.6, "color": "black"}
            if run.policy == "prefix_aware"
            else {
                "color": palette[(2 * k) % 20 + (k // 10) % 2],
                "linestyle": "-" if k < 10 else "--",
            }
        )
        ax_cdf.step([max(t, 1e-3) for t in ttft], ys, where="post", label=run.policy, **style)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("time to first token (ms, log)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.set_title("TTFT distribution")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8, loc="lower right")

    results = report["results"]
    names = [r["policy"] for r in results]
    prefill = [total_prefill_tokens(r) / 1e6 for r in results]  # the router's own copies too
    colors = ["black" if n == "prefix_aware" else "tab:blue" for n in names]
    ax_bar.barh(names, prefill, color=colors)
    bound = report["lower_bound_prefill_tokens"] / 1e6
    ax_bar.axvline(bound, color="tab:red", linestyle="--", label=f"lower bound {bound:.2f} M")
    ax_bar.set_xlabel("prefill tokens (millions; lower is better)")
    ax_bar.set_title("Prefill computed")
    ax_bar.invert_yaxis()
    ax_bar.legend(fontsize=8)
    fig.suptitle(f"{report['scenario']}: {report['workers']} workers, {arrival_text(report)}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_replica_sweep(rows: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """Write a two-panel PNG of a router-replica sweep on one scenario.

    ``rows``: one per run, with ``routers``, ``sync``, ``lag_ms``,
    ``cached_share`` and ``ttft_ms`` (``mean``). Left: cached share against
    the number of router replicas; right: mean TTFT (log axis). One line per
    sync lag with sync on (darker: longer lag), one dashed red line without
    sync (it has no lag); every line starts at the one-router run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = [r for r in rows if r["routers"] == 1]
    lags = sorted({r["lag_ms"] for r in rows if r["routers"] > 1 and r["sync"]})
    lines: list[tuple[str, dict[str, object], list[dict[str, Any]]]] = []
    cmap = plt.get_cmap("viridis")
    for k, lag in enumerate(lags):
        runs = [r for r in rows if r["routers"] > 1 and r["sync"] and r["lag_ms"] == lag]
        color = cmap(0.85 * (1 - k / max(1, len(lags) - 1)))
        lines.append((f"sync, {lag:g} ms lag", {"color": color, "marker": "o"}, one + runs))
    off = [r for r in rows if r["routers"] > 1 and not r["sync"]]
    if off:
        style = {"color": "tab:red", "linestyle": "--", "marker": "x", "linewidth": 2.0}
        lines.append(("no sync", style, one + off))

    fig, (ax_share, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5.2))
    for label, style, runs in lines:
        runs = sorted(runs, key=lambda r: r["routers"])
        xs = [r["routers"] for r in runs]
        ax_share.plot(xs, [100 * r["cached_share"] for r in runs], label=label, **style)
        ax_ttft.plot(xs, [r["ttft_ms"]["mean"] for r in runs], label=label, **style)
    for ax in (ax_share, ax_ttft):
        ax.set_xscale("log", base=2)
        ticks = sorted({r["routers"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("router replicas (arrivals round robin)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_share.set_ylabel("cached share of prompt tokens (%)")
    ax_share.set_title("Cached share")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("mean time to first token (ms, log)")
    ax_ttft.set_title("Mean TTFT")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
