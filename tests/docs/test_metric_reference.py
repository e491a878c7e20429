"""docs/metrics.md lists exactly the series live gateways export, with their types and labels."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.conftest import Page

DOC = Path(__file__).parents[2] / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `(prefixrouter_[a-z_]+)` \| (counter|gauge|histogram) \| ([^|]+) \|")


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    """Family name -> (type, label names), from the reference's tables."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `prefixrouter_"):
            continue
        m = _ROW.match(line)
        assert m is not None, f"malformed row: {line[:80]}"
        assert line.count(" | ") == 4, f"a row has five cells: {line[:80]}"
        name, kind, labels = m.groups()
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family not in out, f"{name} listed twice"
        names = frozenset(re.findall(r"`([a-z_]+)`", labels))
        assert names or labels.strip() == "none", line[:80]
        out[family] = (kind, names)
    return out


def test_the_reference_lists_exactly_the_exported_families(live_pages: dict[str, Page]) -> None:
    exported: dict[str, str] = {}
    for page in live_pages.values():
        exported |= page.families
    doc = documented()
    assert sorted(set(exported) - set(doc)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(doc) - set(exported)) == [], "in docs/metrics.md but not exported"
    assert {name: kind for name, (kind, _) in doc.items()} == exported


def test_the_reference_names_each_series_labels(live_pages: dict[str, Page]) -> None:
    checked = 0
    for family, (kind, labels) in documented().items():
        sample = {"counter": family + "_total", "histogram": family + "_bucket"}.get(kind, family)
        seen: set[str] = set()
        for page in live_pages.values():
            seen |= page.labels_of(sample)
        if not any(sample in p.sample_names for p in live_pages.values()):
            continue  # declared without a sample yet (no retry, no lint finding): types only
        assert seen - {"le"} == labels, family
        checked += 1
    assert checked >= 35  # nearly every family has samples after the fixture's traffic
