"""Clients that send ``max_tokens`` as a cap: prefix_aware's TTFT against clients that send
each answer's length, every scenario at loads 0.6 and 0.9, both modes, seeds 0-3.

Usage::

    python benchmarks/client_cap.py [--cap 2048] [--seeds 0,1,2,3]
        [--before results/client_cap_2048_before.json] [--tables-only]

Runs ``benchmarks/policy_diff.py --json`` twice with this tree (clients send
each answer's exact length, as every other benchmark here; then ``--cap``,
answers still ending at their own length), keeps both JSONs in
``results/client_cap_exact.json`` and ``results/client_cap_<cap>.json``, and
writes ``results/client_cap.md`` (a table per mode) and
``results/client_cap.png``. ``--before`` adds a column measured once on code
without the expected-output estimate (``prefixrouter.core.output``): commit
93fef10 with the simulator's clients patched to send the cap (that code had
no option for it). About 7 minutes on two cores. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
Cell = tuple[str, float, str]


def run(cap: int, seeds: str) -> list[dict[str, Any]]:
    """``policy_diff.py --json`` with this tree, clients sending ``cap`` (0: exact)."""
    argv = [sys.executable, str(HERE / "policy_diff.py"), "--json", "--seeds", seeds,
            "--kv-cells", "", "--client-max-tokens", str(cap)]  # fmt: skip
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=os.environ)
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def cells(rows: list[dict[str, Any]]) -> dict[Cell, dict[str, float]]:
    """Per (scenario, load, mode) at the scenario's default KV: mean, p99, prefill."""
    return {(r["scenario"], r["load"], r["mode"]): r["figures"] for r in rows if r["kv"] is None}


def _pct(after: float, before: float) -> str:
    return f"{100.0 * (after / before - 1.0):+.0f}%" if before else "n/a"


def table(
    exact: dict[Cell, dict[str, float]],
    capped: dict[Cell, dict[str, float]],
    before: dict[Cell, dict[str, float]] | None,
    mode: str,
    cap: int,
) -> str:
    """One mode's markdown table: mean and p99 per cell, exact clients against the cap."""
    head = ["scenario", "load"]
    for figure in ("mean", "p99"):
        head += [f"{figure}, exact", *([f"{figure}, cap {cap}, before"] if before else [])]
        head.append(f"{figure}, cap {cap}")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for cell in sorted(c for c in exact if c[2] == mode and c in capped):
        row = [cell[0], f"{cell[1]:g}"]
        for figure in ("mean", "p99"):
            base = exact[cell][figure]
            row.append(f"{base:,.0f} ms")
            columns = ([before.get(cell)] if before else []) + [capped[cell]]
            for figures in columns:
                value = figures[figure] if figures else None
                row.append(f"{value:,.0f} ({_pct(value, base)})" if value is not None else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(
    exact: dict[Cell, dict[str, float]],
    capped: dict[Cell, dict[str, float]],
    before: dict[Cell, dict[str, float]] | None,
    path: Path,
    cap: int,
) -> None:
    """Mean TTFT with the cap over mean TTFT with exact clients, per cell (text mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(c for c in exact if c[2] == "text" and c in capped)
    labels = [f"{s} {load:g}" for s, load, _ in keys]
    now = [capped[k]["mean"] / exact[k]["mean"] for k in keys]
    fig, ax = plt.subplots(figsize=(11, 5))
    xs = range(len(keys))
    width = 0.4
    if before:
        old = [before[k]["mean"] / exact[k]["mean"] if k in before else 0.0 for k in keys]
        ax.bar([x - width / 2 for x in xs], old, width, label="without the estimate (93fef10)")
    ax.bar([x + width / 2 for x in xs], now, width, label="learned expected output")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(f"mean TTFT, max_tokens {cap} / exact")
    ax.set_title(f"prefix_aware, text mode, seeds 0-3: clients that send max_tokens {cap}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap", type=int, default=2048)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--before", type=Path, default=HERE / "results/client_cap_2048_before.json")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tables-only", action="store_true",
                    help="read the two JSONs already in --out instead of simulating")  # fmt: skip
    args = ap.parse_args()
    if args.cap < 1:
        ap.error("--cap: must be at least 1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    exact_path, capped_path = out / "client_cap_exact.json", out / f"client_cap_{args.cap}.json"
    if args.tables_only:
        exact_rows = json.loads(exact_path.read_text())
        capped_rows = json.loads(capped_path.read_text())
    else:
        exact_rows, capped_rows = run(0, args.seeds), run(args.cap, args.seeds)
        exact_path.write_text(json.dumps(exact_rows))
        capped_path.write_text(json.dumps(capped_rows))
    before = cells(json.loads(args.before.read_text())) if args.before.exists() else None
    exact, capped = cells(exact_rows), cells(capped_rows)
    md = [f"Seeds {args.seeds}; clients send each answer's length (exact) or a cap of "
          f"{args.cap} (answers end at their own length)."]  # fmt: skip
    for mode in ("text", "token"):
        md += ["", f"{mode} mode:", "", table(exact, capped, before, mode, args.cap)]
    (out / "client_cap.md").write_text("\n".join(md) + "\n")
    plot(exact, capped, before, out / "client_cap.png", args.cap)
    print("\n".join(md))


if __name__ == "__main__":
    main()
