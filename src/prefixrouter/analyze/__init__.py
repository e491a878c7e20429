"""Offline analysis of request logs: which prefixes repeat, and how much prefill they cost.

:func:`analyze_log` streams a JSON-lines log (request bodies or gateway
decision records, see :mod:`.reader`) through the bounded-memory structures of
:mod:`.prefixes` and returns the report of :mod:`.report`: reusable prefill
(unlimited and under an LRU of the given KV capacity), the top repeated
prefixes, where near-identical requests diverge, the same by prefix class, and
a verdict on whether prefix-aware routing pays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixrouter.analyze.prefixes import (
    Analysis,
    AnalyzeParams,
    ClassStats,
    Divergence,
    DivergenceDetector,
    Encoder,
    PrefixAnalyzer,
    PrefixCounter,
    SampledReuse,
    TopPrefix,
    analyze_records,
    load_encoder,
)
from prefixrouter.analyze.reader import LogRecord, format_error, iter_records, parse_record
from prefixrouter.analyze.report import PAYS_SHARE, build_report, plot_report, verdict

__all__ = [
    "PAYS_SHARE",
    "Analysis",
    "AnalyzeParams",
    "ClassStats",
    "Divergence",
    "DivergenceDetector",
    "Encoder",
    "LogRecord",
    "PrefixAnalyzer",
    "PrefixCounter",
    "SampledReuse",
    "TopPrefix",
    "analyze_log",
    "analyze_records",
    "build_report",
    "format_error",
    "iter_records",
    "load_encoder",
    "parse_record",
    "plot_report",
    "verdict",
]


def analyze_log(
    path: Path,
    params: AnalyzeParams | None = None,
    encoder: Encoder | None = None,
    on_error: Callable[[int, str], None] | None = None,
) -> tuple[dict[str, Any], Analysis]:
    """Analyze one log file in a single streaming pass.

    Args:
        path: JSON lines (``.gz`` accepted).
        params: Parameters and memory bounds.
        encoder: A tokenizer (token mode), or None (text mode, estimated tokens).
        on_error: Called with (line, reason) for each malformed line skipped.

    Returns:
        (the JSON-ready report, the raw analysis).

    Raises:
        OSError: The file cannot be read.
    """
    bad = 0

    def count(line: int, reason: str) -> None:
        nonlocal bad
        bad += 1
        if on_error is not None:
            on_error(line, reason)

    analysis = analyze_records(iter_records(path, count), params, encoder)
    return build_report(analysis, log=str(path), malformed_lines=bad), analysis
