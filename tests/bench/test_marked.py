"""Generated Markdown blocks: only the text between a block's markers changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixrouter.bench.marked import MarkersMissing, replace_marked


def test_only_the_marked_block_is_replaced(tmp_path: Path) -> None:
    doc = tmp_path / "R.md"
    doc.write_text(
        "intro\n<!-- t:begin -->\nold\n<!-- t:end -->\nprose\n<!-- u:begin --><!-- u:end -->\n"
    )
    replace_marked(doc, "t", "| a |\n")
    replace_marked(doc, "t", "| b |")  # again: idempotent markers
    assert doc.read_text() == (
        "intro\n<!-- t:begin -->\n| b |\n<!-- t:end -->\nprose\n<!-- u:begin --><!-- u:end -->\n"
    )


def test_a_missing_block_names_the_file(tmp_path: Path) -> None:
    doc = tmp_path / "R.md"
    doc.write_text("no markers\n")
    with pytest.raises(MarkersMissing, match=r"R\.md"):
        replace_marked(doc, "t", "x")
    assert doc.read_text() == "no markers\n"
