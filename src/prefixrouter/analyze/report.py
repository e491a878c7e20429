"""The analysis report: JSON record, verdict, tables and an optional plot.

The verdict answers two questions from the measured shares:

* **Does prefix-aware routing pay?** Yes when the prefill an LRU cache of the
  given KV capacity would save is at least :data:`PAYS_SHARE` (10%) of all
  prompt tokens (with ``kv_tokens=0``, no limit: the unlimited share decides,
  and the report's LRU figures are None). When the unlimited share clears the
  bar but the LRU share does not, the hot prefixes do not fit one cache: the
  verdict says so (prefix affinity spreads them over the replicas' caches, but
  the fleet must hold them).
* **Records with a prefix key only** (a gateway decision log) show reuse up
  to the key's depth (``prefix_key_tokens``): the shares are lower bounds
  while a prompt is longer (``key_only_unseen_tokens``). A lower bound that
  clears the bar still decides; one that does not never concludes "does not
  pay": the engines' own cached share (``actual_cached_tokens``) decides if
  the records carry it and it clears the bar, else the verdict says the log
  cannot tell (``pays`` None) and gives the range.
* **Where to roll it out first?** On the prefix class with the most reusable
  tokens under the KV limit (system template, document, session, RAG).

Near-identical requests that diverge early (a hidden timestamp or trace id)
are named in the verdict: fixing them comes before any routing change.

Without a tokenizer (text mode) every token count is an estimate at
``chars_per_token`` characters per token (``tokens_estimated`` in the JSON):
the tables write such counts ``~N`` and say how they were estimated, and the
verdict says so, since text with another ratio (code, non-English, syllable
text) can be off by half or more. Records no engine served (their status,
:attr:`~prefixrouter.analyze.reader.LogRecord.served`) are counted apart as
``unserved_requests`` and left out of every other figure.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from rich.table import Table

from prefixrouter.analyze.prefixes import Analysis
from prefixrouter.stats import counted_percentile

PAYS_SHARE = 0.10
"""Share of prompt tokens a cache must save for prefix-aware routing to pay."""


def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def build_report(analysis: Analysis, *, log: str = "", malformed_lines: int = 0) -> dict[str, Any]:
    """The JSON-ready report of one analysis, verdict included.

    Args:
        analysis: What :class:`~prefixrouter.analyze.prefixes.PrefixAnalyzer` measured.
        log: The log's path, echoed.
        malformed_lines: Lines skipped as malformed.
    """
    a, p = analysis, analysis.params
    bs = p.block_size
    hist_tokens = {blocks * bs: n for blocks, n in a.shared_prefix_hist.items()}
    total = sum(hist_tokens.values())
    lru = p.kv_tokens > 0  # 0: no KV limit, so no LRU estimate (None in the report)
    by_class = {
        name: {
            "requests": s.requests,
            "prompt_tokens": s.prompt_tokens,
            "reusable_tokens_unlimited": round(s.reusable_unlimited),
            "reusable_share_unlimited": _share(s.reusable_unlimited, s.prompt_tokens),
            "reusable_tokens_kv": round(s.reusable_kv) if lru else None,
            "reusable_share_kv": _share(s.reusable_kv, s.prompt_tokens) if lru else None,
        }
        for name, s in a.by_class.items()
    }
    report: dict[str, Any] = {
        "log": log,
        "mode": a.mode,
        "block_size": bs,
        "kv_tokens": p.kv_tokens,
        # Text mode counts characters: every token figure is an estimate.
        "tokens_estimated": a.mode == "text",
        "chars_per_token": p.chars_per_token,
        "requests": a.requests,
        "unserved_requests": a.unserved_requests,
        "malformed_lines": malformed_lines,
        "key_only_requests": a.key_only_requests,
        "prefix_key_tokens": p.prefix_key_tokens,
        "key_only_unseen_tokens": a.key_only_unseen_tokens,
        "prompt_tokens": a.prompt_tokens,
        "reusable_tokens_unlimited": round(a.reusable_unlimited),
        "reusable_share_unlimited": _share(a.reusable_unlimited, a.prompt_tokens),
        # The most that can repeat: the lower bound plus every unseen token.
        "reusable_share_unlimited_max": _share(
            a.reusable_unlimited + a.key_only_unseen_tokens, a.prompt_tokens
        ),
        "reusable_tokens_kv": round(a.reusable_kv) if lru else None,
        "reusable_share_kv": _share(a.reusable_kv, a.prompt_tokens) if lru else None,
        "shared_prefix_tokens": {
            "mean": round(sum(t * n for t, n in hist_tokens.items()) / total, 1) if total else 0.0,
            # The histogram counts every exact length, so these are the
            # project's nearest-rank percentiles of the raw values.
            "p50": counted_percentile(hist_tokens, 0.5),
            "p90": counted_percentile(hist_tokens, 0.9),
            "p99": counted_percentile(hist_tokens, 0.99),
            "max": max(hist_tokens, default=0),
            "requests_sharing": sum(n for t, n in hist_tokens.items() if t > 0),
        },
        "top_prefixes": [
            {
                "tokens": t.tokens,
                "count": t.count,
                "saved_tokens": (t.count - 1) * t.tokens,
                "text_start": t.text_start,
                "text_end": t.text_end,
            }
            for t in a.top_prefixes
        ],
        "divergences": [
            {
                "token_position": d.token_position,
                "text": d.text,
                "requests": d.requests,
                "stable_tokens_after": d.stable_tokens_after,
            }
            for d in a.divergences
        ],
        "by_class": by_class,
        "observed_cached_share": (
            _share(a.observed_cached_tokens, a.observed_prompt_tokens)
            if a.observed_prompt_tokens
            else None
        ),
        "sampling_rate": a.sampling_rate,
        "count_error_bound": a.count_error_bound,
        "memory": dict(a.memory),
    }
    text, pays, first = verdict(report)
    report.update(verdict=text, pays=pays, first_class=first)
    return report


def estimate_note(report: dict[str, Any]) -> str:
    """How text mode's token counts were made, for a label (empty when they are exact)."""
    if not report.get("tokens_estimated"):
        return ""
    return f"estimated at {report['chars_per_token']:g} chars/token; --tokenizer for exact"


