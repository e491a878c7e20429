"""Several rounds of one scenario: each router's spread and its ratio to the first, per round.

On a small shared machine one live run of a scenario moves its mean TTFT by
a third from run to run (``benchmarks/RESULTS.md``, "Replicas (live)": doc-qa
gave one gateway 797 to 1,512 ms in six runs), so one run each cannot tell
two routers 10 % apart. ``prefixrouter bench --rounds N`` runs every router
N times, interleaved (round 1 runs each router once in the given order, then
round 2, ...), on the same fleet with its caches reset before each run, and
this module reduces the rounds to what decides a comparison:

* per router, the mean, smallest and largest of its rounds' mean TTFT, p99
  TTFT and cached-token share (over the rounds it completed);
* per router, its **paired ratio**: in each round, its mean TTFT over the
  first router's (the first in ``--routers`` that completed that round),
  then the mean, smallest and largest of those ratios. Runs next to each
  other in time share the machine's state, so the ratio within a round
  moves less than either mean does; a router that is faster in every
  round has every ratio below 1.

Input is the routers' summaries (:meth:`prefixrouter.bench.live.RouterRun.summary`
dicts, each with its ``round``, from 1); a skipped or failed run counts as
absent from its round. Pure: no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def _completed(r: dict[str, Any]) -> bool:
    """A run that measured a TTFT (a failed, skipped or all-failed run did not)."""
    return r.get("ttft_ms") is not None and bool(r.get("ok"))


def _round(r: dict[str, Any]) -> int:
    return int(r.get("round", 1))


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _shares(runs: Sequence[dict[str, Any]]) -> list[float]:
    return [r["cached_token_share"] for r in runs if r.get("cached_token_share") is not None]


def round_label(router: str, number: int | None) -> str:
    """How tables and logs name one router's run: its name, and its round when there are several."""
    return router if number is None else f"{router} · round {number}"


def by_round(results: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The results grouped by round, rounds in order (one group without rounds)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(_round(r), []).append(r)
    return [groups[k] for k in sorted(groups)]


def rounds_summary(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per router, in the order they first appear (module doc).

    Each row: ``router``, ``rounds`` (how many it completed), ``ttft_mean_ms``,
    ``ttft_p99_ms`` and ``cached_share`` (each ``{"mean", "min", "max"}``, or
    None when it completed none; ``cached_share`` over the rounds whose
    engines could all be read), ``vs_first`` (``{"router", "mean", "min",
    "max", "rounds"}`` over the rounds both completed; None for the first
    router itself or with no round in common).
    """
    names = list(dict.fromkeys(r["router"] for r in results))
    # Each round's reference: its first router (in --routers order) that completed.
    reference: dict[int, dict[str, Any]] = {}
    for rows in by_round(results):
        done = [r for r in rows if _completed(r)]
        if done:
            reference[_round(done[0])] = min(done, key=lambda r: names.index(r["router"]))
    out = []
    for name in names:
        runs = [r for r in results if r["router"] == name and _completed(r)]
        ratios = []
        firsts = set()
        for r in runs:
            ref = reference.get(_round(r))
            if ref is None or ref["router"] == name or ref["ttft_ms"]["mean"] <= 0:
                continue
            ratios.append(r["ttft_ms"]["mean"] / ref["ttft_ms"]["mean"])
            firsts.add(ref["router"])
        vs_first = None
        if ratios:
            vs_first = {"router": " / ".join(sorted(firsts)), **_spread(ratios),
                        "rounds": len(ratios)}  # fmt: skip
        out.append(
            {
                "router": name,
                "rounds": len(runs),
                "ttft_mean_ms": _spread([r["ttft_ms"]["mean"] for r in runs]) if runs else None,
                "ttft_p99_ms": _spread([r["ttft_ms"]["p99"] for r in runs]) if runs else None,
                # Over the rounds whose engines could all be read (None: unread).
                "cached_share": _spread(shares) if (shares := _shares(runs)) else None,
                "vs_first": vs_first,
            }
        )
    return out
