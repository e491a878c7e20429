"""Our router's mean TTFT against the oracle's and the best peer's, from one run's figures.

Issue 15's cache-pressure goal, in two ratios per run of our ``prefix_aware``
router (every mode that ran, text and token):

* ``vs_oracle`` = its mean TTFT / the oracle's (goal: at most 1.3);
* ``vs_best_peer`` = its mean TTFT / the lowest mean of sglang-router's and
  vllm-router's routers that ran (goal: at most 0.5).

Input is the routers' summaries (:meth:`prefixrouter.bench.live.RouterRun.summary`
dicts); skipped or failed routers count as absent. A ratio with nothing to
compare against is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ORACLE = "oracle"
PEER_PREFIXES = ("sglang-", "vllm-")
OURS = "prefix_aware"
GOAL_VS_ORACLE = 1.3
GOAL_VS_PEER = 0.5


def _mean(r: dict[str, Any]) -> float | None:
    t = r.get("ttft_ms")
    return float(t["mean"]) if t and r.get("ok") else None


def ttft_ratios(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run of ours: ``router``, ``vs_oracle``, ``vs_best_peer``, ``best_peer``."""
    oracle = next((_mean(r) for r in results if r["router"] == ORACLE), None)
    peers = [
        (m, r["router"])
        for r in results
        if r["router"].startswith(PEER_PREFIXES) and (m := _mean(r)) is not None
    ]
    best = min(peers) if peers else None
    out = []
    for r in results:
        mean = _mean(r)
        if not r["router"].startswith(OURS) or mean is None:
            continue
        out.append(
            {
                "router": r["router"],
                "vs_oracle": mean / oracle if oracle else None,
                "vs_best_peer": mean / best[0] if best and best[0] > 0 else None,
                "best_peer": best[1] if best else None,
            }
        )
    return out


def describe(row: dict[str, Any]) -> str:
    """``prefix_aware: 1.12x the oracle (goal <= 1.3: met), 0.41x sglang-... (<= 0.5: met)``."""
    parts = []
    if row["vs_oracle"] is not None:
        ok = "met" if row["vs_oracle"] <= GOAL_VS_ORACLE else "missed"
        parts.append(f"{row['vs_oracle']:.2f}x the oracle (goal <= {GOAL_VS_ORACLE}: {ok})")
    if row["vs_best_peer"] is not None:
        ok = "met" if row["vs_best_peer"] <= GOAL_VS_PEER else "missed"
        parts.append(
            f"{row['vs_best_peer']:.2f}x the best peer, {row['best_peer']} "
            f"(goal <= {GOAL_VS_PEER}: {ok})"
        )
    return f"{row['router']} mean TTFT: " + ("; ".join(parts) or "nothing to compare with")
