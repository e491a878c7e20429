"""Plots of a simulation report: TTFT distributions and prefill saved, per policy.

Left: the empirical CDF of time to first token per policy (log time axis), so
both the body and the tail are visible. Right: prefill tokens per policy
against the lower bound (the bound no router can beat), as horizontal bars.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixrouter.sim.cluster import SimRun


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
    prefill = [r["prefill_tokens"] / 1e6 for r in results]
    colors = ["black" if n == "prefix_aware" else "tab:blue" for n in names]
    ax_bar.barh(names, prefill, color=colors)
    bound = report["lower_bound_prefill_tokens"] / 1e6
    ax_bar.axvline(bound, color="tab:red", linestyle="--", label=f"lower bound {bound:.2f} M")
    ax_bar.set_xlabel("prefill tokens (millions; lower is better)")
    ax_bar.set_title("Prefill computed")
    ax_bar.invert_yaxis()
    ax_bar.legend(fontsize=8)
    load = report.get("load")
    where = f"load {load:.2f}" if load is not None else "trace times"
    fig.suptitle(f"{report['scenario']}: {report['workers']} workers, {where}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
