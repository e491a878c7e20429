"""Generated blocks in Markdown files: replace the text between two markers.

A results file keeps hand-written prose around tables that scripts write. A
script owns the block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``
and rewrites only that (``benchmarks/faults_table.py``, ``benchmarks/soak.py``),
so figures are never hand-typed and prose is never overwritten.
"""

from __future__ import annotations

import re
from pathlib import Path


class MarkersMissing(ValueError):
    """The file has no ``begin``/``end`` pair for the block."""


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_marked(path: Path, name: str, text: str) -> None:
    """Put ``text`` between block ``name``'s markers in ``path`` (everything else kept).

    Raises:
        MarkersMissing: ``path`` has no such block (naming the file and markers).
    """
    begin, end = markers(name)
    content = path.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(content):
        raise MarkersMissing(f"{path}: no {begin} ... {end} block")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{text.strip()}\n{end}", content, count=1))