def _tokens(report: dict[str, Any], n: int) -> str:
    """A token count as the tables write it: ``~N`` when estimated (module doc)."""
    return f"~{n:,}" if report.get("tokens_estimated") else f"{n:,}"


def verdict(report: dict[str, Any]) -> tuple[str, bool | None, str | None]:
    """(verdict sentence, whether prefix-aware routing pays, class to roll out first).

    ``pays`` is None when the log cannot tell: its records carry only prefix
    keys, the reuse they show is below the bar, and no engine count clears it.
    """
    if not report["requests"]:
        return "No requests to analyze.", False, None
    su, sk, kv = (
        report["reusable_share_unlimited"],
        report["reusable_share_kv"],
        report["kv_tokens"],
    )
    key = "reusable_tokens_kv" if kv else "reusable_tokens_unlimited"
    decisive = sk if kv else su
    classes = report["by_class"]

    def best(field: str) -> str | None:
        top = max(classes, key=lambda c: (classes[c][field], c)) if classes else None
        return top if top is not None and classes[top][field] > 0 else None

    first = best(key)
    # Prefix-key records show reuse only up to the key's depth: lower bounds.
    unseen = report.get("key_only_unseen_tokens", 0)
    least = "at least " if unseen else ""
    keys_text = (
        f"the log's records carry only prefix keys, which name each prompt's first "
        f"{report.get('prefix_key_tokens', 0):,} tokens"
    )
    observed = report["observed_cached_share"]
    est = "~" if report.get("tokens_estimated") else ""
    kv_text = (
        f"{least}{sk:.0%} fit a {kv:,}-token KV cache under LRU" if kv else "no KV limit given"
    )
    pays: bool | None
    if decisive >= PAYS_SHARE and first is not None:
        c = classes[first]
        share = c["reusable_share_kv" if kv else "reusable_share_unlimited"]
        text = (
            f"Prefix-aware routing pays for this traffic: {least}{su:.0%} of prompt tokens "
            f"repeat an earlier prefix ({kv_text}). Roll it out first on {first} traffic: "
            f"{least}{share:.0%} of its prompt tokens are reusable ({est}{c[key]:,} tokens)."
        )
        if kv and sk < su / 2:
            text += (
                " The hot prefixes do not fit one cache: prefix affinity spreads them over the "
                "replicas' caches."
            )
        pays = True
    elif unseen and observed is not None and observed >= PAYS_SHARE:
        # The lower bound says little; the engines counted what their caches served.
        text = (
            f"Prefix-aware routing pays for this traffic: the engines report {observed:.0%} of "
            f"prompt tokens served from their cache. {keys_text[0].upper()}{keys_text[1:]}, "
            f"so they show only a lower bound: at least {su:.1%} of prompt tokens repeat an "
            f"earlier prefix ({kv_text})."
        )
        if first is not None:
            text += f" By the keys, {first} traffic repeats the most: roll it out there first."
        pays = True
    elif su >= PAYS_SHARE and (first := best("reusable_tokens_unlimited")) is not None:
        text = (
            f"Prefix-aware routing pays only if the fleet's KV holds the hot prefixes: "
            f"{least}{su:.0%} of prompt tokens repeat, but {kv_text}. Give them room (prefix "
            f"affinity spreads them over the replicas), then roll out on {first} traffic first."
        )
        pays = False
    elif unseen:
        text = (
            f"This log cannot tell whether prefix-aware routing pays: {keys_text}. By them at "
            f"least {su:.1%} of prompt tokens repeat an earlier prefix, and up to "
            f"{report['reusable_share_unlimited_max']:.1%} may. Analyze a log of request "
            f"bodies, or decision records with the engines' cached tokens, to decide."
        )
        pays, first = None, None
    else:
        text = (
            f"Prefix-aware routing does not pay for this traffic: only {su:.1%} of prompt tokens "
            f"repeat an earlier prefix ({kv_text}); keep load-based routing (least loaded)."
        )
        pays, first = False, None
    if est:
        text += (
            f" Token counts are estimates at {report['chars_per_token']:g} characters per token "
            "(--tokenizer for exact counts): the amounts, and how much of the KV cache they "
            "fill, move with the text's real ratio."
        )
    if report.get("unserved_requests"):
        text += (
            f" {report['unserved_requests']:,} records no engine served (an error status) are "
            "left out."
        )
    hidden = [d for d in report["divergences"] if d["requests"] >= 2]
    if hidden:
        d = max(hidden, key=lambda d: d["requests"] * d["stable_tokens_after"])
        text += (
            f" {d['requests']:,} near-identical requests diverge at token {d['token_position']:,}"
            f" ({d['text']!r}) and agree again for {d['stable_tokens_after']:,} tokens: a volatile"
            " field hides that reuse; move it after the stable content first (prefixrouter lint)."
        )
    return text, pays, first


