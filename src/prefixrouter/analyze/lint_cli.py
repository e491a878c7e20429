"""``prefixrouter lint FILE``: volatile fields placed before long stable content.

``FILE`` is read as, in order: one JSON request body (or a log record
wrapping one), a JSON array of bodies (malformed items are reported as
``FILE: item N: reason``, counted from 1, on stderr and skipped), JSON lines
of bodies (malformed lines are reported as ``FILE:LINE: reason`` and skipped),
or else a prompt template (plain text); gzip is decompressed first. A file
that does not parse as one JSON document is JSON lines when it starts as JSON
does (``{"``, ``{}``, or ``[`` and ``{``, ``[``, ``"`` or ``]``), else a
template: one that opens with ``{{ now }}``, ``{% if %}`` or ``[System]`` is
linted as a template. Findings print as a table, or with ``--json`` as a JSON
list of ``{"kind", "position", "text", "stable_tokens_after", "fix", ...}``.

In a request body, the last message is the call's own (its per-call tail: the
last paragraph of a user message, all of a message of another role), so a
field in it is not reported: a request of one system message is all tail. A
field that varies from call to call is found by comparing calls: lint JSON
lines of several requests.

Exit status: 0 when there are at most ``--max-findings`` findings, 1 when
there are more, 2 when the file cannot be read or holds nothing to lint (it
is empty, not UTF-8 text, JSON that does not parse, or no line or item of it
a body); such an error names ``FILE:LINE`` when it is on one line.

The linter is :mod:`prefixrouter.prompt.lint`'s; the command lives here, with
the log reader it reads files through (:mod:`.reader`), so that
:mod:`prefixrouter.prompt` never imports the analyzer that imports it.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.table import Table

from prefixrouter.analyze.reader import (
    SkippedLines,
    format_error,
    parse_record,
    records_of_lines,
)
from prefixrouter.errors import gunzip_if_gzip
from prefixrouter.prompt.lint import DEFAULT_MIN_STABLE_TOKENS, Finding, Linter, LintParams
from prefixrouter.terminal import fail

_out = Console(width=None if sys.stdout.isatty() else 170)
_err = Console(stderr=True, highlight=False)


# How JSON text starts (module doc); template syntax ({{ x }}, {% if %}, {x}, [System]) does not.
_JSON_START = re.compile(r'\s*(?:\{\s*["}]|\[\s*[{\["\]])')


class LintInputError(ValueError):
    """A file with nothing to lint; ``line``: the 1-based line at fault (None: the file)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


def lint_file(path: Path, linter: Linter) -> list[Finding]:
    """Lint a body, an array of bodies, JSON lines of bodies or a template.

    Raises:
        OSError: The file cannot be read.
        LintInputError: It is empty, a damaged gzip file or not UTF-8 (the
            line of the first bad byte), or JSON that does not parse as an
            array (its line).
        ValueError: It is JSON but holds no request body (the message names
            the line or item and why).
    """
    try:
        raw = gunzip_if_gzip(path.read_bytes())  # as the log reader: by content, not name
    except ValueError as exc:
        raise LintInputError(str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise LintInputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", line) from None
    if not text.strip():
        # Not a template to lint: an empty template has nothing in it, and this is
        # rather a file written by a failed export.
        raise LintInputError(f"nothing to lint: {'it is empty' if not raw else 'only blanks'}")
    head = text.lstrip()
    if not head.startswith(("{", "[")):
        return linter.lint_template(text)
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if not _JSON_START.match(text):
            return linter.lint_template(text)
        if head.startswith("["):
            raise LintInputError(f"invalid JSON: {exc.msg}", exc.lineno) from None
        return _lint_json_lines(path, raw, linter)
    if isinstance(doc, dict):
        rec = parse_record(doc, 1)
        if isinstance(rec, str):
            raise ValueError(rec)
        return linter.lint_body(rec.body)
    # JSON text that starts with { or [ is an object or an array.
    skipped = SkippedLines()
    bodies: list[tuple[int, Mapping[str, Any]]] = []
    for number, item in enumerate(doc, start=1):  # counted from 1, as lines are
        rec = parse_record(item, number)
        if isinstance(rec, str):
            _err.print(f"{path}: item {number}: {rec}", markup=False, soft_wrap=True)
            skipped(number, rec)
        else:
            bodies.append((number, rec.body))
    if not bodies:
        raise ValueError(skipped.none_usable("request body", "item"))
    return linter.lint_bodies(bodies)


def _lint_json_lines(path: Path, raw: bytes, linter: Linter) -> list[Finding]:
    """Lint JSON lines of bodies (``raw``: the file's bytes, already read and
    decompressed; ``path`` names it in messages); no body on any line is an error.

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
        for r in records_of_lines(io.BytesIO(raw), on_error):
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
    """Find volatile fields (timestamps, ids, counters) placed before long stable content.

    A request's last message is its per-call tail and is not searched (a request
    of one system message is all tail): to find a field that changes per call
    there, lint several requests as JSON lines, which compares them.
    """
    linter = Linter(LintParams(min_stable_tokens=min_stable_tokens))
    try:
        findings = lint_file(file, linter)
    except LintInputError as exc:
        raise fail(
            format_error(file, exc.line, str(exc)) if exc.line else f"{file}: {exc}"
        ) from None
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
