"""``prefixrouter lint FILE``: volatile fields placed before long stable content.

``FILE`` is read as, in order: one JSON request body (or a log record
wrapping one), a JSON array of bodies, JSON lines of bodies (malformed lines
are reported as ``FILE:LINE: reason`` on stderr and skipped), or else a prompt
template (plain text). A file that does not parse as one JSON document is
JSON lines when it starts as JSON does (``{"``, ``{}``, or ``[`` and ``{``,
``[``, ``"`` or ``]``), else a template: one that opens with ``{{ now }}``,
``{% if %}`` or ``[System]`` is linted as a template. Findings print as a
table, or with ``--json`` as a JSON list of ``{"kind", "position", "text",
"stable_tokens_after", "fix", ...}``.

Exit status: 0 when there are at most ``--max-findings`` findings, 1 when
there are more, 2 when the file cannot be read or holds no request body to
lint (JSON that does not parse, or no line or item of it a body).

The linter is :mod:`prefixrouter.prompt.lint`'s; the command lives here, with
the log reader it reads files through (:mod:`.reader`), so that
:mod:`prefixrouter.prompt` never imports the analyzer that imports it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.table import Table

from prefixrouter.analyze.reader import SkippedLines, format_error, iter_records, parse_record
from prefixrouter.prompt.lint import DEFAULT_MIN_STABLE_TOKENS, Finding, Linter, LintParams
from prefixrouter.terminal import fail

_out = Console(width=None if sys.stdout.isatty() else 170)
_err = Console(stderr=True, highlight=False)


# How JSON text starts (module doc); template syntax ({{ x }}, {% if %}, {x}, [System]) does not.
_JSON_START = re.compile(r'\s*(?:\{\s*["}]|\[\s*[{\["\]])')


def lint_file(path: Path, linter: Linter) -> list[Finding]:
    """Lint a body, an array of bodies, JSON lines of bodies or a template.

    Raises:
        OSError: The file cannot be read.
        ValueError: It is JSON but holds no request body (the message names
            the line or item and why), or it is not UTF-8.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    head = text.lstrip()
    if not head.startswith(("{", "[")):
        return linter.lint_template(text)
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if not _JSON_START.match(text):
            return linter.lint_template(text)
        if head.startswith("["):
            raise ValueError(f"line {exc.lineno}: invalid JSON: {exc.msg}") from None
        return _lint_json_lines(path, linter)
    if isinstance(doc, dict):
        rec = parse_record(doc, 1)
        if isinstance(rec, str):
            raise ValueError(rec)
        return linter.lint_body(rec.body)
    # JSON text that starts with { or [ is an object or an array.
    skipped = SkippedLines()
    bodies: list[tuple[int, Mapping[str, Any]]] = []
    for i, item in enumerate(doc):
        rec = parse_record(item, i + 1)
        if isinstance(rec, str):
            _err.print(f"{path}: item {i}: {rec}", markup=False)
            skipped(i, rec)
        else:
            bodies.append((i + 1, rec.body))
    if not bodies:
        raise ValueError(skipped.none_usable("request body", "item"))
    return linter.lint_bodies(bodies)


def _lint_json_lines(path: Path, linter: Linter) -> list[Finding]:
    """Lint JSON lines of bodies; a file with no body on any line is an error.

    Raises:
        ValueError: No line holds a request body.
    """
    skipped = SkippedLines()

    def on_error(line: int, reason: str) -> None:
        skipped(line, reason)
        _err.print(format_error(path, line, reason), markup=False, soft_wrap=True)

    linted = 0

    def bodies() -> Iterator[tuple[int, Mapping[str, Any]]]:
        nonlocal linted
        for r in iter_records(path, on_error):
            linted += 1
            yield r.line, r.body

    findings = linter.lint_bodies(bodies())
    if not linted:
        raise ValueError(skipped.none_usable("request body"))
    return findings


def _table(findings: list[Finding]) -> Table:
    table = Table(title="prompt lint", title_justify="left")
    for col in ("kind", "where", "tokens after", "requests", "text", "fix"):
        table.add_column(col, justify="right" if col in ("tokens after", "requests") else "left")
    for f in findings:
        where = f.location + (f" (line {f.line})" if f.line and "line" not in f.location else "")
        table.add_row(
            f.kind, where, f"{f.stable_tokens_after:,}", str(f.requests), f.text[:40], f.fix
        )
    return table


def lint(
    file: Annotated[
        Path, typer.Argument(help="A request body (JSON), JSON lines of bodies, or a template.")
    ],
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the findings as a JSON list.")
    ] = False,
    max_findings: Annotated[
        int, typer.Option("--max-findings", min=0, help="Exit 1 above this many findings.")
    ] = 0,
    min_stable_tokens: Annotated[
        int,
        typer.Option(min=0, help="Report a field only before at least this many stable tokens."),
    ] = DEFAULT_MIN_STABLE_TOKENS,
) -> None:
    """Find volatile fields (timestamps, ids, counters) placed before long stable content."""
    linter = Linter(LintParams(min_stable_tokens=min_stable_tokens))
    try:
        findings = lint_file(file, linter)
    except (OSError, ValueError) as exc:
        raise fail(
            f"{file}: {(exc.strerror or exc) if isinstance(exc, OSError) else exc}"
        ) from None
    if json_out:
        typer.echo(orjson.dumps([f.to_dict() for f in findings]).decode())
    elif findings:
        _out.print(_table(findings))
        _out.print(f"{len(findings)} finding(s); allowed: {max_findings}", highlight=False)
    else:
        _out.print("no volatile fields before stable content", highlight=False)
    if len(findings) > max_findings:
        raise typer.Exit(code=1)