def report_tables(report: dict[str, Any]) -> list[Table]:
    """Rich tables: summary, classes, top prefixes, divergences."""
    summary = Table(title=f"prefix analysis · {report['log']}", title_justify="left")
    summary.add_column("measure")
    summary.add_column("value", justify="right")
    sp = report["shared_prefix_tokens"]
    unseen = report.get("key_only_unseen_tokens", 0)
    least = "at least " if unseen else ""  # prefix-key records: lower bounds (module doc)
    kv = report["kv_tokens"]
    note = estimate_note(report)

    def tokens(n: int) -> str:
        return _tokens(report, n)

    rows = [("requests", f"{report['requests']:,}")]
    if report.get("unserved_requests"):
        rows.append(
            (
                "records not served (error status), left out",
                f"{report['unserved_requests']:,}",
            )
        )
    rows += [
        ("malformed lines skipped", f"{report['malformed_lines']:,}"),
        ("mode / block size", f"{report['mode']} / {report['block_size']}"),
        (f"prompt tokens ({note})" if note else "prompt tokens", tokens(report["prompt_tokens"])),
        (
            "reusable, unlimited cache",
            f"{least}{tokens(report['reusable_tokens_unlimited'])} "
            f"({report['reusable_share_unlimited']:.1%})",
        ),
        (
            (
                f"reusable, LRU {kv:,} KV tokens",
                f"{least}{tokens(report['reusable_tokens_kv'])} "
                f"({report['reusable_share_kv']:.1%})",
            )
            if kv
            else ("reusable, LRU", "no KV limit (--kv-tokens 0)")
        ),
        (
            "shared prefix p50 / p90 / max",
            f"{tokens(sp['p50'])} / {tokens(sp['p90'])} / {tokens(sp['max'])}",
        ),
    ]
    if report["key_only_requests"]:
        rows.append(("records with a prefix key only", f"{report['key_only_requests']:,}"))
    if unseen:
        rows.append(
            (
                f"tokens beyond the keys' first {report['prefix_key_tokens']:,} (reuse unknown)",
                f"{unseen:,} ({unseen / report['prompt_tokens']:.1%})",
            )
        )
    if report["observed_cached_share"] is not None:
        rows.append(("engine-reported cached share", f"{report['observed_cached_share']:.1%}"))
    if report["sampling_rate"] < 1:
        rows.append(("hash sampling rate", f"{report['sampling_rate']:.4f}"))
    for name, value in rows:
        summary.add_row(name, value)

    classes = Table(title="by prefix class", title_justify="left")
    for col in ("class", "requests", "prompt tokens", "reusable", "reusable (LRU)"):
        classes.add_column(col, justify="left" if col == "class" else "right")
    for name, c in report["by_class"].items():
        classes.add_row(
            name,
            f"{c['requests']:,}",
            tokens(c["prompt_tokens"]),
            f"{c['reusable_share_unlimited']:.1%}",
            f"{c['reusable_share_kv']:.1%}" if c["reusable_share_kv"] is not None else "-",
        )

    top = Table(title="top repeated prefixes", title_justify="left")
    for col in ("tokens", "requests", "saved tokens", "starts with", "ends with"):
        top.add_column(
            col, justify="right" if col in ("tokens", "requests", "saved tokens") else "left"
        )
    for t in report["top_prefixes"]:
        top.add_row(
            tokens(t["tokens"]), f"{t['count']:,}", tokens(t["saved_tokens"]),
            t["text_start"][:50], t["text_end"][-40:],
        )  # fmt: skip

    div = Table(title="where near-identical requests diverge", title_justify="left")
    for col in ("token", "requests", "equal tokens after", "text"):
        div.add_column(col, justify="left" if col == "text" else "right")
    for d in report["divergences"]:
        div.add_row(
            tokens(d["token_position"]),
            f"{d['requests']:,}",
            tokens(d["stable_tokens_after"]),
            d["text"],
        )
    tables = [summary, classes]
    if report["top_prefixes"]:
        tables.append(top)
    if report["divergences"]:
        tables.append(div)
    return tables


