"""``prefixrouter analyze LOG.jsonl``: which prefixes repeat and what caching them saves.

Prints a summary, the per-class breakdown, the top repeated prefixes, where
near-identical requests diverge and the verdict; optionally writes the JSON
report and a PNG. Malformed lines are reported on stderr as ``FILE:LINE:
reason`` (the first :data:`MAX_ERRORS_SHOWN`, then a count) and skipped. Errors
the user can fix (no such file, not a tokenizer) print one line and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import orjson
import typer
from rich.console import Console
from rich.text import Text

from prefixrouter.analyze import AnalyzeParams, analyze_log, format_error, load_encoder
from prefixrouter.analyze.report import plot_report, report_tables

MAX_ERRORS_SHOWN = 20

_out = Console(width=None if sys.stdout.isatty() else 170)
_err = Console(stderr=True, highlight=False)


def _fail(message: str) -> typer.Exit:
    # Same shape as prefixrouter.cli.fail; kept local so this module never imports the CLI root.
    _err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    return typer.Exit(code=2)


def analyze(
    log: Annotated[
        Path, typer.Argument(help="JSON lines of request bodies or decision-log records (.gz ok).")
    ],
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="tokenizer.json (or its folder): count real tokens, not estimates."),
    ] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Engine block size in tokens.")] = 16,
    kv_tokens: Annotated[
        int, typer.Option(min=0, help="KV cache capacity in tokens, for the LRU estimate.")
    ] = 500_000,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the analysis here.")] = None,
) -> None:
    """Analyze a request log: repeated prefixes, reusable prefill, hidden volatile fields."""
    if not log.is_file():
        raise _fail(f"{log}: no such file")
    try:
        encoder = load_encoder(tokenizer) if tokenizer is not None else None
    except (OSError, ValueError) as exc:
        raise _fail(f"--tokenizer: {exc}") from None
    shown = 0

    def on_error(line: int, reason: str) -> None:
        nonlocal shown
        shown += 1
        if shown <= MAX_ERRORS_SHOWN:
            _err.print(format_error(log, line, reason), markup=False, soft_wrap=True)

    try:
        report, analysis = analyze_log(
            log, AnalyzeParams(block_size=block_size, kv_tokens=kv_tokens), encoder, on_error
        )
    except OSError as exc:
        raise _fail(f"{log}: {exc}") from None
    if shown > MAX_ERRORS_SHOWN:
        _err.print(
            f"{log}: {shown - MAX_ERRORS_SHOWN:,} more malformed lines skipped", soft_wrap=True
        )
    for table in report_tables(report):
        _out.print(table)
    _out.print(f"[bold]verdict:[/] {report['verdict']}", highlight=False)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        _out.print(f"wrote {json_out}", highlight=False)
    if plot is not None:
        hist = {b * block_size: n for b, n in analysis.shared_prefix_hist.items()}
        plot_report(report, hist, plot)
        _out.print(f"wrote {plot}", highlight=False)
