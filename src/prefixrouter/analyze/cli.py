"""``prefixrouter analyze LOG.jsonl``: which prefixes repeat and what caching them saves.

Prints a summary, the per-class breakdown, the top repeated prefixes, where
near-identical requests diverge and the verdict; optionally writes the JSON
report and a PNG. Malformed lines are reported on stderr as ``FILE:LINE:
reason`` (the first :data:`MAX_ERRORS_SHOWN`, then a count) and skipped. Errors
the user can fix (no such file, a damaged ``.gz``, not a tokenizer, an output
path that cannot be written or that is the log or the other output, a log
with no usable line) print one line and exit 2; the output paths are checked
before the log is read. A gzip log is known by its content, whatever its name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import orjson
import typer
from rich.console import Console

from prefixrouter.analyze import AnalyzeParams, analyze_log, format_error, load_encoder
from prefixrouter.analyze.reader import SkippedLines
from prefixrouter.analyze.report import plot_report, report_tables
from prefixrouter.errors import check_outputs, unreadable, unwritable
from prefixrouter.terminal import fail

MAX_ERRORS_SHOWN = 20

_out = Console(width=None if sys.stdout.isatty() else 170)
_err = Console(stderr=True, highlight=False)


def analyze(
    log: Annotated[
        Path, typer.Argument(help="JSON lines of request bodies or decision-log records (gzip ok).")
    ],
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="tokenizer.json (or its folder): count real tokens, not estimates."),
    ] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Engine block size in tokens.")] = 16,
    kv_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="KV cache capacity in tokens, for the LRU estimate; 0: no limit (no LRU "
            "estimate; the verdict uses the unlimited cache).",
        ),
    ] = 500_000,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the analysis here.")] = None,
) -> None:
    """Analyze a request log: repeated prefixes, reusable prefill, hidden volatile fields."""
    if not log.is_file():
        raise fail(f"{log}: {'is a directory' if log.is_dir() else 'no such file'}")
    outputs = (("--json", json_out, None), ("--plot", plot, ".png"))
    if (why := check_outputs(outputs, {"the log it reads": log})) is not None:
        raise fail(why)
    try:
        encoder = load_encoder(tokenizer) if tokenizer is not None else None
    except (OSError, ValueError) as exc:
        raise fail(f"--tokenizer: {exc}") from None
    skipped = SkippedLines()

    def on_error(line: int, reason: str) -> None:
        skipped(line, reason)
        if skipped.count <= MAX_ERRORS_SHOWN:
            _err.print(format_error(log, line, reason), markup=False, soft_wrap=True)

    try:
        report, analysis = analyze_log(
            log, AnalyzeParams(block_size=block_size, kv_tokens=kv_tokens), encoder, on_error
        )
    except OSError as exc:  # gzip.BadGzipFile too: a truncated or damaged .gz
        raise fail(unreadable(log, exc)) from None
    if skipped.count > MAX_ERRORS_SHOWN:
        _err.print(
            f"{log}: {skipped.count - MAX_ERRORS_SHOWN:,} more malformed lines skipped",
            soft_wrap=True,
        )
    if not report["requests"] and report["unserved_requests"]:
        raise fail(
            f"{log}: no served request in it: its {report['unserved_requests']:,} records all "
            "have an error status (no engine served them)"
        )
    if not report["requests"]:
        raise fail(
            f"{log}: {skipped.none_usable('request')} (expected JSON lines of request bodies "
            "or of the gateway's --decision-log records)"
        )
    for table in report_tables(report):
        _out.print(table)
    _out.print(f"[bold]verdict:[/] {report['verdict']}", highlight=False)
    if json_out is not None:
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as exc:  # checked before the run; a full disk still shows here
            raise fail(f"--json {unwritable(json_out, exc)}") from None
        _out.print(f"wrote {json_out}", highlight=False)
    if plot is not None:
        hist = {b * block_size: n for b, n in analysis.shared_prefix_hist.items()}
        try:
            plot_report(report, hist, plot)
        except OSError as exc:
            raise fail(f"--plot {unwritable(plot, exc)}") from None
        _out.print(f"wrote {plot}", highlight=False)