def plot_report(report: dict[str, Any], hist: dict[int, int], path: Path) -> None:
    """A two-panel PNG: reusable share by class; distribution of shared prefix lengths.

    Args:
        report: From :func:`build_report`.
        hist: Shared prefix length in tokens -> requests.
        path: Where to write the PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cls, ax_cdf) = plt.subplots(1, 2, figsize=(12, 4.6))
    names = ["all", *report["by_class"]]
    unlimited = [report["reusable_share_unlimited"]] + [
        c["reusable_share_unlimited"] for c in report["by_class"].values()
    ]
    xs = range(len(names))
    if report["kv_tokens"]:
        kv = [report["reusable_share_kv"]] + [
            c["reusable_share_kv"] for c in report["by_class"].values()
        ]
        ax_cls.bar([x - 0.2 for x in xs], unlimited, width=0.4, label="unlimited cache")
        label = f"LRU, {report['kv_tokens']:,} tokens"
        ax_cls.bar([x + 0.2 for x in xs], kv, width=0.4, label=label)
    else:  # --kv-tokens 0: no limit, no LRU estimate
        ax_cls.bar(list(xs), unlimited, width=0.6, label="unlimited cache (no KV limit)")
    ax_cls.set_xticks(list(xs), names)
    ax_cls.set_ylim(0, 1)
    ax_cls.set_ylabel("share of prompt tokens reusable")
    ax_cls.set_title("prefill a cache would save")
    ax_cls.legend(fontsize=8)

    total = sum(hist.values())
    xs_cdf, ys_cdf, seen = [], [], 0
    for tokens, n in sorted(hist.items()):
        seen += n
        xs_cdf.append(max(tokens, 1))
        ys_cdf.append(seen / total if total else 0.0)
    ax_cdf.step(xs_cdf, ys_cdf, where="post")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("tokens shared with an earlier request (log; 0 shown at 1)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.set_title("common prefix length")
    ax_cdf.grid(True, which="both", alpha=0.3)
    fig.suptitle(textwrap.fill(report["verdict"].split(". ")[0] + ".", 150), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
